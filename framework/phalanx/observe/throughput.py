"""Throughput and model-FLOP utilisation (MFU).

Model FLOPs per token of a decoder-only transformer follow the PaLM / torchtitan convention:

    6 * N  +  12 * layers * heads * head_dim * seq_len

`6 N` is forward (2 N) plus backward (4 N) through every weight matrix, with N every parameter
except the input embedding table, which is a lookup (a tied output head is a matmul and counts
once). Norm weights and biases are in N too, as the convention has it, although they cost
elementwise work, not matmuls: 0.65% too many for the tests' tiny Llama, far less for real
models (tests/framework/test_train_parts.py checks the formula against torch's FlopCounterMode).
The second term is the attention score and value matmuls (QK^T and PV: 2 matmuls, forward +
backward = 3x, 2 FLOPs per multiply-add), which grow with the sequence length and are counted
without the causal-mask discount, as is usual.
Recomputation (activation checkpointing) is not counted: MFU measures useful work.

MFU = achieved model FLOP/s per rank / peak FLOP/s of one device. The peak is either given, or
measured with a large matmul in the training dtype (`measure_matmul_flops`) -- on a CPU there is
no datasheet figure that holds for every machine, so a measured GEMM peak is the honest one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from phalanx_kernels.accelerator import device_module, is_accelerator
from torch import nn


def _config_value(config, *names: str):
    for name in names:
        value = getattr(config, name, None)
        if value:
            return value
    return None


def causal_lm_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a Hugging Face causal LM.

    Call it on the unwrapped model before sharding, so parameter counts are whole."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no `config`: pass flops_per_token explicitly")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors count once
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and not (head is not None and head.weight is embed.weight):
        params -= embed.weight.numel()
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_value(config, "num_attention_heads", "n_head")
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    if not (layers and heads and hidden):
        raise ValueError(f"cannot read layers/heads/hidden size from {type(config).__name__}: "
                         "pass flops_per_token explicitly")
    head_dim = _config_value(config, "head_dim") or hidden // heads
    return float(6 * params + 12 * layers * heads * head_dim * seq_len)


def _sync(device: torch.device) -> None:
    if is_accelerator(device):
        device_module(device).synchronize(device)


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         size: int | None = None, min_seconds: float = 0.25) -> float:
    """FLOP/s of a square matmul on `device` in `dtype` (the practical GEMM peak).

    Uses constant inputs (no RNG is consumed, so a training run's random streams are untouched).
    Each matmul is timed on its own and the fastest one counts: a peak measured as an average is
    dragged down by whatever else shares the machine for a moment (on a busy 2-core machine an
    averaged 0.1 s probe read 65 instead of 81 GFLOP/s and a run reported an MFU of 106 %)."""
    device = torch.device(device)
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.full((n, n), 1.0 / n ** 0.5, dtype=dtype, device=device)
    b = torch.full((n, n), 1.0 / n ** 0.5, dtype=dtype, device=device)
    a @ b  # warm-up: thread pools, kernel selection
    _sync(device)
    fastest, reps, start = float("inf"), 0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        now = time.perf_counter()
        fastest, reps = min(fastest, now - t0), reps + 1
        if now - start >= min_seconds and reps >= 2:
            return 2.0 * n ** 3 / fastest


@dataclass
class _Window:
    tokens: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, flops: float, seconds: float) -> None:
        self.tokens += tokens
        self.flops += flops
        self.seconds += seconds
        self.steps += 1


@dataclass
class ThroughputMeter:
    """Accumulates (tokens, model FLOPs, seconds) per optimizer step.

    `window()` reports the rates since its previous call (for the progress bar and the metrics
    file), `summary()` those of the whole run minus the first `warmup_steps` steps, which pay for
    lazy initialisation and allocator growth. Tokens are global (all data-parallel ranks);
    FLOP/s and MFU are per rank, comparable with one device's peak."""

    world_size: int = 1
    peak_flops: float | None = None  # of one device/rank, FLOP/s
    warmup_steps: int = 1
    _window: _Window = field(default_factory=_Window)
    _total: _Window = field(default_factory=_Window)
    _seen: int = 0

    def step(self, tokens: int, seconds: float, flops: float | None = None) -> None:
        self._seen += 1
        self._window.add(tokens, flops or 0.0, seconds)
        if self._seen > self.warmup_steps:
            self._total.add(tokens, flops or 0.0, seconds)

    def _rates(self, w: _Window) -> dict[str, float | None]:
        if w.seconds <= 0 or w.steps == 0:
            return {"tokens_per_s": None, "tflops_per_rank": None, "mfu": None, "step_time_s": None}
        flops_per_rank = w.flops / w.seconds / self.world_size if w.flops else None
        mfu = flops_per_rank / self.peak_flops if flops_per_rank and self.peak_flops else None
        return {
            "tokens_per_s": w.tokens / w.seconds,
            "tflops_per_rank": flops_per_rank / 1e12 if flops_per_rank else None,
            "mfu": mfu,
            "step_time_s": w.seconds / w.steps,
        }

    def window(self) -> dict[str, float | None]:
        rates = self._rates(self._window)
        self._window = _Window()
        return rates

    def summary(self) -> dict[str, float | None]:
        total = self._total if self._total.steps else self._window
        return self._rates(total)
