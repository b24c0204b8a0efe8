"""Ulysses sequence parallelism for diffusers' Wan transformer, over the video tokens.

`UlyssesSelfAttention` replaces each block's self-attention processor: projections, RMS norms
and 3D RoPE run on this rank's tokens, `phalanx.sequence.ulysses_attention` trades tokens for
heads around the attention itself. Cross-attention to the prompt and the feed-forward layers are
per token and need no communication. With `group=None` it is ordinary attention, so one model
serves training with SP and sampling without.
"""
from __future__ import annotations

import torch

from phalanx.sequence import ulysses_attention


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs: x [B, L, H, D], cos/sin [1, L, 1, D]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class UlyssesSelfAttention:
    """Attention processor for a Wan block's `attn1` (self-attention, no image branch)."""

    def __init__(self):
        self.group = None  # set by `VideoFlowModel.sequence_parallel` for the duration of a forward

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None or attn.add_k_proj is not None:
            raise ValueError("UlyssesSelfAttention serves Wan's self-attention only (no mask, no image branch)")
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            q, k = apply_rotary(q, *rotary_emb), apply_rotary(k, *rotary_emb)
        out = ulysses_attention(q, k, v, self.group).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer) -> list[UlyssesSelfAttention]:
    processors = []
    for block in transformer.blocks:
        proc = UlyssesSelfAttention()
        block.attn1.set_processor(proc)
        processors.append(proc)
    return processors
