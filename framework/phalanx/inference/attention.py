"""Attention over the paged KV cache for one flattened step (all tokens of all sequences in one
row-major batch, no padding).

A step's tokens come in two kinds of runs:
- *batched groups*: sequences that each bring the same small number q of tokens and already have
  context in the cache — decodes (q = 1), speculative verification (q = k + 1), draft proposals
  (q = 2). A group's keys/values are gathered through the block tables into one
  [B, Hkv, S, D] tensor and attended in one call, masked to each row's length. The runner sorts
  these sequences by length and cuts them into a few groups, so a short sequence is not padded to
  the longest one in the step.
- *prefill segments*: a prompt, or a chunk of one. A fresh prompt attends to its own keys without
  touching the cache; a chunk after a cached prefix gathers its context through its block table.

Keys and values of every token in the step are written to the cache (with RoPE) before any
attention runs, so a sequence may attend to blocks another sequence of the same step is filling —
which is what lets identical prompt prefixes be shared within one step.

Kernels: on CUDA, RoPE + cache write, decode attention and prefill attention are phalanx_kernels'
Triton kernels. Elsewhere, prefills use phalanx_kernels' flash-attention reference (torch SDPA);
decode groups use one SDPA call over the gathered, uncopied keys (measured on CPU: ~2x faster than
the paged-decode reference in fp32, ~4x in bf16, which upcasts and copies), and RoPE + cache
write rotate q and k in one pass and store with `index_copy_` (~2x fewer ops than the reference,
bit-identical results). Sliding-window layers use SDPA with an explicit window mask. One-token
decode groups pass the query heads of each KV head as that head's rows, so each gathered key is
read once per KV head rather than once per query head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phalanx.inference.kernels import cuda_kernels, flash_attention
from phalanx_kernels import paged_decode_attention, rope_and_cache_write


@dataclass
class PrefillSegment:
    start: int  # first row of the segment in the flattened step
    end: int
    context_len: int  # tokens visible to the segment's last query (cached prefix + segment)
    block_table: torch.Tensor | None  # None when the segment is a whole fresh prompt
    _masks: dict = field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        return self.block_table is None

    def window_mask(self, window: int, device) -> torch.Tensor:
        """[n, context] boolean mask of a sliding window (built once per step and window, shared by
        all layers)."""
        if window not in self._masks:
            self._masks[window] = _window_mask(self.end - self.start, self.context_len, window, device)
        return self._masks[window]


@dataclass
class BatchedGroup:
    start: int  # first row; the group holds rows [start, start + num_seqs * q_len)
    num_seqs: int
    q_len: int
    block_tables: torch.Tensor  # [B, max_blocks]
    context_lens: torch.Tensor  # [B]
    _masks: dict = field(default_factory=dict)

    def mask(self, block_size: int, window: int | None, dtype: torch.dtype, tiles: int = 1) -> torch.Tensor:
        """[B, 1, q, S] additive mask (0 or -inf): key j is visible to query i of row b when it is not
        in the future (j <= ctx_b - q + i) and, with a sliding window W, not too far back
        (j > ctx_b - q + i - W). Built once per step and window, shared by all layers; additive
        rather than boolean because SDPA would convert a boolean mask in every call. `tiles`:
        the q rows repeated that many times ([B, 1, tiles * q, S], for stacked query heads)."""
        key = (window, dtype, tiles)
        if tiles > 1 and key not in self._masks:
            self._masks[key] = self.mask(block_size, window, dtype).repeat(1, 1, tiles, 1)
        if key not in self._masks:
            keys = torch.arange(self.block_tables.shape[1] * block_size, device=self.context_lens.device)
            pos = (self.context_lens.unsqueeze(-1) - self.q_len
                   + torch.arange(self.q_len, device=keys.device)).unsqueeze(-1)  # [B, q, 1]
            visible = keys <= pos
            if window is not None:
                visible &= keys > pos - window
            additive = torch.zeros(visible.shape, dtype=dtype, device=keys.device)
            self._masks[key] = additive.masked_fill_(~visible, float("-inf")).unsqueeze(1)
        return self._masks[key]


@dataclass
class AttentionBatch:
    """Where a step's tokens go in the cache and what each may attend to."""

    slot_mapping: torch.Tensor  # [N] cache slot of each token
    block_size: int
    skips_slots: bool = False  # some slots are negative: do not store those tokens (profiling)
    groups: list[BatchedGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE on x [N, H, D] in place (cos/sin [N, D], HF's tables, whose halves repeat):
    x * cos + rotate_half(x) * sin, operation for operation. The compiled model step compiles this
    same function (`compiled.CompiledModelStep`)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    x1.copy_(r1)
    x2.copy_(r2)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   qk: torch.Tensor | None = None, skips_slots: bool = False, rotate=rotate_) -> None:
    """Rotate q and k in place and store k and v at their slots.

    `qk` may be a [N, Hq + Hkv, D] view covering q and k (adjacent in the fused projection) so both
    rotate in one pass. Off CUDA `rotate` (`rotate_`, or its compiled form) then `store_kv`; on
    CUDA phalanx_kernels' fused Triton kernel.
    """
    if cuda_kernels(q):
        rope_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return
    for x in ((qk,) if qk is not None else (q, k)):
        rotate(x, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping, skips_slots)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, skips_slots: bool = False) -> None:
    """Write k and v [N, Hkv, D] (already rotated) to their cache slots; negative slots are skipped
    when `skips_slots` (the profiling step). One cache for both (DeepSeek's latent: `v_cache is
    k_cache` and `v is k`) is written once."""
    heads, dim = k.shape[1:]
    shared = v_cache is k_cache and v is k
    if skips_slots:
        keep = slot_mapping >= 0
        slot_mapping, k = slot_mapping[keep], k[keep]
        v = k if shared else v[keep]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    if not shared:
        v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _window_mask(num_queries: int, context_len: int, window: int, device) -> torch.Tensor:
    pos = torch.arange(context_len - num_queries, context_len, device=device).unsqueeze(-1)
    keys = torch.arange(context_len, device=device)
    return (keys <= pos) & (keys > pos - window)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Cache blocks [..., blocks] -> keys [..., Hkv, blocks * block_size, D] (a strided view of one
    gathered copy). index_select copies whole blocks; measured ~5x faster on CPU than advanced
    indexing (`cache[table]`), which goes element by element."""
    blocks = torch.index_select(cache, 0, block_table.reshape(-1))  # [n, bs, Hkv, D]
    shape = (*block_table.shape[:-1], block_table.shape[-1] * cache.shape[1], *cache.shape[2:])
    return blocks.view(shape).transpose(-3, -2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, sliding_window: int | None = None
                    ) -> torch.Tensor:
    """q [N, Hq, D] (rotated), k and v [N, Hkv, D] (rotated, already in the cache) -> [N, Hq, D]."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    for g in batch.groups:
        rows = slice(g.start, g.start + g.num_seqs * g.q_len)
        if g.q_len == 1 and sliding_window is None and cuda_kernels(q):
            out[rows] = paged_decode_attention(q[rows].contiguous(), k_cache, v_cache, g.block_tables, g.context_lens)
            continue
        keys, values = _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables)
        if g.q_len == 1:
            mask = g.mask(batch.block_size, sliding_window, q.dtype)
            # The query heads sharing a KV head become that head's rows: [B, Hkv, Hq / Hkv, D].
            # One pass over each gathered key serves all of them (measured ~20% faster than
            # enable_gqa in fp32, the same in bf16); every row has the same mask, so it broadcasts.
            qb = q[rows].view(g.num_seqs, keys.shape[1], -1, q.shape[-1])
            out[rows] = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask).view(-1, *q.shape[1:])
            continue
        # Short chunks (verification of proposals): the same, with each KV head's query heads
        # stacked as G blocks of q rows [B, Hkv, G * q, D] and the mask tiled G times (SDPA
        # reads each key once per KV head, not once per query head: measured 1.8x faster than
        # enable_gqa at 32 x 4 queries, bf16, 1 thread)
        b, hkv, d = g.num_seqs, keys.shape[1], q.shape[-1]
        heads = q.shape[1] // hkv
        qb = q[rows].view(b, g.q_len, hkv, heads, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, heads * g.q_len, d)
        ob = F.scaled_dot_product_attention(qb, keys, values, attn_mask=g.mask(batch.block_size, sliding_window,
                                                                               q.dtype, tiles=heads))
        out[rows] = ob.view(b, hkv, heads, g.q_len, d).permute(0, 3, 1, 2, 4).reshape(b * g.q_len, *q.shape[1:])
    for seg in batch.prefills:
        qs = q[seg.start:seg.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if seg.fresh:
            ks = k[seg.start:seg.end].transpose(0, 1).unsqueeze(0)
            vs = v[seg.start:seg.end].transpose(0, 1).unsqueeze(0)
        else:
            ks = _gather(k_cache, seg.block_table)[:, :seg.context_len].unsqueeze(0)
            vs = _gather(v_cache, seg.block_table)[:, :seg.context_len].unsqueeze(0)
        if sliding_window is not None and seg.context_len > sliding_window:
            mask = seg.window_mask(sliding_window, q.device)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
        else:
            os_ = flash_attention(qs, ks, vs, causal=True)
        out[seg.start:seg.end] = os_.squeeze(0).transpose(0, 1)
    return out
