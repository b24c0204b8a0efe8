"""The engine's two model paths share one decoder definition (issue 36, item 6): the compiled step
runs `DecoderModel.forward` with compiled elementwise pieces, so whatever the eager path does to a
matmul (oneDNN-packed bf16 weights, a LoRA wrapper replacing `layer.linear`) the compiled path
does too. Checked without compiling anything: the compiled step is handed spy pieces that count
their calls and compute the eager functions, so these tests run in a second on any machine (the
compiled pieces themselves: test_inference_compile.py)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import inference_models as im
from phalanx.inference import LLM, SamplingParams, compiled
from phalanx.inference.llama import EAGER, Pieces

PARAMS = SamplingParams(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return im.save_model(tmp_path_factory.mktemp("speed-paths") / "llama", "llama")


def spies(calls: Counter) -> Pieces:
    """The eager pieces, counting their calls."""
    def spy(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    return Pieces(*(spy(name, fn) for name, fn in zip(Pieces._fields, EAGER, strict=True)))


def with_spy_compiled_step(eng: LLM, calls: Counter, min_rows: int = 1) -> LLM:
    """Give `eng` a compiled step whose pieces are the spies (nothing is compiled)."""
    step = compiled.CompiledModelStep(eng.runner.model, device=eng.runner.device, min_rows=min_rows)
    step.pieces = spies(calls)
    eng.runner.compiled = step
    return eng


def add_delta_to_down(layer, delta: float):
    """A LoRA-shaped wrapper: `layer.linear` replaced by base(x) + delta on the down projection."""
    base = layer.linear

    def linear(name, x, bias=True):
        y = base(name, x, bias)
        return y + delta if name == "down" else y
    layer.linear = linear


def test_compiled_step_runs_the_one_decoder_with_its_pieces(llama):
    """Tokens equal the eager engine's and transformers'; every layer called each piece (two norms,
    RoPE, SwiGLU per layer, plus the final norm) in every step the compiled step took."""
    path, model = llama
    prompts = im.mixed_prompts(3, seed=5, low=4, high=30)
    calls: Counter = Counter()
    fast = with_spy_compiled_step(LLM(str(path), num_blocks=64, block_size=8, dtype="float32", compile=False), calls)
    steps = []
    real = fast.runner.compiled.forward
    fast.runner.compiled.forward = lambda ids, *a: steps.append(ids.shape[0]) or real(ids, *a)
    got = [o.token_ids for o in fast.generate(prompts, PARAMS)]
    want = [o.token_ids for o in LLM(str(path), num_blocks=64, block_size=8, dtype="float32",
                                     compile=False).generate(prompts, PARAMS)]
    assert got == want == im.hf_greedy_batch(model, prompts, PARAMS.max_new_tokens)
    layers = model.config.num_hidden_layers
    assert steps and calls == Counter(norm=len(steps) * (2 * layers + 1), rotate=len(steps) * layers,
                                      swiglu=len(steps) * layers), (steps, calls)


def test_small_steps_take_the_eager_pieces_on_cpu(llama):
    """min_rows: steps with fewer tokens run the eager functions (a compiled call costs as much as
    the ops it saves at decode sizes); larger ones the compiled pieces."""
    path, _ = llama
    calls: Counter = Counter()
    eng = with_spy_compiled_step(LLM(str(path), num_blocks=64, block_size=8, dtype="float32", compile=False),
                                 calls, min_rows=10)
    eng.generate([list(range(3, 23))], SamplingParams(max_new_tokens=3, temperature=0))
    layers = eng.runner.model.spec.num_layers
    assert calls["rotate"] == layers  # the 20-token prefill only; the two 1-token decodes ran eager
    assert compiled.CompiledModelStep(eng.runner.model, device=torch.device("cpu")).min_rows == compiled.CPU_MIN_ROWS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_wrapped_linear_reaches_both_paths(llama, dtype):
    """A wrapper replacing `layer.linear` after load (how LoRA adapters attach) changes the eager
    and the compiled path alike, over packed bf16 weights where this CPU packs them."""
    path, _ = llama
    prompts = im.mixed_prompts(2, seed=8, low=4, high=20)
    plain = [o.token_ids for o in LLM(str(path), num_blocks=64, block_size=8, dtype=dtype,
                                      compile=False).generate(prompts, PARAMS)]
    outs = []
    for spy_compiled in (False, True):
        eng = LLM(str(path), num_blocks=64, block_size=8, dtype=dtype, compile=False)
        for layer in eng.runner.model.layers:
            add_delta_to_down(layer, 0.5)
        if spy_compiled:
            calls: Counter = Counter()
            with_spy_compiled_step(eng, calls)
        outs.append([o.token_ids for o in eng.generate(prompts, PARAMS)])
        if spy_compiled:
            assert calls["swiglu"] > 0
    assert outs[0] == outs[1] != plain
