"""SwiGLU, silu(a) * b, as one elementwise pass each way over flat contiguous tensors."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_guard

BLOCK = 1024


@triton.jit
def _fwd(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(DY, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    tl.store(DB + offs, (dy * silu).to(DB.dtype.element_ty), mask=mask)
    tl.store(DA + offs, (dy * b * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty_like(a, dtype=torch.promote_types(a.dtype, b.dtype))
    if a.numel():
        with device_guard(a):
            _fwd[_grid(a.numel())](a, b, y, a.numel(), BLOCK=BLOCK, num_warps=4)
    return y


def backward(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    dy = dy.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        with device_guard(a):
            _bwd[_grid(a.numel())](dy, a, b, da, db, a.numel(), BLOCK=BLOCK, num_warps=4)
    return da, db
