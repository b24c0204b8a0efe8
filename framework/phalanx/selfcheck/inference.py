"""The inference engine on the accelerator: greedy output equal to Hugging Face `generate`, and
its tokens/s against `generate` on the same prompts; torch.compile's CUDA backend on a real GPU."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from phalanx.launch import context
from phalanx.testing import tiny_llama

from .report import Skip

PROMPTS, NEW_TOKENS = 8, 16


def _model(real_gpu: bool):
    size = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512) if real_gpu else {}
    return tiny_llama(seed=0, eos_token_id=None, bos_token_id=None, **size)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 24, (PROMPTS,), generator=g)]


def greedy_equals_hf_and_speed():
    from phalanx.inference import LLM, SamplingParams

    device = context().device
    real_gpu = device.type == "cuda"
    model = _model(real_gpu).eval()
    prompts = _prompts(model.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        engine = LLM(Path(tmp), device=device, max_num_seqs=PROMPTS, dtype="float32")  # HF runs fp32
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
        engine.generate(prompts[:1], params)  # warm-up (graph capture on a GPU)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        engine_s = time.perf_counter() - start
    model = model.to(device)
    want, hf_s = [], 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            hf_s += time.perf_counter() - start
            want.append(out[0, len(p):].tolist())
    got = [o.token_ids for o in outs]
    mismatched = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatched, f"greedy output differs from HF generate for prompts {mismatched}"
    tokens = PROMPTS * NEW_TOKENS
    figures = {"engine_tokens_per_s": tokens / engine_s, "hf_tokens_per_s": tokens / hf_s,
               "ratio_vs_hf": hf_s / engine_s}
    return (f"{PROMPTS} prompts x {NEW_TOKENS} tokens equal to HF; engine {figures['engine_tokens_per_s']:.0f} tok/s, "
            f"HF generate (one prompt at a time) {figures['hf_tokens_per_s']:.0f} tok/s", figures)


def compiled_pieces_on_cuda():
    if context().device.type != "cuda":
        raise Skip("needs a real CUDA GPU (inductor's CUDA backend cannot run on the emulated GPU)")
    from phalanx.inference.compiled import probe_compiler

    status = probe_compiler("cuda")
    if status is not None:
        raise AssertionError(f"torch.compile's CUDA backend unavailable (the engine's compiled pieces): {status}")
    return "torch.compile's CUDA backend available (the engine's compiled norm / RoPE / SwiGLU pieces)"


def checks():
    return [("greedy == HF generate, tokens/s", greedy_equals_hf_and_speed), ("torch.compile on CUDA", compiled_pieces_on_cuda)]
