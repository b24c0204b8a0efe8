"""Flash attention forward and backward (FlashAttention-2 style), causal or not, with GQA.

q [B, H, T, D]; k, v [B, Hkv, S, D], H a multiple of Hkv; any strides. Causal masking is aligned
to the bottom right (query i sees keys j <= i + S - T), which is the usual top-left mask when
T == S and the right one for a chunk of queries appended to a longer context. A query that sees
no key gets a zero output (its log-sum-exp is stored as +inf so the backward gives it zero
weights).

Forward: one program per (query block, batch*head) streams key blocks with an online softmax and
stores o and the fp32 log-sum-exp. Backward: delta = rowsum(o * do); one kernel per key block
and KV head accumulates dk, dv over every query head of its group (no atomics), another per
query block accumulates dq.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_guard, mma, next_pow2, upcast_dots


@triton.jit
def _fwd(Q, K, V, O, LSE, scale, sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
         sob, soh, sot, sod, H, GROUP, T, S, D, offset,
         CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=(offs_m < T)[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        kt = tl.load(k_base + n[None, :] * sks + offs_d[:, None] * skd,
                     mask=(n < S)[None, :] & d_ok[:, None], other=0.0)
        s = mma(q, kt, PRECISION, UPCAST) * scale
        ok = (n < S)[None, :] & (offs_m < T)[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= offs_m[:, None] + offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * svs + offs_d[None, :] * svd,
                    mask=(n < S)[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
             o.to(O.dtype.element_ty), mask=(offs_m < T)[:, None] & d_ok[None, :])
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def _bwd_kv(Q, K, V, DO, LSE, DELTA, DK, DV, scale, sqb, sqh, sqt, sqd, skb, skh, sks, skd,
            svb, svh, svs, svd, sdb, sdh, sdt, sdd, HK, GROUP, T, S, D, offset,
            CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = (pid_bh % HK).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = (offs_n < S)[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # queries before start_n - offset see none of these keys
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * (HK * GROUP) + h
        for start_m in range(lo, T, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < T
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(LSE + bh * T + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(DELTA + bh * T + offs_m, mask=m_ok, other=0.0)
            s = mma(q, tl.trans(k), PRECISION, UPCAST) * scale
            ok = (offs_n < S)[None, :] & m_ok[:, None]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None] + offset)
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            dv += mma(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
            dp = mma(do, tl.trans(v), PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            dk += mma(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    out = b * (HK * S * D) + hk * (S * D) + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_q(Q, K, V, DO, LSE, DELTA, DQ, scale, sqb, sqh, sqt, sqd, skb, skh, sks, skd,
           svb, svh, svs, svd, sdb, sdh, sdt, sdd, H, GROUP, T, S, D, offset,
           CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = offs_m < T
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd,
                 mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * T + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * T + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + offset)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n0
        kv_mask = (n < S)[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + hk * skh + n[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + hk * svh + n[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), PRECISION, UPCAST) * scale
        ok = (n < S)[None, :] & m_ok[:, None]
        if CAUSAL:
            ok = ok & (n[None, :] <= offs_m[:, None] + offset)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, PRECISION, UPCAST)
    out = pid_bh.to(tl.int64) * (T * D) + offs_m[:, None] * D + offs_d[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _config(x: torch.Tensor, d: int):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, precision) for this device and head dim."""
    block_d = max(16, next_pow2(d))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32 on tensor cores
    if not x.is_cuda:  # interpreter: small tiles so small test shapes still span several blocks
        return 16, 16, block_d, 1, precision
    if block_d <= 64:
        return 64, 64, block_d, 4, precision
    return (64, 32, block_d, 4, precision) if block_d <= 128 else (32, 32, block_d, 8, precision)


def _shapes(q, k, v):
    B, H, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % Hk:
        raise ValueError(f"flash attention needs q [B, H, T, D], k = v [B, Hkv, S, D] with H % Hkv == 0; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return B, H, T, D, Hk, S


def forward(q, k, v, causal: bool, scale: float):
    B, H, T, D, Hk, S = _shapes(q, k, v)
    o = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    bm, bn, bd, warps, precision = _config(q, D)
    if B * H * T:
        with device_guard(q):
            _fwd[(triton.cdiv(T, bm), B * H)](
                q, k, v, o, lse, scale, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                H, H // Hk, T, S, D, S - T, CAUSAL=causal, PRECISION=precision, UPCAST=upcast_dots(q),
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps)
    return o, lse


def backward(do, q, k, v, o, lse, causal: bool, scale: float):
    B, H, T, D, Hk, S = _shapes(q, k, v)
    delta = (o.float() * do.float()).sum(-1)  # [B, H, T]
    dq = torch.empty((B, H, T, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hk, S, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, Hk, S, D), dtype=v.dtype, device=v.device)
    bm, bn, bd, warps, precision = _config(q, D)
    common = dict(CAUSAL=causal, PRECISION=precision, UPCAST=upcast_dots(q), BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_D=bd, num_warps=warps)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    with device_guard(q):
        if B * Hk * S:
            _bwd_kv[(triton.cdiv(S, bn), B * Hk)](q, k, v, do, lse, delta, dk, dv, scale, *strides,
                                                   Hk, H // Hk, T, S, D, S - T, **common)
        if B * H * T:
            _bwd_q[(triton.cdiv(T, bm), B * H)](q, k, v, do, lse, delta, dq, scale, *strides,
                                                 H, H // Hk, T, S, D, S - T, **common)
    return dq, dk, dv
