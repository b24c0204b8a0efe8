"""The compiled model step (phalanx.inference.compiled) on tiny Llama / Qwen2 models: the same
greedy tokens as the eager path and as `transformers`, log-probs within fp32 rounding of eager, a
bounded number of compiled graphs however the batch size varies, packed bf16 weights with the
compiled pieces, and the eager fallback when the compiler probe fails. The compiled engines here
run their pieces at every step size (`min_rows = 1`; on CPU the default leaves steps under
`compiled.CPU_MIN_ROWS` tokens eager). Compilation needs g++ (inductor's C++ backend); without it the tests that
compile are skipped, the fallback tests still run."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams, compiled
from phalanx.inference.config import EngineConfig

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, logprobs=1)


@pytest.fixture
def needs_compiler():
    reason = compiled.probe_compiler("cpu")
    if reason is not None:
        pytest.skip(f"torch.compile unavailable: {reason}")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return im.make_tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("compile-models")
    return {family: im.save_model(root / family, family, tokenizer=tokenizer) for family in ("llama", "qwen2")}


def engine(path, **kw):
    kw.setdefault("dtype", "float32")  # the HF references are fp32 (dtype="auto" is bf16 on AMX)
    kw.setdefault("num_blocks", 96)
    kw.setdefault("block_size", 8)
    eng = LLM(str(path), **kw)
    if eng.runner.compiled is not None:
        eng.runner.compiled.min_rows = 1  # compiled pieces at every step size, decodes included
    return eng


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # compiles 8 graphs per engine: ~1 min with a cold inductor cache
@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_greedy_tokens_equal_eager_and_transformers(models, family):
    """A mixed-length batch (prefills of 5-39 tokens, then decodes of a shrinking batch, and a
    single stream): compiled tokens == eager tokens == HF's; log-probs of the chosen tokens agree
    to fp32 rounding (values of magnitude ~1-10 through two layers: differences ~1e-6; 1e-4 is a
    hundred times that and still far below the ~1e-1 a wrong op would cause)."""
    path, model = models[family]
    prompts = im.mixed_prompts(6, seed=3, low=5, high=40)
    eager = engine(path, compile=False)
    fast = engine(path, compile=True)
    assert eager.runner.compiled is None and fast.runner.compiled is not None
    want = im.hf_greedy_batch(model, prompts, GREEDY.max_new_tokens)
    for batch in (prompts, prompts[:1]):
        ref = eager.generate(batch, GREEDY)
        got = fast.generate(batch, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref] == want[:len(batch)]
        diff = max(abs(a - b) for r, g in zip(ref, got, strict=True)
                   for a, b in zip(r.logprobs, g.logprobs, strict=True))
        assert diff < 1e-4
    assert fast.runner.compiled.seen == {1, 2}  # single-row steps and multi-row steps
    assert fast.block_manager.all_free()


def _run_staggered(eng, prompts, budgets) -> list[list[int]]:
    """Add a request every other step (different prompt lengths and budgets), so the step's token
    count takes many values; returns each request's tokens."""
    owner, got, pending, step = {}, {}, list(enumerate(zip(prompts, budgets, strict=True))), 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, (p, b) = pending.pop(0)
            owner[eng.add_request(p, SamplingParams(max_new_tokens=b, temperature=0))] = i
        for out in eng.step():
            if out.finished:
                got[owner[out.request_id]] = out.token_ids
        step += 1
    return [got[i] for i in range(len(prompts))]


def _count_step_sizes(runner) -> set[int]:
    sizes: set[int] = set()
    real_forward = runner.compiled.forward

    def forward(ids, *args):
        sizes.add(ids.shape[0])
        return real_forward(ids, *args)

    runner.compiled.forward = forward
    return sizes


@pytest.mark.slow  # compiles 8 graphs per engine: ~1 min with a cold inductor cache
@pytest.mark.usefixtures("needs_compiler")
def test_graph_count_stays_bounded_over_many_batch_sizes(models):
    """Requests arrive every other step with different prompt lengths and budgets, so the step's
    token count takes many values (prefills with decodes, 1 to 8 decodes). Dynamic rows: 4 piece
    variants (the first layer's norm, add + norm, RoPE, SwiGLU) x 2 shape classes (1 row, 2+ rows)
    = 8 graphs at most, whatever the number of distinct sizes."""
    path, _ = models["llama"]
    prompts = im.mixed_prompts(10, seed=7, low=3, high=30)
    budgets = [3 + 2 * i for i in range(len(prompts))]
    eager = engine(path, compile=False, max_num_seqs=8)
    fast = engine(path, compile=True, max_num_seqs=8)
    sizes = _count_step_sizes(fast.runner)
    before = graphs_compiled()
    assert _run_staggered(fast, prompts, budgets) == _run_staggered(eager, prompts, budgets)
    assert len(sizes) >= 10, sizes  # the run really saw many step sizes
    assert 0 < graphs_compiled() - before <= 8, sorted(sizes)
    assert fast.runner.compiled.seen == {1, 2}


@pytest.mark.slow  # compiles 4 graphs: ~1 min with a cold inductor cache
@pytest.mark.usefixtures("needs_compiler")
def test_packed_bf16_weights_run_with_the_compiled_pieces(models):
    """bf16 on a CPU with native bf16: the matmuls go through the oneDNN-packed weights and the
    norm/RoPE/SwiGLU through the compiled pieces in the same step (the runner used to drop
    compilation when weights were packed); greedy tokens equal the eager bf16 engine's, and
    transformers' run in bf16 (the bf16 criterion of test_inference_engine's dtype tests)."""
    from phalanx_kernels.capability import native_bf16
    if not native_bf16("cpu"):
        pytest.skip("this CPU has no native bf16: nothing is packed")
    path, model = models["llama"]
    prompts = im.mixed_prompts(3, seed=21, low=3, high=20)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    fast = engine(path, compile=True, dtype="bfloat16")
    layers = fast.runner.model.layers
    assert fast.runner.compiled is not None and all(set(l.packed) == {"qkv", "o", "gate_up", "down"} for l in layers)
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert fast.runner.compiled is not None and 2 in fast.runner.compiled.seen  # it ran compiled
    assert got == [o.token_ids for o in engine(path, compile=False, dtype="bfloat16").generate(prompts, params)]
    import copy
    hf = copy.deepcopy(model).to(torch.bfloat16)
    assert got == [im.hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.slow  # compiles 8 graphs per engine: ~1 min with a cold inductor cache
@pytest.mark.usefixtures("needs_compiler")
def test_weight_reload_reaches_the_compiled_step(models, tokenizer):
    """The pieces take the weights as arguments (nothing is frozen into the graphs): after
    load_weights the compiled engine follows the new weights, like the eager one."""
    path, _ = models["llama"]
    other = im.make_model("llama", seed=1)
    prompts = im.mixed_prompts(3, seed=9, low=5, high=20)
    fast = engine(path, compile=True)
    before = [o.token_ids for o in fast.generate(prompts, GREEDY)]
    fast.load_weights(other.state_dict())
    after = [o.token_ids for o in fast.generate(prompts, GREEDY)]
    assert after == im.hf_greedy_batch(other, prompts, GREEDY.max_new_tokens)
    assert after != before


def test_failed_probe_falls_back_to_eager_with_one_line(models, monkeypatch):
    path, model = models["llama"]
    reason = "no C++ compiler found ('g++' is not on PATH; install g++ or set CXX)"
    monkeypatch.setattr(compiled, "probe_compiler", lambda device="cpu": reason)
    monkeypatch.setattr("phalanx.inference.model_runner._logged", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("phalanx.inference")
    logger.addHandler(handler)
    try:
        eng = engine(path, compile=True)
        engine(path, compile=True)  # a second engine in the same process says nothing more
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if "eagerly" in r.getMessage()]
    assert lines == [f"running the model eagerly ({reason})"]
    assert eng.runner.compiled is None and eng.runner.compile_reason == reason
    prompts = im.mixed_prompts(3, seed=3, low=5, high=20)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == im.hf_greedy_batch(model, prompts, 16)


def test_probe_names_a_missing_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-phalanx")
    monkeypatch.setattr(compiled, "_probe_reason", {})
    reason = compiled.probe_compiler("cpu")
    assert reason is not None and "no C++ compiler found" in reason and "no-such-compiler-phalanx" in reason
    assert compiled.probe_compiler("cpu") is reason  # answered once per process


def test_auto_stays_eager_on_cpu_and_bad_settings_are_refused(models):
    path, _ = models["llama"]
    eng = engine(path)  # compile="auto" by default
    assert eng.runner.compiled is None and "runs eagerly on CPU" in eng.runner.compile_reason
    with pytest.raises(ValueError, match="EngineConfig.compile='yes'"):
        EngineConfig(compile="yes")


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.slow
def test_second_process_reuses_the_inductor_cache(models, tmp_path):
    """Two fresh processes compile the same engine into one TORCHINDUCTOR_CACHE_DIR: the first
    misses inductor's FX graph cache and fills it, the second hits it for every graph (and
    compiles faster)."""
    path, _ = models["llama"]
    script = textwrap.dedent(f"""
        import json, torch
        torch.set_num_threads(1)
        from torch._dynamo.utils import counters
        from phalanx.inference import LLM, SamplingParams
        eng = LLM({str(path)!r}, num_blocks=32, block_size=8, compile=True, dtype="float32")
        eng.runner.compiled.min_rows = 1
        eng.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_new_tokens=3, temperature=0))
        print(json.dumps({{"hit": counters["inductor"]["fxgraph_cache_hit"],
                          "miss": counters["inductor"]["fxgraph_cache_miss"],
                          "seconds": eng.runner.compiled.compile_seconds}}))
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["miss"] > 0 and second["miss"] == 0 and second["hit"] >= first["miss"], runs
    assert any(Path(tmp_path / "inductor").rglob("*")), "nothing was written to the cache directory"
    assert second["seconds"] < first["seconds"], runs
