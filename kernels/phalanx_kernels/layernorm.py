"""LayerNorm over the last dim, with optional elementwise weight and bias."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNormFunction(torch.autograd.Function):
    """Triton forward and backward; saves x and two fp32 statistics per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        from ._triton import layernorm as k
        y, mean, rstd = k.forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        from ._triton import layernorm as k
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = k.backward(dy, x, weight, mean, rstd)
        dw = None if weight is None else dw.to(weight.dtype)
        db = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
        return dx, dw, db, None


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    return LayerNormFunction.apply(x, weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """`F.layer_norm(x, x.shape[-1:], weight, bias, eps)`, fused on GPU."""
    if use_triton(x, weight, bias):
        return layer_norm_triton(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)
