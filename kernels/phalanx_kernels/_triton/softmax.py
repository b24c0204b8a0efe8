"""Row softmax of x + bias with a keep-mask, broadcasting mask and bias by strides.

Evoformer attention adds a pair bias shared across one batch dim and a mask shared across heads
and queries. Broadcasting by stride 0 means neither is ever expanded in memory: each program
decomposes its row index into up to four leading indices and reads all three inputs directly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_guard, next_pow2, num_warps_for

MAX_DIMS = 5


@triton.jit
def _fwd(X, M, BIAS, Y, d1, d2, d3, K, sx0, sx1, sx2, sx3, sxk, sm0, sm1, sm2, sm3, smk,
         sb0, sb1, sb2, sb3, sbk, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i3 = row % d3
    r = row // d3
    i2 = r % d2
    r = r // d2
    i1 = r % d1
    i0 = r // d1
    cols = tl.arange(0, BLOCK)
    keep = cols < K
    x = tl.load(X + i0 * sx0 + i1 * sx1 + i2 * sx2 + i3 * sx3 + cols * sxk, mask=keep, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3 + cols * sbk, mask=keep, other=0.0).to(tl.float32)
    if HAS_MASK:
        m = tl.load(M + i0 * sm0 + i1 * sm1 + i2 * sm2 + i3 * sm3 + cols * smk, mask=keep, other=0)
        keep = keep & (m != 0)
    x = tl.where(keep, x, float("-inf"))
    top = tl.max(x, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # fully masked row: all zeros, not NaN
    e = tl.exp(x - top)
    total = tl.sum(e, axis=0)
    y = e / tl.where(total == 0.0, 1.0, total)
    tl.store(Y + row * K + cols, y.to(Y.dtype.element_ty), mask=cols < K)


@triton.jit
def _bwd(DY, Y, DX, K, s_dy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    y = tl.load(Y + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * s_dy + cols, mask=ok, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(DX + row * K + cols, dx.to(DX.dtype.element_ty), mask=ok)


def _strides5(t: torch.Tensor | None, shape: torch.Size):
    """Strides of t broadcast to the 5-d `shape` (0 where broadcast); zeros when t is None."""
    if t is None:
        return (0,) * MAX_DIMS
    t = t.reshape((1,) * (len(shape) - t.dim()) + tuple(t.shape)) if t.dim() < len(shape) else t
    return tuple(t.expand(shape).stride())


def forward(x: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() > MAX_DIMS:
        raise ValueError(f"the Triton masked softmax handles up to {MAX_DIMS} dims, got {x.dim()}; "
                         "merge leading dims first")
    shape5 = torch.Size((1,) * (MAX_DIMS - x.dim()) + tuple(x.shape))
    x5 = x.reshape(shape5) if x.dim() < MAX_DIMS else x
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes; avoids loading i1 pointers
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // max(x.shape[-1], 1) if x.shape[-1] else 0
    if rows:
        K = x.shape[-1]
        block = next_pow2(K)
        with device_guard(x):
            _fwd[(rows,)](x5, mask if mask is not None else x5, bias if bias is not None else x5, y,
                          shape5[1], shape5[2], shape5[3], K, *x5.stride(), *_strides5(mask, shape5),
                          *_strides5(bias, shape5), HAS_MASK=mask is not None, HAS_BIAS=bias is not None,
                          BLOCK=block, num_warps=num_warps_for(block))
    return y


def backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    K = y.shape[-1]
    dy2 = dy.reshape(-1, K)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    rows = dy2.shape[0]
    if rows and K:
        block = next_pow2(K)
        with device_guard(y):
            _bwd[(rows,)](dy2, y, dx, K, dy2.stride(0), BLOCK=block, num_warps=num_warps_for(block))
    return dx
