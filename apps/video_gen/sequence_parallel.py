"""Ulysses sequence parallelism for diffusers' Wan transformer, over the video tokens.

`UlyssesSelfAttention` replaces each block's self-attention processor: projections, RMS norms
and 3D RoPE run on this rank's tokens, `phalanx.sequence.ulysses_attention` trades tokens for
heads around the attention itself. Cross-attention to the prompt and the feed-forward layers are
per token and need no communication. With `group=None` it is ordinary attention, so one model
serves training with SP and sampling without.

Data x sequence (`parallel.sp_size` = sp dividing the world): consecutive groups of sp ranks are
the SP groups, and the world / sp groups are the data-parallel replicas. `sequence_replicas.py`
gives fit's plugin (DDP, ZeRO-1/2, FSDP2 or Gemini) `ranks_per_replica=sp`: it deals one
micro-batch per group (each group's ranks get the same batch and draw the same random numbers),
shards over every rank and averages gradients over every rank. Each
rank computes 1/sp of its group's tokens and returns sp x its shard's loss
(`VideoFlowModel.shard_loss`): the mean over a group is the micro-batch's loss, so the average over
all ranks is the data-parallel average over the groups, the gradient of one process on the same
global batch.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from phalanx.config import ConfigError
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


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """This rank's place in the data x sequence layout."""
    dp: int          # data-parallel replicas (SP groups)
    sp: int          # ranks per SP group
    dp_rank: int     # which SP group this rank belongs to
    sp_rank: int     # its place inside the group (which token shard it computes)
    group: dist.ProcessGroup | None

    def describe(self) -> str:
        return (f"dp={self.dp} x sp={self.sp}: this rank is token shard {self.sp_rank + 1}/{self.sp} of replica "
                f"{self.dp_rank + 1}/{self.dp} (each rank computes 1/{self.sp} of its replica's clips)")


def check_sp_size(sp: int, world: int) -> int:
    """The number of data-parallel replicas, world / sp; a ConfigError unless sp divides the world."""
    if sp < 1 or world % sp:
        raise ConfigError(f"config 'parallel.sp_size'={sp}: the {world} ranks split into data-parallel replicas of "
                          f"sp_size ranks each; choose an sp_size that divides {world} (world = dp x sp)")
    return world // sp


def sequence_layout(sp: int) -> SequenceLayout:
    """The SP groups: ranks [k sp, (k + 1) sp) for k < world / sp (every rank creates every group, as
    `new_group` requires), and this rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_sp_size(sp, world)
    mine = None
    for first in range(0, world, sp):
        group = dist.new_group(list(range(first, first + sp)))
        if first <= rank < first + sp:
            mine = group
    return SequenceLayout(dp=world // sp, sp=sp, dp_rank=rank // sp, sp_rank=rank % sp, group=mine)
