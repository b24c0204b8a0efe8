"""SwiGLU activation, `silu(a) * b`: the gated MLP of Llama, Qwen2 and Mistral.

Fusing saves writing and re-reading the `silu(a)` intermediate (forward) and keeps only a and b
for the backward, which recomputes the sigmoid.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        from ._triton import glu as k
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return k.forward(a, b)

    @staticmethod
    def backward(ctx, dy):
        from ._triton import glu as k
        a, b = ctx.saved_tensors
        return k.backward(dy, a, b)


def swiglu_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape != b.shape:
        raise ValueError(f"swiglu needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    return SwiGLUFunction.apply(a, b)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`silu(a) * b`; a is the gate projection, b the up projection."""
    if use_triton(a, b):
        return swiglu_triton(a, b)
    return swiglu_reference(a, b)
