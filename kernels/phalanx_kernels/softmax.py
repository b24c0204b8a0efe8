"""Softmax with a keep-mask and an additive bias: the Evoformer attention pattern.

`masked_softmax(x, mask, bias)` = softmax over the last dim of `x + bias`, where positions with
`mask == 0` get zero probability. mask (bool or 0/1 floats) and bias broadcast against x the way
torch broadcasting does, e.g. logits [B, S, H, Q, K], pair bias [B, 1, H, Q, K] and a sequence
mask [B, S, 1, 1, K]; they are never expanded in memory on the Triton path. A row with every
position masked returns zeros (torch's softmax would return NaN). Differentiable w.r.t. x and
bias; the output has x's dtype, computed in fp32.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def masked_softmax_reference(x: torch.Tensor, mask: torch.Tensor | None = None,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    z = x.float()
    if bias is not None:
        z = z + bias.float()
    if mask is not None:
        z = z.masked_fill(mask == 0, float("-inf"))
    y = torch.softmax(z, dim=-1)
    if mask is not None:
        y = y.nan_to_num(0.0)  # fully masked rows
    return y.to(x.dtype)


class MaskedSoftmaxFunction(torch.autograd.Function):
    """Saves only the output: masked positions have y == 0, so the mask needs no saving."""

    @staticmethod
    def forward(ctx, x, mask, bias):
        from ._triton import softmax as kern
        y = kern.forward(x, mask, bias)
        ctx.save_for_backward(y)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        from ._triton import softmax as kern
        (y,) = ctx.saved_tensors
        dx = kern.backward(dy, y)
        dbias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
            dbias = dx.float().sum_to_size(ctx.bias_shape).to(ctx.bias_dtype)
        return (dx if ctx.needs_input_grad[0] else None), None, dbias


def masked_softmax_triton(x: torch.Tensor, mask: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    for name, t in (("mask", mask), ("bias", bias)):
        if t is not None:
            torch.broadcast_shapes(t.shape, x.shape)  # raises on a mismatch
            if torch.broadcast_shapes(t.shape, x.shape) != x.shape:
                raise ValueError(f"{name} {tuple(t.shape)} must broadcast to x {tuple(x.shape)}, not enlarge it")
    return MaskedSoftmaxFunction.apply(x, mask, bias)


def masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(x + bias) over the last dim with mask == 0 positions excluded (see module doc)."""
    if use_triton(x, mask, bias):
        return masked_softmax_triton(x, mask, bias)
    return masked_softmax_reference(x, mask, bias)
