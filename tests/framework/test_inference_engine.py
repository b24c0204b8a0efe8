"""phalanx.inference.LLM end to end on tiny Llama / Qwen2 / Mistral models: token identity with
`transformers` greedy generation, continuous batching, preemption, prefix caching, chunked
prefill, sampling options (n / best_of sharing the prompt's blocks, penalties, logit bias, echo),
log-probs, live weights, and speculative decoding."""
from __future__ import annotations

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams, packed_linear
from phalanx.inference.engine import sample_seed

GREEDY = SamplingParams(max_new_tokens=20, temperature=0)


@pytest.fixture(scope="module")
def tokenizer():
    return im.make_tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """family -> (directory, HF model)"""
    root = tmp_path_factory.mktemp("inference-models")
    return {family: im.save_model(root / family, family, tokenizer=tokenizer) for family in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="module")
def llama(models):
    return models["llama"]


def engine(path, **kw):
    """An engine in float32 unless told (dtype="auto" would follow the CPU: bf16 on AMX), so the
    tokens can be compared with the fp32 HF models."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_blocks", 96)
    kw.setdefault("block_size", 8)
    return LLM(str(path), **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_tokens_match_transformers_for_a_mixed_length_batch(models, family):
    path, model = models[family]
    prompts = im.mixed_prompts(6, seed=1, low=3, high=50)  # mistral's window is 24: most prompts pass it
    eng = engine(path)
    outs = eng.generate(prompts, GREEDY)
    want_batched = im.hf_greedy_batch(model, prompts, 20)
    want_alone = [im.hf_greedy(model, p, 20) for p in prompts]
    for out, batched, alone in zip(outs, want_batched, want_alone, strict=True):
        assert out.token_ids == alone == batched
        assert out.prompt_token_ids in prompts
    assert eng.block_manager.all_free()


def test_mistral_sliding_window_is_honoured(models):
    """The Mistral model's outputs depend on its window: the same weights without it differ."""
    path, model = models["mistral"]
    prompt = im.mixed_prompts(1, seed=3, low=45, high=46)[0]
    ours = engine(path).generate(prompt, GREEDY)[0].token_ids
    assert ours == im.hf_greedy(model, prompt, 20)
    unwindowed = im.make_model("mistral", sliding_window=None)
    assert im.hf_greedy(unwindowed, prompt, 20) != ours


ORIGINAL_CONTEXT = 32  # the models' max_position_embeddings is 256: an 8x longer context
ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL_CONTEXT},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL_CONTEXT},
}


@pytest.mark.parametrize("rope_type", list(ROPE_SCALINGS))
def test_scaled_rope_matches_transformers_past_the_original_context(rope_type, tmp_path, tokenizer):
    """llama3 and YaRN RoPE scaling (transformers 5 reads them from `rope_parameters`): greedy
    tokens and log-probs equal Hugging Face's own forward on prompts 2-3x longer than the
    original context; the same weights with plain RoPE give other logits, so scaling matters."""
    rope = {"rope_theta": 10000.0, **ROPE_SCALINGS[rope_type]}
    path, model = im.save_model(tmp_path / rope_type, "llama", tokenizer=tokenizer, rope_parameters=rope)
    assert type(model.config).from_pretrained(path).rope_parameters["rope_type"] == rope_type
    prompts = im.mixed_prompts(3, seed=11, low=2 * ORIGINAL_CONTEXT, high=3 * ORIGINAL_CONTEXT)
    outs = engine(path).generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, logprobs=1))
    plain = im.make_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    plain.load_state_dict(model.state_dict())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == im.hf_greedy(model, prompt, 16)
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            plain_logp = torch.log_softmax(plain(ids).logits[0].float(), -1)
        n = len(prompt)
        want = torch.tensor([logp[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)])
        assert (torch.tensor(out.logprobs) - want).abs().max().item() < 1e-4  # measured <= 1.2e-5
        # plain RoPE on the same weights: log-probs differ by ~9 nats and greedy picks other tokens
        assert (logp[n - 1:] - plain_logp[n - 1:]).abs().max().item() > 1.0
        assert im.hf_greedy(plain, prompt, 16) != out.token_ids


def test_requests_arriving_mid_run_get_the_tokens_they_get_alone(llama):
    path, _ = llama
    prompts = im.mixed_prompts(6, seed=2, low=4, high=40)
    eng = engine(path)
    alone = [eng.generate(p, GREEDY)[0].token_ids for p in prompts]
    owner, got, pending, step = {}, {}, list(enumerate(prompts)), 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step, while others decode
            i, p = pending.pop(0)
            owner[eng.add_request(p, GREEDY)] = i
        for out in eng.step():
            if out.finished:
                got[owner[out.request_id]] = out.token_ids
        step += 1
    assert [got[i] for i in range(len(prompts))] == alone
    assert eng.block_manager.all_free()


def test_preemption_recomputes_to_the_same_tokens_and_leaks_no_block(llama):
    path, model = llama
    prompts = im.mixed_prompts(8, seed=4, low=10, high=40)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    eng = engine(path, num_blocks=16, block_size=8)  # 128 slots for 8 sequences of up to 63 tokens
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == im.hf_greedy_batch(model, prompts, 24)
    assert eng.block_manager.all_free()


def test_chunked_prefill_and_prefix_cache_give_the_same_tokens(llama):
    path, model = llama
    system = im.mixed_prompts(1, seed=5, low=30, high=31)[0]
    prompts = [system + p for p in im.mixed_prompts(4, seed=6, low=3, high=12)]
    want = im.hf_greedy_batch(model, prompts, 20)
    eng = engine(path, max_num_batched_tokens=16)  # prompts of 33-44 tokens run in chunks of <= 16
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    eng = engine(path)
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 24, 24, 24]  # three full blocks of the shared prefix
    again = eng.generate(prompts, GREEDY)  # freed blocks are still cached
    assert [o.token_ids for o in again] == want and min(o.num_cached_tokens for o in again) >= 24
    assert eng.block_manager.all_free()


def test_text_prompts_stop_strings_eos_and_length(llama, tokenizer):
    path, _ = llama
    eng = engine(path)
    text = "Paged attention stores keys"
    full = eng.generate(text, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    assert full.prompt_token_ids == tokenizer(text)["input_ids"] and len(full.token_ids) == 12
    assert full.finish_reason == "length" and full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)
    # a stop string taken from the greedy output cuts the text before it
    stop = full.text[len(full.text) // 2:][:3]
    cut = eng.generate(text, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == full.text[:full.text.find(stop)]
    # a stop token ends the output and is kept in token_ids
    token = full.token_ids[5]
    ended = eng.generate(text, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[token]))[0]
    assert ended.token_ids == full.token_ids[:full.token_ids.index(token) + 1] and ended.stop_reason == token
    # EOS: a prompt whose greedy continuation reaches EOS (id 2) stops there unless ignore_eos
    eos_outs = eng.generate(im.mixed_prompts(40, seed=7), SamplingParams(max_new_tokens=30, temperature=0))
    stopped = [o for o in eos_outs if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] == 2 and 2 not in o.token_ids[:-1] for o in stopped)
    assert eng.block_manager.all_free()


def test_logprobs_match_the_model_and_seeded_sampling_repeats(llama):
    path, model = llama
    prompts = im.mixed_prompts(3, seed=8, low=5, high=20)
    eng = engine(path)
    out = eng.generate(prompts[0], SamplingParams(max_new_tokens=8, temperature=0, logprobs=3))[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompts[0] + out.token_ids])).logits[0].float(), -1)
    n = len(prompts[0])
    want = [logp[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(out.logprobs, want, strict=True)) < 1e-4
    # greedy = the top token
    assert all(list(top)[0] == t for top, t in zip(out.top_logprobs, out.token_ids, strict=True))
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    alone = eng.generate(prompts[1], sampled)[0].token_ids
    in_batch = eng.generate(prompts, [SamplingParams(max_new_tokens=16, temperature=1.0)] * 1 + [sampled]
                            + [SamplingParams(max_new_tokens=16, temperature=0.5)])[1].token_ids
    assert alone == in_batch
    assert eng.generate(prompts[1], SamplingParams(max_new_tokens=16, temperature=0.9, seed=99))[0].token_ids != alone


def test_kv_blocks_are_sized_from_the_memory_budget(llama):
    path, _ = llama
    # kv_cache_memory_gib is the CPU budget (a GPU's is its free memory): on the CPU even under emulation
    eng = LLM(str(path), kv_cache_memory_gib=1 / 1024, block_size=8, max_num_seqs=64, device="cpu",
              dtype="float32")
    per_block = 2 * 2 * 2 * 16 * 8 * 4  # K and V x layers x KV heads x head_dim x tokens x fp32
    assert eng.num_blocks == (2**20) // per_block
    tight = LLM(str(path), kv_cache_memory_gib=1 / 1024, block_size=8, max_num_seqs=2, device="cpu", dtype="float32")
    assert tight.num_blocks == 2 * (256 // 8) + 1  # never more than max_num_seqs full-length sequences use


def test_weights_from_a_live_module_and_reload(llama, tokenizer):
    path, model = llama
    prompt = im.mixed_prompts(1, seed=9)[0]
    eng = LLM.from_model(model, tokenizer, num_blocks=64, block_size=8, dtype="float32")
    assert eng.generate(prompt, GREEDY)[0].token_ids == im.hf_greedy(model, prompt, 20)
    other = im.make_model("llama", seed=11)
    assert eng.load_weights(other.state_dict()) == len(other.state_dict())
    assert eng.generate(prompt, GREEDY)[0].token_ids == im.hf_greedy(other, prompt, 20)
    # a wrapped module's names (DDP / torch.compile prefixes) load too
    eng.load_weights({"module." + k: v for k, v in model.state_dict().items()})
    assert eng.generate(prompt, GREEDY)[0].token_ids == im.hf_greedy(model, prompt, 20)
    eng.add_request(prompt, GREEDY)
    with pytest.raises(RuntimeError, match="requests in flight"):
        eng.load_weights(other.state_dict())
    with pytest.raises(ValueError, match="do not belong"):
        LLM.from_model(im.make_model("llama", num_hidden_layers=1), tokenizer).load_weights({"model.layers.5.mlp.up_proj.weight": torch.zeros(1)})


def _unpacked(eng: LLM) -> LLM:
    """The engine with its packed matmul weights dropped: every matmul runs plain F.linear."""
    for layer in eng.runner.model.layers:
        layer.packed = {}
    eng.runner.model._lm_head_packed = None
    return eng


def test_bf16_packed_weights_give_the_same_tokens_and_follow_reloads(llama, tokenizer):
    """On CPU, bf16 matmul weights are packed once for oneDNN: the tokens equal plain F.linear's,
    and load_weights repacks (a stale packed copy would keep generating with the old weights)."""
    path, _ = llama
    prompts = im.mixed_prompts(4, seed=14, low=3, high=30)
    eng = engine(path, dtype="bfloat16")
    if not packed_linear.can_pack(eng.runner.model.lm_head):
        pytest.skip("no oneDNN, or a CPU without native bf16 (that path: the test below)")
    assert all(set(layer.packed) == {"qkv", "o", "gate_up", "down"} for layer in eng.runner.model.layers)
    packed = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert packed == [o.token_ids for o in _unpacked(engine(path, dtype="bfloat16")).generate(prompts, GREEDY)]
    other = im.make_model("llama", seed=11)
    eng.load_weights(other.state_dict())
    want = _unpacked(LLM.from_model(other, tokenizer, dtype="bfloat16", num_blocks=96, block_size=8))
    reloaded = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert reloaded == [o.token_ids for o in want.generate(prompts, GREEDY)] and reloaded != packed


def test_bf16_on_a_cpu_without_native_bf16_runs_unpacked_and_auto_picks_fp32(llama, tmp_path, monkeypatch):
    """Where bf16 is emulated (AVX2-only CPUs), oneDNN's bf16 reorder refuses to run: an explicit
    bfloat16 engine warns and runs plain F.linear, and dtype="auto" on a bf16 checkpoint runs fp32."""
    from phalanx.amp import precision
    from phalanx_kernels import capability

    path, _ = llama
    monkeypatch.setenv("PHALANX_CPU_BF16", "emulated")
    monkeypatch.setattr(precision, "_warned", set())  # warned once per process: maybe already
    capability.cpu_bf16_support.cache_clear()
    try:
        prompts = im.mixed_prompts(3, seed=15, low=3, high=30)
        with pytest.warns(UserWarning, match="dtype=bfloat16 on a CPU without native bf16.*dtype=auto"):
            eng = engine(path, dtype="bfloat16")
        assert eng.runner.model.layers[0].packed == {} and eng.runner.model._lm_head_packed is None
        outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
        assert outs == [o.token_ids for o in _unpacked(engine(path, dtype="bfloat16")).generate(prompts, GREEDY)]
        bf16 = im.make_model("llama").to(torch.bfloat16)
        bf16.save_pretrained(tmp_path / "bf16")  # a checkpoint whose config says bfloat16
        auto = LLM(str(tmp_path / "bf16"), tokenizer=eng.tokenizer, num_blocks=96, block_size=8)
        assert auto.runner.dtype == torch.float32
    finally:
        capability.cpu_bf16_support.cache_clear()


def test_speculative_decoding_keeps_greedy_tokens(models, tmp_path):
    path, model = models["llama"]
    prompts = im.mixed_prompts(5, seed=10, low=4, high=30)
    want = im.hf_greedy_batch(model, prompts, 20)
    draft, _ = im.save_model(tmp_path / "draft", "llama", seed=0, num_hidden_layers=1)
    eng = engine(path, draft_model=str(draft), num_speculative_tokens=3)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    assert eng.block_manager.all_free()
    # forked samples join speculative steps too: the draft's cache holds their recomputed tails
    forked = eng.generate(prompts[1], SamplingParams(n=2, max_new_tokens=20, temperature=0))[0]
    assert [o.token_ids for o in forked.outputs] == [want[1]] * 2 and eng.block_manager.all_free()
    # seeded sampling with a draft model repeats for the same calls (docs/inference.md says why not
    # alone vs in any batch: whether and how far a step speculates depends on the batch)
    seeded = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    first = [o.token_ids for o in eng.generate(prompts, seeded)]
    assert [o.token_ids for o in eng.generate(prompts, seeded)] == first
    same = engine(path, draft_model=model, num_speculative_tokens=4)  # a perfect draft
    assert [o.token_ids for o in same.generate(prompts, GREEDY)] == want
    assert same.speculator.acceptance_rate == 1.0
    out = same.generate(prompts[0], SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, logprobs=1))[0]
    assert len(out.token_ids) == len(out.logprobs) and out.finish_reason in ("stop", "length")


def test_speculative_decoding_at_the_context_limit_and_with_the_pool_nearly_full(models, tmp_path):
    """Issue 36: requests that run to max_model_len (verification would look past the RoPE table)
    and a KV pool with no room for the lookahead slots (a sequence used to preempt itself and
    leave the step empty) finish with the tokens of the same engine without a draft model."""
    path, _ = models["llama"]
    draft, _ = im.save_model(tmp_path / "draft", "llama", seed=0, num_hidden_layers=1)
    prompts = im.mixed_prompts(4, seed=11, low=10, high=30)
    limit = 48
    to_the_limit = [SamplingParams(max_new_tokens=limit - len(p), temperature=0, ignore_eos=True) for p in prompts]
    plain = engine(path, max_model_len=limit).generate(prompts, to_the_limit)
    spec = engine(path, max_model_len=limit, draft_model=str(draft), num_speculative_tokens=4)
    got = spec.generate(prompts, to_the_limit)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert all(len(p) + len(o.token_ids) == limit for p, o in zip(prompts, got, strict=True))
    assert spec.speculator.num_proposed > 0 and spec.block_manager.all_free()
    # 12 blocks of 8 slots for 4 requests of up to 38 tokens: the pool runs nearly full, so lookahead
    # slots often do not fit (plain steps then) and plain decoding preempts as it always did
    params = SamplingParams(max_new_tokens=16, temperature=0)
    want = engine(path, num_blocks=12).generate(prompts, params)
    tight = engine(path, num_blocks=12, draft_model=str(draft), num_speculative_tokens=4)
    assert [o.token_ids for o in tight.generate(prompts, params)] == [o.token_ids for o in want]
    assert tight.speculator.num_proposed > 0 and tight.block_manager.all_free()
    # one request that needs every block of the cache (prompt + max_new_tokens = 5 blocks of 8):
    # lookahead stays inside the request, so it never asks for a sixth
    prompt, params = prompts[0][:20], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    want = engine(path, num_blocks=5).generate(prompt, params)[0].token_ids
    full = engine(path, num_blocks=5, draft_model=str(draft), num_speculative_tokens=4)
    assert full.generate(prompt, params)[0].token_ids == want and len(want) == 20
    assert full.speculator.num_proposed > 0 and full.block_manager.all_free()


def test_bad_requests_and_models_are_refused_clearly(llama, tmp_path):
    path, _ = llama
    eng = engine(path)
    with pytest.raises(ValueError, match="max_model_len=256"):
        eng.generate([5] * 250, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([5, 10_000])
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    with pytest.raises(TypeError, match="string or a list of token ids"):
        eng.add_request(3.5)
    with pytest.raises(ValueError, match="tp_size=3 does not divide"):
        LLM(str(path), tp_size=3)
    from transformers import GPTNeoXConfig
    GPTNeoXConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64).save_pretrained(tmp_path / "neox")
    with pytest.raises(ValueError, match="model type 'gpt_neox' is not supported.*llama, mistral, qwen2, qwen3, gpt2, opt"):
        LLM(str(tmp_path / "neox"))
    with pytest.raises(ValueError, match=r"logit_bias token ids \[1000\] are outside the vocabulary"):
        eng.add_request([5, 6], SamplingParams(logit_bias={1000: 1.0}))
    with pytest.raises(ValueError, match="asks for 5 samples.*max_num_seqs=4"):
        engine(path, max_num_seqs=4).add_request([5, 6], SamplingParams(n=5))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))


@pytest.mark.gpu
def test_cuda_engine_with_triton_kernels_matches_transformers(models):
    """On a GPU the runner takes phalanx_kernels' Triton paths (RoPE + cache write, paged decode,
    flash prefill); fp32 greedy tokens still match transformers on the same device."""
    path, model = models["llama"]
    prompts = im.mixed_prompts(6, seed=13, low=3, high=50)
    eng = engine(path, device="cuda")
    outs = eng.generate(prompts, GREEDY)
    import copy
    want = im.hf_greedy_batch(copy.deepcopy(model).to("cuda"), prompts, 20, device="cuda")
    assert [o.token_ids for o in outs] == want
    assert eng.block_manager.all_free()


def _model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(token i + 1 | tokens 0..i) under the HF model, [len(ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_n_samples_share_the_prompt_blocks_and_equal_single_requests(llama):
    """n=4 samples of a 37-token prompt (block 8: 4 full blocks + 5 tokens): the prompt is
    prefilled once and its 4 full blocks are shared, so at the peak the cache holds 4 shared + 2
    own blocks per sample (tail + output), not 4 x 6. Each sample draws exactly what a single
    request with its seed draws; prefix caching is off, so the sharing is the fork's."""
    path, model = llama
    eng = engine(path, enable_prefix_caching=False)
    prompt = im.mixed_prompts(1, seed=21, low=37, high=38)[0]
    n, new = 4, 6
    rid = eng.add_request(prompt, SamplingParams(n=n, max_new_tokens=new, temperature=1.0, seed=7, logprobs=0))
    peak, last, streamed = 0, None, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == rid and len(out.outputs) == n
            last, streamed = out, streamed + 1
        peak = max(peak, eng.num_blocks - eng.block_manager.num_free_blocks)
    assert eng.block_manager.all_free()
    prompt_blocks = -(-len(prompt) // 8)
    assert peak == 4 + 2 * n < n * prompt_blocks
    assert streamed >= new and last.finished and [o.index for o in last.outputs] == list(range(n))
    assert last.text == last.outputs[0].text and last.token_ids == last.outputs[0].token_ids  # the n == 1 fields
    samples = [o.token_ids for o in last.outputs]
    assert len({tuple(s) for s in samples}) > 1, "the samples should differ"
    for j, sample in enumerate(samples):
        alone = eng.generate(prompt, SamplingParams(max_new_tokens=new, temperature=1.0, seed=sample_seed(7, j)))[0]
        assert alone.token_ids == sample, f"sample {j}"
    logp = _model_logprobs(model, prompt + samples[2])  # a forked sample's log-probs are the model's
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(samples[2])]
    assert max(abs(a - b) for a, b in zip(last.outputs[2].logprobs, want, strict=True)) < 1e-4
    greedy = eng.generate(prompt, SamplingParams(n=3, max_new_tokens=new, temperature=0))[0]
    assert [o.token_ids for o in greedy.outputs] == [im.hf_greedy(model, prompt, new)] * 3
    assert eng.block_manager.all_free()


def test_best_of_keeps_the_samples_with_the_highest_cumulative_logprob(llama):
    path, model = llama
    eng = engine(path)
    prompt = im.mixed_prompts(1, seed=22, low=12, high=13)[0]
    every = eng.generate(prompt, SamplingParams(n=5, max_new_tokens=8, temperature=1.2, seed=3, logprobs=0))[0]
    best = eng.generate(prompt, SamplingParams(n=2, best_of=5, max_new_tokens=8, temperature=1.2, seed=3))[0]
    ranked = sorted(every.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked]
    assert [o.index for o in best.outputs] == [0, 1] and best.logprobs is None  # log-probs were not asked for
    for out in best.outputs:  # the ranking uses the model's own log-probs of the sampled tokens
        logp = _model_logprobs(model, prompt + out.token_ids)
        want = sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids))
        assert abs(out.cumulative_logprob - want) < 1e-4 * len(out.token_ids)
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert best.outputs[1].cumulative_logprob >= max(o.cumulative_logprob for o in every.outputs
                                                     if o.token_ids not in [b.token_ids for b in best.outputs])


def test_repetition_penalty_and_logit_bias_match_transformers_generate(llama):
    path, model = llama
    eng = engine(path)
    prompts = im.mixed_prompts(3, seed=23, low=5, high=30)
    bias = {50: 3.0, 171: -100.0, 264: 2.0, 7: 5.0}
    ours = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.3,
                                                logit_bias=bias))
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, pad_token_id=0, repetition_penalty=1.3,
                                sequence_bias={(t,): b for t, b in bias.items()})
        want = hf[0, len(prompt):].tolist()
        assert out.token_ids == want[:len(out.token_ids)]
    plain = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    assert [o.token_ids for o in ours] != [o.token_ids for o in plain]


def test_presence_and_frequency_penalties_by_hand_over_the_model_logits(llama):
    """Greedy with OpenAI's penalties: each token is the argmax of the model's logits minus
    frequency * count + presence * seen, counts over the tokens generated before it."""
    path, model = llama
    eng = engine(path)
    prompt = im.mixed_prompts(1, seed=24, low=10, high=11)[0]
    params = SamplingParams(max_new_tokens=16, temperature=0, frequency_penalty=0.9, presence_penalty=0.6,
                            ignore_eos=True)
    out = eng.generate(prompt, params)[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    for i, token in enumerate(out):
        row = logits[len(prompt) - 1 + i].clone()
        for t in set(out[:i]):
            row[t] -= 0.9 * out[:i].count(t) + 0.6
        assert int(row.argmax()) == token, f"step {i}"
    plain = eng.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    assert plain != out  # the tiny model repeats itself: the penalties must change something


def test_echo_returns_the_prompt_with_its_logprobs(llama, tokenizer):
    """echo puts the prompt's text, tokens and log-probs (from the model, None for the first
    token) in front of the completion; prompt log-probs need every position, so the prefix cache
    is bypassed for that request."""
    path, model = llama
    eng = engine(path)
    text = "Hello world! How are you today? I am fine"
    ids = eng.tokenize(text)
    eng.generate(text, SamplingParams(max_new_tokens=2, temperature=0))  # fills the prefix cache
    out = eng.generate(text, SamplingParams(max_new_tokens=5, temperature=0, echo=True, logprobs=2))[0]
    n = len(ids)
    assert out.token_ids[:n] == ids and len(out.token_ids) == n + 5 and out.text.startswith(text)
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == n - 1
    assert out.logprobs[0] is None and out.top_logprobs[0] is None
    logp = _model_logprobs(model, out.token_ids)
    want = [logp[i - 1, t].item() for i, t in enumerate(out.token_ids) if i > 0]
    assert max(abs(a - b) for a, b in zip(out.logprobs[1:], want, strict=True)) < 1e-4
    for i in range(1, n):  # the prompt's top tokens are the model's
        assert list(out.top_logprobs[i]) == logp[i - 1].topk(2).indices.tolist()
    plain = eng.generate(text, SamplingParams(max_new_tokens=5, temperature=0, echo=True))[0]
    assert plain.text == out.text and plain.logprobs is None and plain.prompt_logprobs is None
    assert eng.block_manager.all_free()


def test_aborting_an_n_request_frees_the_blocks_of_every_sample(llama):
    path, _ = llama
    eng = engine(path)
    rid = eng.add_request(im.mixed_prompts(1, seed=25, low=20, high=21)[0],
                          SamplingParams(n=3, max_new_tokens=30, temperature=1.0))
    eng.step()
    eng.step()
    assert len(eng.scheduler.running) == 3
    eng.abort(rid)
    assert not eng.has_unfinished_requests() and eng.block_manager.all_free()


def _bf16_fastest(monkeypatch, answer: bool) -> list:
    """Make the hardware answer `answer` to "is bf16 the fastest dtype here?" (the question
    `precision: auto` asks); returns the devices it was asked about."""
    from phalanx.amp import precision

    asked = []
    monkeypatch.setattr(precision, "bf16_is_fastest", lambda device=None: asked.append(device) or answer)
    return asked


def test_dtype_auto_serves_an_fp32_checkpoint_in_bf16_where_bf16_is_fastest(llama, monkeypatch):
    """An AMX CPU (or CUDA with bf16): dtype="auto" picks bf16 for an fp32 checkpoint, and greedy
    tokens equal transformers' run in bf16 too."""
    path, model = llama
    asked = _bf16_fastest(monkeypatch, True)
    eng = engine(path, dtype="auto")
    assert eng.dtype == eng.runner.dtype == torch.bfloat16 and eng.runner.model.lm_head.dtype == torch.bfloat16
    assert asked and torch.device(asked[-1]) == eng.device  # the rule was asked about the engine's device
    prompts = im.mixed_prompts(3, seed=21, low=3, high=20)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
    hf = im.make_model("llama").to(torch.bfloat16)  # the same weights as the saved fixture
    assert [o.token_ids for o in outs] == [im.hf_greedy(hf, p, 8) for p in prompts]


def test_dtype_auto_serves_a_bf16_checkpoint_in_fp32_where_bf16_is_slow(llama, tokenizer, tmp_path, monkeypatch):
    """A CPU without fast bf16: dtype="auto" picks fp32 even for a bf16 checkpoint (tokens equal
    transformers' on that checkpoint in fp32); an explicit dtype is never overridden."""
    from phalanx.inference.model_runner import resolve_dtype

    im.make_model("llama").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    _bf16_fastest(monkeypatch, False)
    eng = LLM(str(tmp_path / "bf16"), tokenizer=tokenizer, num_blocks=96, block_size=8)  # dtype: auto
    assert eng.dtype == torch.float32 and eng.runner.model.lm_head.dtype == torch.float32
    prompts = im.mixed_prompts(3, seed=22, low=3, high=20)
    outs = eng.generate(prompts, GREEDY)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [im.hf_greedy(hf, p, 20) for p in prompts]
    assert resolve_dtype("float16", eng.hf_config, torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", eng.hf_config, torch.device("cuda")) == torch.float32  # CUDA without bf16
