"""Decode-step attention over a paged (block-table) KV cache, for the inference engine.

q [B, H, D]: one new token per sequence (already rotated); k_cache, v_cache
[num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] (int): sequence b's position p lives
in block `block_tables[b, p // block_size]` at offset `p % block_size`; context_lens [B]: how many
cached positions each sequence attends to (including the new token once it has been written with
`rope_and_cache_write`). Entries of block_tables past a sequence's length are never read.
Returns [B, H, D]. `num_splits` only steers the GPU kernel's split-KV parallelism.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def _check(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [B, H, D] and caches [blocks, block_size, Hkv, D]; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not fit cache heads/dim {tuple(k_cache.shape[2:])}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"block_tables must be [B, max_blocks] and context_lens [B] for B={q.shape[0]}; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                     scale: float | None = None, num_splits: int | None = None):
    """Gathers each sequence's pages into a dense [B, L, Hkv, D] view, then masks past its length."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    page, Hk = k_cache.shape[1], k_cache.shape[2]
    scale = D ** -0.5 if scale is None else scale
    L = block_tables.shape[1] * page
    tables = block_tables.long().clamp(min=0)  # unused entries may hold -1
    k = k_cache[tables].reshape(B, L, Hk, D).transpose(1, 2).float()  # [B, Hk, L, D]
    v = v_cache[tables].reshape(B, L, Hk, D).transpose(1, 2).float()
    qg = q.float().view(B, Hk, H // Hk, D)
    s = torch.einsum("bkgd,bkld->bkgl", qg, k) * scale
    valid = torch.arange(L, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # an empty context attends to nothing
    return torch.einsum("bkgl,bkld->bkgd", p, v).reshape(B, H, D).to(q.dtype)


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                  scale: float | None = None, num_splits: int | None = None):
    from ._triton import paged_attention as kern
    _check(q, k_cache, v_cache, block_tables, context_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return kern.decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context (see module doc)."""
    if use_triton(q, k_cache, v_cache):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits)
