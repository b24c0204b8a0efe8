"""`HybridModel`: the forward of a model boosted by HybridParallelPlugin (pp_size=1)."""
from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from phalanx.mesh import LayoutError
from phalanx.models.deepseek import BalanceLoss, balance_settings
from phalanx.sequence import gather_sequence, shard_inputs
from phalanx.shard.expert_parallel import RouterLogits
from phalanx.shard.layers import VocabParallelLMHead
from phalanx.shard.tensor_parallel import TPPlan


class HybridModel(nn.Module):
    """Runs the split model on a batch: cuts Ulysses/ring batches to this rank's tokens (labels
    shifted first, explicit position ids), checks split-gather sequence lengths, and returns full
    logits when no labels are given. With labels, `outputs.loss` is the loss of the whole batch on
    every rank and `outputs.logits` stays this rank's shard (vocabulary over tp, sequence over sp):
    the loss never gathers them.

    With expert parallelism (`ep`, an ExpertParallelPlan), the router losses are those of the
    global batch: the config's `output_router_logits` adds `router_aux_loss_coef` times the
    load-balancing loss over every data(× sequence)-parallel rank's tokens (not transformers' per-rank
    one, which differs: the loss is not linear in the batch), and `z_loss` times the router z-loss; in
    the per-rank form whose mean over ranks is the global value (phalanx.shard.expert_parallel).
    Under Ulysses/ring each rank routes its own shard of the sequence; the router losses' values are
    summed over a row's shards (as the cross-entropy's), their gradients each shard's own.
    Without expert parallelism the same global-batch losses are computed from hooks on the routers
    (`phalanx.shard.expert_parallel.RouterLogits`): transformers' own aux loss would be the rank's, or
    under Ulysses/ring the sequence shard's. Both ways the model runs with output_router_logits=False
    (transformers adds no aux loss of its own; `outputs.router_logits` / `aux_loss` stay None).

    DeepSeek-V2 / V3 (whose configs have no router_aux_loss_coef): `output_router_logits` adds
    `aux_loss_alpha` times DeepSeek's own balance loss (V2's expert-level loss, V3's sequence-wise
    one: `phalanx.models.deepseek.BalanceLoss`, hooks on the routers), over the data-parallel
    group's batch, the same with and without expert parallelism."""

    def __init__(self, model: nn.Module, plan: TPPlan, seq, tp_group, ep=None, z_loss: float = 0.0, dp_group=None,
                 batch_group=None, sequence_group=None):
        """`dp_group`: the data-parallel ranks (DeepSeek's balance loss, refused under sequence
        parallelism); `batch_group`: the data × sequence-parallel ranks, whose tokens make up the
        global batch, and `sequence_group` the sequence-parallel ranks under Ulysses/ring (None
        without): the router losses without EP (with EP, the plan's own)."""
        super().__init__()
        self.model = model
        self.plan = plan
        self.seq = seq
        self.tp_group = tp_group
        self.ep, self.z_loss, self.dp_group = ep, z_loss, dp_group
        config = getattr(model, "config", None)
        self.balance = None  # DeepSeek's balance loss, when its config asks for it (boost.py checked the layout)
        if balance_settings(config) is not None:
            self.balance = BalanceLoss.attach(model)
        self.routers = None  # without EP: the router logits of the last forward, for the router losses
        switch = self.balance is None and bool(getattr(config, "output_router_logits", False)) and \
            hasattr(config, "router_aux_loss_coef")
        if ep is None and (switch or z_loss):
            self.routers = RouterLogits.attach(model, batch_group, sequence_group)

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
        wanted = kwargs.get("output_router_logits") is not False and \
            bool(getattr(self.model.config, "output_router_logits", False))
        balance = self.balance is not None and wanted  # DeepSeek's own loss, with or without EP
        routers = self.ep if self.ep is not None else self.routers  # the router logits, by hooks
        aux = routers is not None and self.balance is None and wanted  # the Switch loss of Mixtral / Qwen-MoE
        if routers is not None:
            kwargs["output_router_logits"] = False
        with local, sharded:
            out = self.model(**kwargs)
        if balance and getattr(out, "loss", None) is not None:
            out.loss = out.loss + self.balance.loss(kwargs.get("attention_mask"), group=self.dp_group)
        if routers is not None and getattr(out, "loss", None) is not None:
            mask = kwargs.get("attention_mask")
            if aux:
                out.loss = out.loss + self.model.config.router_aux_loss_coef * routers.load_balancing_loss(mask)
            if self.z_loss:
                out.loss = out.loss + self.z_loss * routers.router_z_loss(mask)
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
