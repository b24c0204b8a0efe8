"""Ring attention: every rank keeps its queries; key/value blocks travel around the sequence-
parallel ring, one hop per step, and each rank folds each visiting block into its output with an
online softmax. Memory per rank is O(local sequence); the next block's transfer overlaps the
current block's computation.

Blocks are the chunks of `SequenceContext` (zigzag: two per rank). A query chunk sees a key chunk
fully when the key chunk is earlier, causally when it is the same chunk, not at all when later;
skipped blocks cost nothing, which is what the zigzag layout balances.

Backward runs the ring again: each rank adds its queries' contribution to the visiting block's
key/value gradients, which travel with the block and arrive back at its owner after the last hop.
"""
from __future__ import annotations

import torch

from phalanx.sequence.blocks import block_backward, block_forward, merge
from phalanx.sequence.comm import RingExchange
from phalanx.sequence.context import SequenceContext


def _relation(q_chunk: int, k_chunk: int) -> str | None:
    if k_chunk < q_chunk:
        return "full"
    if k_chunk == q_chunk:
        return "causal"
    return None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, seq: SequenceContext):
        n = seq.chunks_per_rank
        mine = seq.chunk_ids()
        qs = q.split(q.shape[2] // n, dim=2)
        outs: list = [None] * n
        lses: list = [None] * n
        ring = RingExchange(seq.group)
        k_cur, v_cur = k, v
        for step in range(seq.size):
            src = (seq.rank - step) % seq.size
            if step < seq.size - 1:
                ring.start([k_cur, v_cur])
            ks, vs = k_cur.split(k.shape[2] // n, dim=2), v_cur.split(v.shape[2] // n, dim=2)
            for i, qi in enumerate(qs):
                for j, k_chunk in enumerate(seq.chunk_ids(src)):
                    rel = _relation(mine[i], k_chunk)
                    if rel is None:
                        continue
                    o_blk, lse_blk = block_forward(qi, ks[j], vs[j], rel == "causal", scale)
                    outs[i], lses[i] = merge(outs[i], lses[i], o_blk, lse_blk)
            if step < seq.size - 1:
                k_cur, v_cur = ring.wait()
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.seq = scale, seq
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        seq, scale = ctx.seq, ctx.scale
        n = seq.chunks_per_rank
        mine = seq.chunk_ids()
        tq, tk = q.shape[2] // n, k.shape[2] // n
        qs, dos, os_, lses = q.split(tq, 2), do.split(tq, 2), out.split(tq, 2), lse.split(tq, 2)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = dq.split(tq, 2)
        ring, grads = RingExchange(seq.group), RingExchange(seq.group)
        k_cur, v_cur = k, v
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(seq.size):
            src = (seq.rank - step) % seq.size
            if step < seq.size - 1:
                ring.start([k_cur, v_cur])
            ks, vs = k_cur.split(tk, 2), v_cur.split(tk, 2)
            dks, dvs = dk.split(tk, 2), dv.split(tk, 2)
            for i in range(n):
                for j, k_chunk in enumerate(seq.chunk_ids(src)):
                    rel = _relation(mine[i], k_chunk)
                    if rel is None:
                        continue
                    dq_b, dk_b, dv_b = block_backward(dos[i], qs[i], ks[j], vs[j], os_[i], lses[i],
                                                      rel == "causal", scale)
                    dqs[i].add_(dq_b.float())
                    dks[j].add_(dk_b.float())
                    dvs[j].add_(dv_b.float())
            if step < seq.size - 1:
                k_cur, v_cur = ring.wait()
            # the gradients of the block just used follow it to the next rank (after the last
            # step, that is the block's owner)
            if seq.size > 1:
                grads.start([dk, dv])
                dk, dv = grads.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SequenceContext,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries [B, H, L, D] over the whole sequence, whose keys and
    values [B, Hkv, L, D] are spread over `seq`'s ranks in its layout. Returns [B, H, L, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, scale, seq)
