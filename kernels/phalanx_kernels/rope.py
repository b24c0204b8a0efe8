"""Rotary position embedding (RoPE), applied in place to q and k.

Layout follows Hugging Face: q [B, Hq, T, D] and k [B, Hk, T, D] (any strides, e.g. the
transposed views HF attention makes), cos/sin [B, T, D] or [T, D], and
`x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x[D/2:], x[:D/2])`.
In place because the unrotated q and k are never needed again: this saves two activations.

`rope_and_cache_write` is the inference form: token-major q [N, Hq, D], k and v [N, Hk, D],
cos/sin [N, D]; it rotates q and k in place and stores the rotated k and v into a paged cache
`[num_blocks, block_size, Hk, D]` at `slot_mapping[n] = block * block_size + offset`
(a negative slot skips the token, e.g. padding).
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def _as_bhtd_cos(c: torch.Tensor) -> torch.Tensor:
    """[T, D] or [B, T, D] -> [B or 1, 1, T, D], broadcastable against [B, H, T, D]."""
    return (c if c.dim() == 3 else c.unsqueeze(0)).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    c, s = _as_bhtd_cos(cos), _as_bhtd_cos(sin)
    q_rot = (q * c) + (rotate_half(q) * s)  # the same operations, in the same order, as HF
    k_rot = (k * c) + (rotate_half(k) * s)
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k


class RoPEFunction(torch.autograd.Function):
    """In-place Triton rotation of one tensor; the backward is the transposed rotation.

    One tensor per call: autograd cannot rebase several in-place-modified views returned by one
    Function, and HF's q and k are views of the projection outputs.
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        from ._triton import rope as kern
        kern.rotate(x, cos, sin)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        return x

    @staticmethod
    def backward(ctx, dy):
        from ._triton import rope as kern
        cos, sin = ctx.saved_tensors
        return kern.rotate(dy, cos, sin, out=torch.empty_like(dy), transpose=True), None, None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope expects q and k as [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape[-1] != q.shape[-1] or cos.shape[-2] != q.shape[-2]:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match q's (T, D) = {tuple(q.shape[-2:])}")


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    _check(q, k, cos)
    return RoPEFunction.apply(q, cos, sin), RoPEFunction.apply(k, cos, sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k in place; returns them (for `q, k = apply_rope(q, k, cos, sin)`)."""
    if use_triton(q, k, cos, sin):
        return apply_rope_triton(q, k, cos, sin)
    _check(q, k, cos)
    return apply_rope_reference(q, k, cos, sin)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> a [1, H, N, D] view of the same memory."""
    return x.transpose(0, 1).unsqueeze(0)


def rope_and_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    apply_rope_reference(_token_major(q), _token_major(k), cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page = k_cache.shape[1]
    k_cache[slots // page, slots % page] = k[keep].to(k_cache.dtype)
    v_cache[slots // page, slots % page] = v[keep].to(v_cache.dtype)
    return q, k


def rope_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    from ._triton import rope as kern
    kern.rotate(_token_major(q), cos, sin)
    kern.rotate(_token_major(k), cos, sin,
                cache=(_token_major(v), k_cache, v_cache, slot_mapping))
    return q, k


def rope_and_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor):
    """Inference step: rotate q and k in place and cache the rotated k and v (see module doc)."""
    if q.dim() != 3 or k.shape != v.shape or k_cache.shape != v_cache.shape:
        raise ValueError("rope_and_cache_write expects q [N, Hq, D], k and v [N, Hk, D] and equal "
                         f"caches; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache [blocks, page, heads, dim] {tuple(k_cache.shape)} does not hold k {tuple(k.shape)}")
    with torch.no_grad():
        if use_triton(q, k, v, k_cache, v_cache):
            return rope_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return rope_and_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
