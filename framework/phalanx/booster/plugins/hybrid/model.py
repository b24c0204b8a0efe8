"""`HybridModel`: the forward of a model boosted by HybridParallelPlugin (pp_size=1)."""
from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from phalanx.mesh import LayoutError
from phalanx.sequence import gather_sequence, shard_inputs
from phalanx.shard.layers import VocabParallelLMHead
from phalanx.shard.tensor_parallel import TPPlan


class HybridModel(nn.Module):
    """Runs the split model on a batch: cuts Ulysses/ring batches to this rank's tokens (labels
    shifted first, explicit position ids), checks split-gather sequence lengths, and returns full
    logits when no labels are given. With labels, `outputs.loss` is the loss of the whole batch on
    every rank and `outputs.logits` stays this rank's shard (vocabulary over tp, sequence over sp):
    the loss never gathers them."""

    def __init__(self, model: nn.Module, plan: TPPlan, seq, tp_group):
        super().__init__()
        self.model = model
        self.plan = plan
        self.seq = seq
        self.tp_group = tp_group

    def forward(self, *args: Any, **kwargs: Any):
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise TypeError("pass the batch as keyword arguments (input_ids=..., labels=...)")
            kwargs["input_ids"] = args[0]
        kwargs.setdefault("use_cache", False)
        wants_logits = kwargs.get("labels") is None
        seq_len = None
        if self.seq is not None and self.seq.mode == "split_gather":
            source = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            if source is not None and source.shape[1] % self.seq.size:
                s, n = source.shape[1], self.seq.size
                raise LayoutError(f"split-gather sequence parallelism cuts the sequence over tp_size={n} ranks: "
                                  f"length {s} % {n} = {s % n}; pad or crop sequences to a multiple of {n}")
        elif self.seq is not None:
            kwargs, seq_len = shard_inputs(kwargs, self.seq)
        head = self._head()
        # the loss needs only this rank's vocabulary range; a Ulysses/ring model runs on a cut batch
        local = head.local_logits() if head is not None and not wants_logits else contextlib.nullcontext()
        sharded = self.seq.sharded_inputs() if seq_len is not None else contextlib.nullcontext()
        with local, sharded:
            out = self.model(**kwargs)
        logits = getattr(out, "logits", None)
        if wants_logits and logits is not None and seq_len is not None:
            out.logits = gather_sequence(logits, self.seq, seq_len)
        return out

    def _head(self):
        try:
            head = self.model.get_submodule(self.plan.policy.head)
        except AttributeError:
            return None
        return head if isinstance(head, VocabParallelLMHead) else None
