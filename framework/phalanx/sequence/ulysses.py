"""Ulysses all-to-all attention for bidirectional (non-causal) models such as video diffusion
transformers, on tensors in [batch, tokens, heads, head_dim] layout.

Each rank holds a contiguous shard of the tokens (rank order) with all heads. One all-to-all
trades that for all tokens with heads/sp of the heads, attention runs on the full sequence, and
a second all-to-all brings the output back to the token shard. Position encodings (RoPE) are
applied before, on each rank's own positions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.sequence.comm import all_to_all


def token_shard(length: int, group) -> slice:
    """This rank's contiguous share of `length` tokens; `length` must divide evenly."""
    size = dist.get_world_size(group) if group is not None else 1
    if length % size:
        raise ValueError(f"Ulysses sequence parallelism over {size} ranks needs the token count ({length}) divisible "
                         f"by {size}: choose frames/height/width (after patching) whose product divides by {size}")
    rank = dist.get_rank(group) if group is not None else 0
    per = length // size
    return slice(rank * per, (rank + 1) * per)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                      scale: float | None = None) -> torch.Tensor:
    """Full bidirectional attention of this rank's token shard, [B, L/sp, H, D] -> [B, L/sp, H, D]."""
    size = dist.get_world_size(group) if group is not None else 1
    heads = query.shape[2]
    if heads % size:
        raise ValueError(f"Ulysses needs the {heads} attention heads divisible by sp={size}")
    if size > 1:
        query, key, value = (all_to_all(t, 2, 1, group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         scale=scale).transpose(1, 2)
    if size > 1:
        out = all_to_all(out, 1, 2, group)
    return out
