"""Cross-entropy over one chunk of logits, turning the logits into their gradient in place.

One program per row makes two passes over the vocabulary: an online max / sum-exp (plus the sum
of logits, for label smoothing) to get the log-sum-exp and the loss, then a pass that overwrites
each logit with `scale * (softmax - (1 - eps) * onehot - eps / V)`. The logits buffer is the
only [chunk, V] tensor that ever exists.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_guard, next_pow2


@triton.jit
def _ce_rows(LOGITS, stride, TARGET, SCALE, LOSS, V, ignore_index, smoothing,
             HAS_GRAD: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    y = tl.load(TARGET + row).to(tl.int64)
    valid = y != ignore_index
    y_safe = tl.where(valid, y, 0)
    m = float("-inf")
    s = 0.0
    z_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if SMOOTH:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    z_y = tl.load(ptr + y_safe).to(tl.float32)
    if SMOOTH:
        loss = lse - (1.0 - smoothing) * z_y - smoothing * (z_sum / V)
    else:
        loss = lse - z_y
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if HAS_GRAD:
        sc = tl.load(SCALE + row).to(tl.float32)  # already 0 for ignored rows
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            z = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(z - lse)
            if SMOOTH:
                g = g - smoothing / V
            g = tl.where(cols == y_safe, g - (1.0 - smoothing), g) * sc
            tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)


def ce_step(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float,
            scale: torch.Tensor | None):
    """Loss per row (fp32); with `scale` ([rows] fp32) the logits become the gradient, in place."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(next_pow2(vocab), 4096 if logits.is_cuda else 1024)
        with device_guard(logits):
            _ce_rows[(rows,)](logits, logits.stride(0), target, scale if scale is not None else loss,
                              loss, vocab, ignore_index, smoothing, HAS_GRAD=scale is not None,
                              SMOOTH=smoothing > 0, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return loss, (logits if scale is not None else None)
