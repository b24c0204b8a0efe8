"""LayerNorm: one program per row forward; row blocks with partial weight/bias sums backward."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, device_guard, next_pow2, num_warps_for, parallel_programs


@triton.jit
def _fwd(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_cols, eps,
         HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(DY, X, W, MEAN, RSTD, DX, DW, DB, stride_dy, stride_x, stride_dx, n_rows, n_cols,
         rows_per_program, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK], 1.0, tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dxhat = dy * w
        c1 = tl.sum(dxhat * xhat, axis=0) / n_cols
        c2 = tl.sum(dxhat, axis=0) / n_cols
        dx = rstd * (dxhat - xhat * c1 - c2)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)
    tl.store(DB + pid * n_cols + cols, db, mask=mask)


def forward(x, weight, bias, eps):
    """Returns (y, mean, rstd); mean and rstd are fp32, one per row."""
    shape = x.shape
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if n_rows:
        block = next_pow2(n_cols)
        with device_guard(x):
            _fwd[(n_rows,)](x2, weight if weight is not None else x2, bias if bias is not None else x2,
                            y, mean, rstd, x2.stride(0), y.stride(0), n_cols, eps,
                            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK=block,
                            num_warps=num_warps_for(block))
    return y.view(shape), mean, rstd


def backward(dy, x, weight, mean, rstd):
    """Returns (dx, dweight, dbias) in the dtypes of x, weight and bias (fp32 sums)."""
    shape = x.shape
    dy2, x2 = as_rows(dy), as_rows(x)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    programs = max(1, min(n_rows, parallel_programs(x)))
    rows_per_program = triton.cdiv(n_rows, programs) if n_rows else 1
    dw = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    db = torch.zeros_like(dw)
    if n_rows:
        block = next_pow2(n_cols)
        with device_guard(x):
            _bwd[(programs,)](dy2, x2, weight if weight is not None else x2, mean, rstd, dx, dw, db,
                              dy2.stride(0), x2.stride(0), dx.stride(0), n_rows, n_cols,
                              rows_per_program, HAS_WEIGHT=weight is not None, BLOCK=block,
                              num_warps=num_warps_for(block))
    return dx.view(shape), dw.sum(0), db.sum(0)
