"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm transformer.

`rms_norm(x, weight, eps)` returns `weight * normalize(x)`; with `residual=` it returns
`(rms_norm(x + residual), x + residual)`, reading both inputs once and writing both outputs once.
The reference follows Hugging Face's LlamaRMSNorm operation for operation (normalise in fp32,
round to the input dtype, then scale), so a patched model matches an unpatched one exactly on CPU.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return y if residual is None else (y, x)


class RMSNormFunction(torch.autograd.Function):
    """Triton forward and backward; saves the normalised input and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        from ._triton import rmsnorm as k
        y, h, rstd = k.forward(x, weight, residual, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_residual = residual is not None
        return (y, h) if ctx.has_residual else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        from ._triton import rmsnorm as k
        h, weight, rstd = ctx.saved_tensors
        dx, dw = k.backward(dy, dh, h, weight, rstd)
        return dx, dw, (dx if ctx.has_residual else None), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                    residual: torch.Tensor | None = None):
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    return RMSNormFunction.apply(x, weight, residual, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim; see the module docstring for the residual form."""
    if use_triton(x, weight, residual):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
