"""Cutting a batch to this rank's tokens (Ulysses/ring) and putting outputs back in order.

Labels are shifted for next-token prediction *before* the sequence is cut (a shard's last token
predicts the first token of the next shard), and passed to the model as `shift_labels`, which
transformers' causal-LM losses (and `phalanx.shard.loss.CausalLMLoss`) take as already shifted.
Position ids are always passed explicitly: the model would otherwise number each shard from 0.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phalanx.data.labels import IGNORE_INDEX
from phalanx.sequence.context import SequenceContext
from phalanx.shard import comm


def _drop_full_mask(mask: torch.Tensor | None, mode: str) -> None:
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError(f"{mode} sequence parallelism cannot apply a padding attention_mask; pack sequences to the "
                         "full length (padding positions can carry labels of -100) and pass no attention_mask")


def shard_inputs(kwargs: dict[str, Any], seq: SequenceContext) -> tuple[dict[str, Any], int]:
    """This rank's part of a causal-LM batch; returns (new kwargs, full sequence length)."""
    kwargs = dict(kwargs)
    source = kwargs.get("input_ids")
    if source is None:
        source = kwargs.get("inputs_embeds")
    if source is None:
        raise ValueError("sequence parallelism needs input_ids or inputs_embeds as keyword arguments")
    batch, seq_len = source.shape[0], source.shape[1]
    seq.check_length(seq_len)
    _drop_full_mask(kwargs.pop("attention_mask", None), seq.mode)
    index = seq.local_positions(seq_len, device=source.device)
    for key in ("input_ids", "inputs_embeds"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key].index_select(1, index)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(seq_len, device=source.device).unsqueeze(0).expand(batch, -1)
    kwargs["position_ids"] = positions.index_select(-1, index)
    labels = kwargs.get("labels")
    if labels is not None:
        shift = kwargs.get("shift_labels")
        if shift is None:
            shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        kwargs["shift_labels"] = shift.index_select(-1, index)
        kwargs["labels"] = labels.index_select(-1, index)
    return kwargs, seq_len


def gather_sequence(x: torch.Tensor, seq: SequenceContext, seq_len: int, dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor from every rank's shard (differentiable; every rank gets it)."""
    if seq.size == 1 and seq.chunks_per_rank == 1:
        return x
    full = comm.gather_replicated(x, dim, seq.group)
    return full.index_select(dim, seq.global_order(seq_len, device=x.device))
