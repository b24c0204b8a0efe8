"""Each Triton kernel against its torch reference on the accelerator, forward and backward, in
fp32 and bf16. On a GPU the kernels are compiled; on the emulated GPU they run in Triton's
interpreter (the same dispatch, the same kernel source)."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

import phalanx_kernels as pk
from phalanx_kernels.accelerator import current_device
from phalanx.testing import eps

from .report import Skip

# Max error relative to max(max |reference|, 1); gradients get 4x (one more reduction).
TOL = {torch.float32: 128 * eps(torch.float32), torch.bfloat16: 4 * eps(torch.bfloat16)}


def _cases(device, dtype):
    g = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype).requires_grad_()

    B, H, T, D = 2, 2, 16, 16
    cos = torch.cos(torch.arange(T)[:, None] * torch.arange(D // 2)[None] / 10).repeat(1, 2).to(device, dtype)
    sin = torch.sin(torch.arange(T)[:, None] * torch.arange(D // 2)[None] / 10).repeat(1, 2).to(device, dtype)
    labels = torch.randint(0, 64, (24,), generator=g).to(device)
    return {
        "rms_norm": (lambda x, w: pk.rms_norm(x, w, 1e-6), (make(8, 64), make(64))),
        "layer_norm": (lambda x, w, b: pk.layer_norm(x, w, b), (make(8, 64), make(64), make(64))),
        "swiglu": (pk.swiglu, (make(8, 64), make(8, 64))),
        "masked_softmax": (lambda x: pk.masked_softmax(x), (make(4, 8, 32),)),
        "apply_rope": (lambda q, k: torch.cat([t.flatten() for t in pk.apply_rope(q, k, cos, sin)]),
                       (make(B, H, T, D), make(B, 1, T, D))),
        "flash_attention": (lambda q, k, v: pk.flash_attention(q, k, v, causal=True),
                            (make(B, H, T, D), make(B, H, T, D), make(B, H, T, D))),
        "fused_linear_cross_entropy": (lambda h, w: pk.fused_linear_cross_entropy(h, w, labels).reshape(1),
                                       (make(24, 32), make(64, 32, scale=0.3))),
    }


def _run(fn, inputs, backend):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with pk.use_backend(backend):
        out = fn(*[t.clone() for t in leaves])  # non-leaf copies: some kernels work in place
        out.float().mul(torch.linspace(0.5, 1.5, out.numel(), device=out.device).reshape(out.shape)).sum().backward()
    return out.detach().float().cpu(), [t.grad.float().cpu() for t in leaves]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / max(want.abs().max().item(), 1.0)).item()


def checks() -> list[tuple[str, callable]]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for name in _cases("cpu", torch.float32):
            out.append((f"{name} {str(dtype).removeprefix('torch.')}", lambda n=name, d=dtype: _check(n, d)))
    return out


def _check(name: str, dtype: torch.dtype):
    if importlib.util.find_spec("triton") is None:
        raise Skip("triton is not installed (pip install triton)")
    with _kernels_dispatched():
        return _compare(name, dtype)


@contextlib.contextmanager
def _kernels_dispatched():
    """On the emulated GPU, Triton kernels dispatch (through the interpreter) only with
    PHALANX_EMULATE_TRITON=1: set for these checks, whose subject they are."""
    previous = os.environ.get("PHALANX_EMULATE_TRITON")
    os.environ["PHALANX_EMULATE_TRITON"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PHALANX_EMULATE_TRITON"]
        else:
            os.environ["PHALANX_EMULATE_TRITON"] = previous


def _compare(name: str, dtype: torch.dtype):
    device = current_device()
    fn, inputs = _cases(device, dtype)[name]
    if not pk.dispatch.use_triton(*inputs):
        raise Skip(f"Triton is not dispatched for tensors on {device}")
    got, got_grads = _run(fn, inputs, "triton")
    want, want_grads = _run(fn, inputs, "torch")
    fwd = _error(got, want)
    bwd = max(_error(g, w) for g, w in zip(got_grads, want_grads, strict=True))
    assert fwd <= TOL[dtype], f"forward error {fwd:.2e} > {TOL[dtype]:.2e}"
    assert bwd <= 4 * TOL[dtype], f"backward error {bwd:.2e} > {4 * TOL[dtype]:.2e}"
    return f"max error fwd {fwd:.1e}, bwd {bwd:.1e}", {"forward_error": fwd, "backward_error": bwd}
