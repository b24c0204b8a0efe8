"""Ulysses and ring attention as Hugging Face attention functions.

transformers 5 looks attention up by name (`config._attn_implementation`) in its
`AttentionInterface` registry and calls it with the attention module and q [B, H, L, D],
k/v [B, Hkv, L, D] (this rank's sequence shard, rotary embeddings already applied); it expects
[B, L, H, D] back. Registering "phalanx_ulysses" and "phalanx_ring" there runs sequence-parallel
attention inside an unmodified model. The sequence-parallel group comes from the module
(`SequenceContext.of(module)`, attached by `apply_sp`).

Both are causal self-attention without a padding mask (sequence-parallel batches are packed or
full-length); a padding mask, a sliding window shorter than the sequence, or (ring) attention
dropout stops with a clear error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.sequence.comm import all_to_all
from phalanx.sequence.context import SequenceContext
from phalanx.sequence.ring import ring_attention

ULYSSES, RING = "phalanx_ulysses", "phalanx_ring"


def _context(module) -> SequenceContext:
    seq = SequenceContext.of(module)
    if seq is None:
        raise RuntimeError(f"{type(module).__name__} uses sequence-parallel attention but was not prepared by "
                           "phalanx.sequence.apply_sp")
    return seq


def _check(module, seq: SequenceContext, attention_mask, seq_len: int, kwargs) -> None:
    if attention_mask is not None:
        raise ValueError(f"{seq.mode} sequence parallelism does not take a padding attention mask: pack sequences "
                         "(or pad with ignored labels and drop attention_mask)")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{seq.mode} sequence parallelism implements causal self-attention only")
    window = kwargs.get("sliding_window")
    if window is not None and seq_len > window:
        raise ValueError(f"sequence length {seq_len} exceeds the sliding window {window}: {seq.mode} attention "
                         "computes full causal attention; use shorter sequences or no sequence parallelism")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float = 0.0):
    """Full causal attention [B, H, S, D] (the Triton flash kernel on CUDA, torch elsewhere)."""
    if dropout > 0.0:
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout)
    from phalanx_kernels.attention import flash_attention
    return flash_attention(q, k, v, causal=True, scale=scale)


def ulysses_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """All-to-all from sequence shards with all heads to the whole sequence with 1/sp of the heads,
    attention, and back."""
    seq = _context(module)
    _check(module, seq, attention_mask, query.shape[2] * seq.size, kwargs)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % seq.size:
        raise ValueError(f"Ulysses needs the {heads} local attention heads divisible by sp={seq.size}")
    if kv_heads % seq.size:  # too few key/value heads to spread: give every query head its own
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (all_to_all(t, 1, 2, seq.group) for t in (query, key, value))
    out = causal_attention(q, k, v, scale, dropout)
    out = all_to_all(out, 2, 1, seq.group)
    return out.transpose(1, 2).contiguous(), None


def ring_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs):
    seq = _context(module)
    _check(module, seq, attention_mask, query.shape[2] * seq.size, kwargs)
    if dropout > 0.0:
        raise ValueError("ring attention has no attention dropout: set the model's attention dropout to 0")
    out = ring_attention(query, key, value, seq, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_attention_functions() -> None:
    """Add "phalanx_ulysses" and "phalanx_ring" to transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES, ulysses_attention_forward)
    AttentionInterface.register(RING, ring_attention_forward)
