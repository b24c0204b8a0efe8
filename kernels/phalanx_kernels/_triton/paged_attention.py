"""Decode attention (one query token per sequence) over a paged KV cache, split along the context.

Split-KV ("flash decoding"): with one query per sequence there are only batch x KV-heads rows of
work, too few to fill a GPU on long contexts, so each (sequence, KV head) is also split into
`num_splits` ranges of the context. Pass 1 gives each range a program that computes a partial
output and its log-sum-exp for all query heads of the group at once (K and V are read once per
group); pass 2 merges the partials with their softmax weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_guard, mma, next_pow2, parallel_programs, upcast_dots


@triton.jit
def _partial(Q, KC, VC, TABLES, LENS, OP, LSEP, scale, sqb, sqh, sqd, skb, sko, skh, skd,
             svb, svo, svh, svd, stb, HK, GROUP, D, page, split_len, n_splits,
             PRECISION: tl.constexpr, UPCAST: tl.constexpr,
             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // HK).to(tl.int64)
    hk = (pid % HK).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < D
    heads = hk * GROUP + g
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :] * sqd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    length = tl.load(LENS + b)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for pos0 in range(start, end, BLOCK_N):
        pos = pos0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        block = tl.load(TABLES + b * stb + pos // page, mask=ok, other=0).to(tl.int64)
        off = (pos % page).to(tl.int64)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(KC + block[:, None] * skb + off[:, None] * sko + hk * skh + d[None, :] * skd,
                    mask=kv_mask, other=0.0)
        v = tl.load(VC + block[:, None] * svb + off[:, None] * svo + hk * svh + d[None, :] * svd,
                    mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), PRECISION, UPCAST) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    empty = l_i == 0.0
    row = (b * (HK * GROUP) + heads) * n_splits + split  # [B, H, splits] layout
    tl.store(OP + row[:, None] * D + d[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=g_ok[:, None] & d_ok[None, :])
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(LSEP + row, lse, mask=g_ok)


@triton.jit
def _merge(OP, LSEP, O, n_splits, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    lse = tl.load(LSEP + row * n_splits + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty context: every weight is 0
    w = tl.exp(lse - m)
    part = tl.load(OP + (row * n_splits + s)[:, None] * D + d[None, :],
                   mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + row * D + d, o.to(O.dtype.element_ty), mask=d < D)


def default_splits(q: torch.Tensor, kv_heads: int, max_context: int) -> int:
    """Enough ranges to give the device ~2 programs per SM, none shorter than 256 tokens."""
    if not q.is_cuda:
        return 1
    rows = q.shape[0] * kv_heads
    return max(1, min(triton.cdiv(max_context, 256), triton.cdiv(2 * parallel_programs(q), rows), 64))


def decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, num_splits: int | None):
    B, H, D = q.shape
    page, Hk = k_cache.shape[1], k_cache.shape[2]
    group = H // Hk
    max_context = block_tables.shape[1] * page
    splits = num_splits or default_splits(q, Hk, max_context)
    block_n = 16 if not q.is_cuda else 64
    split_len = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    o_part = torch.empty((B, H, splits, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B * H == 0:
        return out
    block_d = max(16, next_pow2(D))
    with device_guard(q):
        _partial[(B * Hk, splits)](q, k_cache, v_cache, block_tables, context_lens, o_part, lse_part,
                                   scale, *q.stride(), *k_cache.stride(), *v_cache.stride(),
                                   block_tables.stride(0), Hk, group, D, page, split_len, splits,
                                   PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                                   UPCAST=upcast_dots(q), BLOCK_G=max(16, next_pow2(group)),
                                   BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)
        _merge[(B * H,)](o_part, lse_part, out, splits, D, BLOCK_S=next_pow2(splits),
                         BLOCK_D=next_pow2(D), num_warps=1)
    return out
