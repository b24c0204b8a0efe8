"""Cache the frozen lower blocks' output once, so preference steps with `train_layers: N` run only the top N.

With `train_layers: N` the lower L-N blocks (and the embeddings) never change, so the hidden state
they hand to block L-N is the same at every step. `FrozenTrunk` records it during the pass that
already runs over every example before training (the cached reference pass, when the reference is
the starting policy; otherwise one extra no-grad pass), stores each row's valid positions, and
afterwards feeds it back as `inputs_embeds` while the lower blocks return their input unchanged.

The forward still goes through the model's own (boosted) forward — DDP arms its gradient
all-reduce there, and `booster.backward` refuses a loss computed past the wrapper — only the
lower blocks' work is skipped. Positions and the attention mask come from the batch as before, so
the top blocks see exactly the values a full forward gives them (up to the rounding of a
different batch shape): the first DPO loss is still log 2.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch


class FrozenTrunk:
    """The lower `len(blocks) - train_layers` blocks of a Llama-family decoder, cached and skippable."""

    def __init__(self, model: torch.nn.Module, train_layers: int) -> None:
        blocks = getattr(model.base_model, "layers", None)
        if blocks is None:
            raise ValueError(f"{type(model).__name__} has no .layers: caching the frozen trunk needs a Llama-family "
                             "decoder; set cache_frozen_trunk=false")
        if not 0 < train_layers < len(blocks):
            raise ValueError(f"train_layers={train_layers}: the frozen-trunk cache needs 0 < train_layers < "
                             f"{len(blocks)} (the model's blocks)")
        self.split = len(blocks) - train_layers
        self.embeddings = model.get_input_embeddings()  # its weight's dtype is the one the blocks compute in
        self.lower = list(blocks[:self.split])
        self.boundary = blocks[self.split - 1]  # its output is what the top blocks read
        self.skip = False
        for block in self.lower:
            self._make_skippable(block)

    def _make_skippable(self, block: torch.nn.Module) -> None:
        run = block.forward

        def forward(hidden_states, *args, **kwargs):
            return hidden_states if self.skip else run(hidden_states, *args, **kwargs)
        block.forward = forward  # an instance attribute: hooks, state_dict and export are untouched

    def as_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """Cached states in the dtype the model computes in now: they are captured before training (float32)
        and `fit` may cast the model to bf16 (the GPU default), where a float32 input would meet bf16 weights."""
        return hidden.to(self.embeddings.weight.dtype)

    @contextmanager
    def skipping(self):
        """Inside: the lower blocks pass their input through (feed the cached states as inputs_embeds)."""
        self.skip = True
        try:
            yield
        finally:
            self.skip = False

    @contextmanager
    def capturing(self, sink: list):
        """Inside: every forward appends the boundary block's output [B, W, H] (detached) to `sink`."""
        def hook(_module, _inputs, output):
            sink.append((output[0] if isinstance(output, tuple) else output).detach())
        handle = self.boundary.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def trunk_for(model: torch.nn.Module, train_layers: int, enabled: bool = True) -> FrozenTrunk | None:
    """The trunk to cache for `train_layers`, or None when nothing below the trained blocks is frozen
    (train_layers 0 = all trained, or at least as many as the model has: train_top_layers judges those)."""
    blocks = getattr(model.base_model, "layers", None)
    if not enabled or train_layers <= 0 or blocks is None or train_layers >= len(blocks):
        return None
    return FrozenTrunk(model, train_layers)


def split_rows(hidden: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's valid (non-padding) positions of a left-padded batch, [n_i, H], as contiguous copies."""
    lengths = attention_mask.sum(-1).tolist()
    width = hidden.shape[1]
    return [hidden[i, width - int(n):].clone() for i, n in enumerate(lengths)]


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Left-pad [n_i, H] rows with zeros to [B, width, H] (padding is masked out of attention)."""
    out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"cached hidden state row {i} has {len(r)} positions, the batch only {width}")
        out[i, width - len(r):] = r
    return out
