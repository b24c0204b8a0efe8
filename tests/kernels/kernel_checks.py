"""Comparison helpers for kernel tests (imported by the test modules of tests/kernels)."""
from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Max error relative to the largest magnitude of the expected tensor. fp32 kernels agree with
# their references to a few ulps; bf16 kernels round inputs/outputs to 8 mantissa bits, and
# the Triton interpreter rounds fp32->bf16 by truncation (a GPU rounds to nearest).
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """max |actual - expected| <= tol * max(max |expected|, 1): relative for large values, absolute
    for values below 1 (such as gradients that are zero in exact arithmetic)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1.0)
    err = (a - e).abs().max().item() if e.numel() else 0.0
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def grads(*tensors):
    """Snapshot and clear the .grad of each tensor (None stays None)."""
    out = []
    for t in tensors:
        out.append(None if t is None or t.grad is None else t.grad.detach().clone())
        if t is not None:
            t.grad = None
    return out
