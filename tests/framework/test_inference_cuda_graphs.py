"""Decode steps as captured CUDA graphs (`phalanx.inference.cuda_graphs`).

On the CPU the captured steps run in "eager" mode: the same fixed buffers, padding rows and
scratch block, with the forward called instead of a graph replayed. So everything but the capture
itself is checked here token for token; the `gpu` test checks real graphs against the eager engine
and transformers on a GPU."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams
from phalanx.inference.cuda_graphs import batch_sizes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-models")
    tokenizer = im.make_tokenizer()
    return {family: im.save_model(root / family, family, tokenizer=tokenizer) for family in ("llama", "mistral")}


def _engine(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 8)
    kw.setdefault("num_blocks", 96)
    return LLM(str(path), **kw)


def _with_decode_graphs(eng: LLM) -> LLM:
    """The engine's runner with captured decode steps in eager mode (off CUDA): a fresh KV cache
    with the scratch block, nothing cached yet."""
    runner = eng.runner
    runner.graphs_reason = None
    runner.allocate_kv_cache(runner.num_blocks)
    assert runner.graphs is not None and runner.graphs.mode == "eager"
    eng.block_manager.reset_prefix_cache()
    return eng


def test_batch_sizes_cover_every_count_up_to_the_limit():
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(1) == [1]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_captured_decode_steps_give_the_tokens_of_the_normal_path(models, family):
    """Nine prompts with different output lengths, so the batch shrinks through padded sizes
    (9 -> 16 rows, then 8, 4, 2, 1) and sequences finish while others decode; Mistral's sliding
    window goes through the masked path. Greedy tokens equal transformers' one prompt at a time."""
    path, model = models[family]
    prompts = im.mixed_prompts(9, seed=5, low=3, high=40)
    params = [SamplingParams(max_new_tokens=4 + 2 * i, temperature=0) for i in range(9)]
    eng = _with_decode_graphs(_engine(path, max_num_seqs=16))
    outs = eng.generate(prompts, params)
    graphs = eng.runner.graphs
    assert graphs.replays > 0 and {16, 8, 4, 2, 1} <= set(graphs.steps)
    for out, prompt, p in zip(outs, prompts, params, strict=True):
        assert out.token_ids == im.hf_greedy(model, prompt, p.max_new_tokens)
    assert eng.block_manager.all_free()


def test_padding_rows_never_write_to_blocks_sequences_own(models):
    """After a wide step, narrower steps must not replay the departed rows' cache writes: with
    a cache just big enough that freed blocks are reused at once, a stale slot in a padding row
    would overwrite a live sequence's keys. Sampled requests with seeds: tokens equal the run
    without captured steps."""
    path, _ = models["llama"]
    prompts = im.mixed_prompts(12, seed=9, low=10, high=30)
    params = [SamplingParams(max_new_tokens=3 + (i * 5) % 17, temperature=0.8, seed=i) for i in range(12)]
    want = [o.token_ids for o in _engine(path, num_blocks=40, max_num_seqs=8).generate(prompts, params)]
    eng = _with_decode_graphs(_engine(path, num_blocks=40, max_num_seqs=8))
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got == want
    assert eng.runner.graphs.replays > 0 and eng.block_manager.all_free()


def test_a_narrow_step_after_a_wide_one_writes_only_its_own_slots(models):
    """The invariant padding keeps: a decode step of n sequences writes the cache at their n slots
    and in the scratch block, nowhere else, whatever wider step ran before it (its departed rows
    still hold their slots in the fixed buffers)."""
    from phalanx.inference.model_runner import Chunk
    path, _ = models["llama"]
    eng = _with_decode_graphs(_engine(path, max_num_seqs=8))
    runner, bs = eng.runner, 8
    chunks = [Chunk([7 + i], start=5 + i, block_table=[2 * i, 2 * i + 1]) for i in range(8)]
    runner.execute(chunks)  # 8 rows
    for c in chunks[5:]:  # the departed sequences' blocks, taken over by others (who wrote there)
        for k, v in runner.kv_caches:
            k[c.block_table[c.start // bs], c.start % bs] = 3.0
            v[c.block_table[c.start // bs], c.start % bs] = 3.0
    before = [k.clone() for k, _ in runner.kv_caches]
    narrow = [Chunk([40 + i], start=c.start, block_table=c.block_table) for i, c in enumerate(chunks[:5])]
    runner.execute(narrow)  # 5 rows, padded to 8
    written = {c.block_table[c.start // bs] * bs + c.start % bs for c in narrow}
    scratch = set(range(runner.graphs.scratch_block * bs, (runner.graphs.scratch_block + 1) * bs))
    for (k, _), old in zip(runner.kv_caches, before):
        changed = (k != old).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # slots
        assert set(changed) <= written | scratch and set(changed) & written


def test_lora_adapters_in_captured_steps_give_each_merged_models_tokens(models, tmp_path):
    """Base, a1 and a2 requests in one captured batch: each row's adapter is a one-hot over every
    slot in a fixed buffer, so one capture serves any mix; greedy tokens equal each adapter's merged
    model. An adapter loaded afterwards that adapts other matmuls (new factor stacks: the forward
    changed) is captured again; one loaded into existing stacks is read in place."""
    pytest.importorskip("peft")
    path, base = models["llama"]
    refs = {None: base}
    refs["a1"] = im.make_adapter(tmp_path / "a1", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    refs["a2"] = im.make_adapter(tmp_path / "a2", 2, r=8, lora_alpha=8, target_modules=["o_proj", "down_proj"])
    refs["a3"] = im.make_adapter(tmp_path / "a3", 3, r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj"])
    eng = _engine(path, enable_lora=True, max_loras=3, max_lora_rank=8)
    for name in ("a1", "a2"):
        eng.load_lora_adapter(name, tmp_path / name)
    _with_decode_graphs(eng)
    prompts = im.mixed_prompts(5, seed=6, low=4, high=24)

    def run(names):
        params = [SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, lora_name=n) for n in names]
        for out, prompt, name in zip(eng.generate(prompts, params), prompts, names, strict=True):
            assert out.token_ids == im.hf_greedy(refs[name], prompt, 6), name
    run([None, "a1", "a2", "a2", None])
    graphs = eng.runner.graphs
    captured = graphs.captures
    assert graphs.replays > 0 and captured == len(graphs.steps)
    eng.load_lora_adapter("a3", tmp_path / "a3")  # gate_up gains stacks: captures are redone
    run(["a3", "a1", None, "a3", "a2"])
    assert eng.runner.graphs is graphs and graphs.captures == captured + len(graphs.steps)
    assert eng.block_manager.all_free()


def test_prefills_and_speculative_verification_stay_on_the_normal_path(models):
    """Only one-token, one-logit chunks are captured: a draft model's proposals are, the target's
    verification of k + 1 tokens is not; speculative output equals plain greedy output."""
    path, model = models["llama"]
    prompts = im.mixed_prompts(3, seed=2, low=5, high=20)
    eng = _engine(path, draft_model=str(path), num_speculative_tokens=3)
    _with_decode_graphs(eng)
    draft = eng.draft_runner
    draft.graphs_reason = None
    draft.allocate_kv_cache(draft.num_blocks)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    assert [o.token_ids for o in outs] == [im.hf_greedy(model, p, 12) for p in prompts]
    assert draft.graphs.replays > 0  # the draft's proposals ran captured
    assert eng.block_manager.all_free()


@pytest.mark.parametrize("fault", ["capture raises", "replay disagrees"])
def test_a_failed_or_wrong_capture_falls_back_to_eager_steps(models, monkeypatch, caplog, fault):
    """A capture that raises, or whose first replay differs from the eager step (checked on every
    new batch size), disables the graphs with one warning; the step and all later ones run eagerly
    and the tokens are still transformers'."""
    from phalanx.inference import cuda_graphs

    def broken_capture(self, size):
        if fault == "capture raises":
            raise RuntimeError("operation not permitted when stream is capturing")
        def wrong():  # a graph that computes something else: token 5 wins every row
            logits = self._forward(size).clone()
            logits[:, 5] += 1e4
            return logits
        return wrong
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", broken_capture)
    path, model = models["llama"]
    prompts = im.mixed_prompts(3, seed=4, low=3, high=20)
    eng = _with_decode_graphs(_engine(path))
    with caplog.at_level("WARNING", logger="phalanx.inference"):
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == [im.hf_greedy(model, p, 6) for p in prompts]
    assert eng.runner.graphs is None and "decode step failed" in eng.runner.graphs_reason
    assert [r.getMessage() for r in caplog.records].count(f"decode steps run eagerly: {eng.runner.graphs_reason}") == 1


def test_cuda_graphs_setting_is_checked(models):
    path, _ = models["llama"]
    with pytest.raises(ValueError, match="cuda_graphs=True, but CUDA graphs need a CUDA device.*cuda_graphs='auto'"):
        _engine(path, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs='yes': choose 'auto', True or False"):
        _engine(path, cuda_graphs="yes")
    eng = _engine(path)  # auto on the CPU: off, said why
    assert eng.runner.graphs is None and "CUDA device" in eng.runner.graphs_reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cuda_graph_decode_matches_the_eager_engine_and_transformers(models, family):
    """On a GPU, cuda_graphs='auto' captures decode steps; fp32 greedy tokens equal the engine
    without graphs and transformers on the same device, with the batch shrinking through sizes."""
    import copy
    path, model = models[family]
    prompts = im.mixed_prompts(9, seed=13, low=3, high=50)
    params = [SamplingParams(max_new_tokens=4 + 2 * i, temperature=0) for i in range(9)]
    graphed = _engine(path, device="cuda", max_num_seqs=16)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.mode == "cuda", graphed.runner.graphs_reason
    eager = _engine(path, device="cuda", max_num_seqs=16, cuda_graphs=False)
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    hf = copy.deepcopy(model).to("cuda")
    assert got == [im.hf_greedy_batch(hf, [p], q.max_new_tokens, device="cuda")[0] for p, q in zip(prompts, params)]
    assert graphed.runner.graphs.replays > 0 and {16, 8, 4, 2, 1} <= set(graphed.runner.graphs.steps)
    assert graphed.block_manager.all_free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_with_lora_adapters_matches_the_eager_engine(models, tmp_path):
    """Captured decode steps with base / a1 / a2 rows mixed: fp32 greedy tokens equal the engine without
    graphs on the same GPU and each adapter's merged model."""
    pytest.importorskip("peft")
    path, base = models["llama"]
    refs = {None: base}
    refs["a1"] = im.make_adapter(tmp_path / "a1", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    refs["a2"] = im.make_adapter(tmp_path / "a2", 2, r=8, lora_alpha=8, target_modules=["o_proj", "down_proj"])
    prompts = im.mixed_prompts(5, seed=6, low=4, high=24)
    names = [None, "a1", "a2", "a2", None]
    params = [SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, lora_name=n) for n in names]
    got = {}
    for graphs in ("auto", False):
        eng = _engine(path, device="cuda", enable_lora=True, max_loras=2, max_lora_rank=8, cuda_graphs=graphs)
        for name in ("a1", "a2"):
            eng.load_lora_adapter(name, tmp_path / name)
        got[graphs] = [o.token_ids for o in eng.generate(prompts, params)]
        if graphs == "auto":
            assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0, eng.runner.graphs_reason
    assert got["auto"] == got[False] == [im.hf_greedy(refs[n], p, 6) for n, p in zip(names, prompts)]
