"""Comparison helpers for kernel tests (imported by the test modules of tests/kernels)."""
from __future__ import annotations

import importlib.util

import torch

from phalanx.testing import Diff, check, eps

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Max error relative to max(max |expected|, 1), by the dtype the kernel computes in; tests scale it
# for gradients (2-4x: one more reduction). Measured over tests/kernels, AVX-512 | AVX2 kernels
# for the torch references (the Triton interpreter runs numpy):
TOL = {
    # fp32 kernels agree with their references to a few roundings: 128·eps = 1.5e-5 (worst
    # 6.7e-7 | 6.9e-7, i.e. ≤ 6 eps)
    torch.float32: 128 * eps(torch.float32),
    # bf16 kernels round inputs/outputs to 8 mantissa bits, and the Triton interpreter rounds
    # fp32->bf16 by truncation (a GPU rounds to nearest): 4·eps = 3.1e-2 (worst 1.2e-2 | 1.2e-2,
    # i.e. 1.5 eps)
    torch.bfloat16: 4 * eps(torch.bfloat16),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """max |actual - expected| <= tol * max(max |expected|, 1): relative for large values, absolute
    for values below 1 (such as gradients that are zero in exact arithmetic, where a relative
    measure would divide rounding noise by zero)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1.0)
    err = (a - e).abs().max().item() if e.numel() else 0.0
    check(Diff(err / scale, f"{tuple(actual.shape)} {actual.dtype}", "max error / max(max |expected|, 1)"), tol,
          what or "kernel output")


def grads(*tensors):
    """Snapshot and clear the .grad of each tensor (None stays None)."""
    out = []
    for t in tensors:
        out.append(None if t is None or t.grad is None else t.grad.detach().clone())
        if t is not None:
            t.grad = None
    return out
