"""Rotary embedding in place on [B, H, T, D] views, optionally writing rotated K and V to a paged cache.

One program per (batch, position) handles every head of one tensor. The same kernel runs the
backward (the transposed rotation) into a separate output, and the inference variant that also
stores K and V into their cache slots, so the freshly rotated K never makes a trip through memory
just to be copied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_guard, next_pow2


@triton.jit
def _rope(X, Y, COS, SIN, V, KC, VC, SLOTS, T, H, HALF, page_size,
          sxb, sxh, sxt, sxd, syb, syh, syt, syd, scb, sct, scd, ssb, sst, ssd,
          svb, svh, svt, svd, skb, sko, skh, skd, svcb, svco, svch, svcd,
          TRANSPOSE: tl.constexpr, WRITE_CACHE: tl.constexpr,
          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    mask = (h < H) & dmask
    c1 = tl.load(COS + b * scb + t * sct + d * scd, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + b * scb + t * sct + (d + HALF) * scd, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + b * ssb + t * sst + d * ssd, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + b * ssb + t * sst + (d + HALF) * ssd, mask=dmask, other=0.0).to(tl.float32)
    x_row = X + b * sxb + t * sxt + h * sxh
    x1 = tl.load(x_row + d * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (d + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:  # gradient of y = x*cos + rotate_half(x)*sin
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y1 = y1.to(Y.dtype.element_ty)
    y2 = y2.to(Y.dtype.element_ty)
    y_row = Y + b * syb + t * syt + h * syh
    tl.store(y_row + d * syd, y1, mask=mask)
    tl.store(y_row + (d + HALF) * syd, y2, mask=mask)
    if WRITE_CACHE:
        slot = tl.load(SLOTS + t).to(tl.int64)
        # a negative slot marks a padding token: nothing is cached. (Broadcast the scalar test
        # to a tensor first: the interpreter mis-types `bool tensor & bool scalar`.)
        cmask = mask & ((h * 0 + slot) >= 0)
        slot = tl.maximum(slot, 0)
        blk = slot // page_size
        off = slot % page_size
        k_row = KC + blk * skb + off * sko + h * skh
        tl.store(k_row + d * skd, y1.to(KC.dtype.element_ty), mask=cmask)
        tl.store(k_row + (d + HALF) * skd, y2.to(KC.dtype.element_ty), mask=cmask)
        v_row = V + b * svb + t * svt + h * svh
        vc_row = VC + blk * svcb + off * svco + h * svch
        v1 = tl.load(v_row + d * svd, mask=cmask, other=0.0)
        v2 = tl.load(v_row + (d + HALF) * svd, mask=cmask, other=0.0)
        tl.store(vc_row + d * svcd, v1.to(VC.dtype.element_ty), mask=cmask)
        tl.store(vc_row + (d + HALF) * svcd, v2.to(VC.dtype.element_ty), mask=cmask)


def _bcast3(c: torch.Tensor) -> torch.Tensor:
    """cos/sin as [B or 1, T, D]."""
    return c if c.dim() == 3 else c.unsqueeze(0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
           transpose: bool = False, cache: tuple | None = None) -> torch.Tensor:
    """Rotate x [B, H, T, D] into `out` (x itself when None, i.e. in place).

    cache = (v [B, H, T, D], k_cache, v_cache [blocks, page, H, D], slots [T]) also stores the
    rotated x and v at those slots (B must be 1: tokens of a batch are laid out along T).
    """
    out = x if out is None else out
    B, H, T, D = x.shape
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {D}")
    cos, sin = _bcast3(cos), _bcast3(sin)
    scb = cos.stride(0) if cos.shape[0] > 1 else 0
    ssb = sin.stride(0) if sin.shape[0] > 1 else 0
    if cache is not None:
        v, k_cache, v_cache, slots = cache
        write = True
    else:
        v, k_cache, v_cache, slots = x, x, x, x
        write = False
    vs = v.stride() if write else (0, 0, 0, 0)
    ks = k_cache.stride() if write else (0, 0, 0, 0)
    vcs = v_cache.stride() if write else (0, 0, 0, 0)
    page = k_cache.shape[1] if write else 1
    if B * T:
        with device_guard(x):
            _rope[(B * T,)](x, out, cos, sin, v, k_cache, v_cache, slots, T, H, D // 2, page,
                            *x.stride(), *out.stride(), scb, cos.stride(1), cos.stride(2),
                            ssb, sin.stride(1), sin.stride(2), *vs, *ks, *vcs,
                            TRANSPOSE=transpose, WRITE_CACHE=write, BLOCK_H=next_pow2(H),
                            BLOCK_D=next_pow2(D // 2), num_warps=1 if H * D <= 1024 else 4)
    return out
