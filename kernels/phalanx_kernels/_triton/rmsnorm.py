"""RMSNorm with an optional fused residual add: one program per row forward, row blocks backward."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import as_rows, device_guard, next_pow2, num_warps_for, parallel_programs


@triton.jit
def _fwd(X, R, W, Y, H, RSTD, stride_x, stride_r, stride_y, stride_h, n_cols, eps,
         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        # round the sum to the storage dtype first, exactly as `x + residual` in torch would
        x = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd(DY, DH, X, W, RSTD, DX, DW, stride_dy, stride_dh, stride_x, stride_dx, n_rows, n_cols,
         rows_per_program, HAS_DH: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 so row * stride cannot overflow
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row64 in range(row_start, row_end):
        x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row64)
        xhat = x * rstd
        dxhat = dy * w
        dx = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / n_cols))
        if HAS_DH:
            dx += tl.load(DH + row64 * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW + pid * n_cols + cols, dw, mask=mask)


def forward(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float):
    """Returns (y, h, rstd): h is x + residual (or x itself), the tensor the norm was taken of."""
    shape = x.shape
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else None
    n_rows, n_cols = x2.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    h = torch.empty_like(x2) if r2 is not None else x2
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block = next_pow2(n_cols)
        with device_guard(x):
            _fwd[(n_rows,)](x2, r2 if r2 is not None else x2, weight, y, h, rstd,
                            x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0),
                            h.stride(0), n_cols, eps, HAS_RESIDUAL=r2 is not None, BLOCK=block,
                            num_warps=num_warps_for(block))
    return y.view(shape), h.view(shape), rstd


def backward(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor,
             rstd: torch.Tensor):
    """Returns (dx, dweight); dx also carries dh, the gradient flowing into the residual stream."""
    shape = h.shape
    dy2, h2 = as_rows(dy), as_rows(h)
    dh2 = as_rows(dh) if dh is not None else None
    n_rows, n_cols = h2.shape
    dx = torch.empty((n_rows, n_cols), dtype=h.dtype, device=h.device)
    programs = max(1, min(n_rows, parallel_programs(h)))
    rows_per_program = triton.cdiv(n_rows, programs) if n_rows else 1
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=h.device)
    if n_rows:
        block = next_pow2(n_cols)
        with device_guard(h):
            _bwd[(programs,)](dy2, dh2 if dh2 is not None else dy2, h2, weight, rstd, dx, dw_partial,
                              dy2.stride(0), dh2.stride(0) if dh2 is not None else 0, h2.stride(0),
                              dx.stride(0), n_rows, n_cols, rows_per_program,
                              HAS_DH=dh2 is not None, BLOCK=block, num_warps=num_warps_for(block))
    return dx.view(shape), dw_partial.sum(0).to(weight.dtype)
