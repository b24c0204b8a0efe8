"""Attention on one block of queries against one block of keys, returning the log-sum-exp, and its
backward given the *final* output and log-sum-exp: the two pieces ring attention is built from.

q [B, H, T, D]; k, v [B, Hkv, S, D] with H a multiple of Hkv (grouped-query attention);
causal=True masks key j > query i (blocks on the diagonal have T == S). The log-sum-exp is
natural-log, fp32, [B, H, T]. On CUDA the Triton flash-attention kernels of `phalanx_kernels`
run (they share this interface); elsewhere the torch reference below.
"""
from __future__ import annotations

import torch


def _use_kernel(*tensors) -> bool:
    try:
        from phalanx_kernels.dispatch import use_triton
    except ImportError:  # pragma: no cover - phalanx_kernels ships with phalanx
        return False
    return use_triton(*tensors)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    B, H, T, D = q.shape
    return q.reshape(B, kv_heads, H // kv_heads, T, D)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """fp32 scores [B, Hkv, G, T, S] (masked entries -inf)."""
    qg = _grouped(q, k.shape[1]).float()
    s = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        T, S = q.shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1 + S - T)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_forward_reference(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, T]
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.matmul(p, v.float().unsqueeze(2))  # [B, Hkv, G, T, D]
    return o.reshape(B, H, T, -1).to(q.dtype), lse.reshape(B, H, T)


def block_backward_reference(do, q, k, v, o, lse, causal: bool, scale: float):
    B, H, T, D = q.shape
    Hk = k.shape[1]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), Hk))  # [B, Hkv, G, T, S]
    dog = _grouped(do, Hk).float()
    delta = (dog * _grouped(o, Hk).float()).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.float().unsqueeze(2)).reshape(B, H, T, D)
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q, Hk).float()).sum(2)
    return dq, dk, dv


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, fp32 log-sum-exp)."""
    if _use_kernel(q, k, v):
        from phalanx_kernels._triton import attention as kernel
        return kernel.forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)
    return block_forward_reference(q, k, v, causal, scale)


def block_backward(do, q, k, v, o, lse, causal: bool, scale: float):
    """(dq, dk, dv) of this block, given the final output `o` and log-sum-exp `lse` of the queries."""
    if _use_kernel(q, k, v):
        from phalanx_kernels._triton import attention as kernel
        return kernel.backward(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                               lse.contiguous(), causal, scale)
    return block_backward_reference(do, q, k, v, o, lse, causal, scale)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine a running (fp32 output, lse) with one more block's: the online softmax."""
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse
