"""Boosting under HybridParallelPlugin: `configure_model` and `configure_optimizer`.

`configure_model` applies, in this order (each step one function, see docs/hybrid.md):
1. check the layout against the model (heads, key/value heads, sequence mode) — before any work;
2. `apply_tp` (phalanx.shard): split attention heads, MLP and vocabulary over the tp group
   (materialising only this rank's pieces when the model was built lazily, phalanx.lazy);
3. `apply_sp` (phalanx.sequence): split-gather hooks, or Ulysses/ring attention functions —
   with pp_size > 1, cut the model into this rank's pipeline stages instead (split-gather per stage);
4. activation checkpointing, if asked for;
5. move to the device and cast to the compute precision;
6. install the vocabulary-parallel, sequence-aware causal-LM loss as the model's loss function;
7. make replicas identical (broadcast replicated pieces over tp, everything over dp × sp; with pp,
   the first stage's copy of each tied embedding to the last stage).

The result is recorded in a `BoostedState` (plan, parameter names before sharding, and with pp
the runner, the tied parameters and their aliases). `configure_optimizer` re-points the user's
optimizer at the split parameters by name and wraps it: ZeRO-1/2 (`phalanx.zero`) over the
data × sequence group of each tensor-parallel rank, or all-reduce data parallelism for
zero_stage=0 (`phalanx.shard.optim`).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster.plugins.base import unwrap_model
from phalanx.booster.plugins.hybrid.model import HybridModel
from phalanx.booster.state import BoostedState, boosted_state
from phalanx.booster.wrappers import ModelWrapper
from phalanx.launch import collective
from phalanx.param_binding import rebind_optimizer_params
from phalanx.pipeline import PipelineModel, PipelineRunner, split_layers, split_model, tie_aliases
from phalanx.pipeline.params import rebind_to_stages, tied_across_stages
from phalanx.sequence import apply_sp, check_sequence_layout
from phalanx.sequence.split_gather import apply_split_gather
from phalanx.shard import CausalLMLoss, apply_tp, check_heads, policy_for
from phalanx.shard.grads import PartialGradSync
from phalanx.shard.layers import VocabParallelLMHead
from phalanx.shard.optim import HybridOptimizer, HybridZeroOptimizer
from phalanx.shard.tensor_parallel import TPPlan, local_head_counts
from phalanx.zero.optimizer import ZeroConfig

log = logging.getLogger(__name__)


def hybrid_state(obj: Any) -> BoostedState:
    """The `BoostedState` of a model or optimizer boosted by a HybridParallelPlugin."""
    state = boosted_state(obj)
    if state is None or state.plan is None:
        what = "optimizer" if not isinstance(obj, nn.Module) else "model"
        raise ValueError(f"this {what} was not boosted by a HybridParallelPlugin")
    return state


class HybridBoosting:
    """`configure_model` and `configure_optimizer` of HybridParallelPlugin (plugin.py), whose
    options and process groups they read."""

    def configure_model(self, model: nn.Module) -> ModelWrapper:
        from phalanx import lazy
        from phalanx.booster.lora import is_lora_model

        if is_lora_model(model) and max(self.tp_size, self.pp_size, self.sp_size) > 1:
            raise NotImplementedError(
                f"LoRA under HybridParallelPlugin runs with data parallelism and ZeRO only (tp_size=1, pp_size=1, "
                f"sp_size=1), got tp_size={self.tp_size}, pp_size={self.pp_size}, sp_size={self.sp_size}: the shard "
                "policies do not split adapter layers yet. Use HybridParallelPlugin(zero_stage=1 or 2), ZeroPlugin "
                "or FSDPPlugin for LoRA")
        policy = self.policy or policy_for(model)
        heads = policy.heads(model.config)
        check_heads(heads, self.tp_size)
        local = local_head_counts(heads, self.tp_size)
        check_sequence_layout(self.sequence_parallelism, sp=self.sp_size, tp=self.tp_size,
                              local_heads=local.heads, heads=heads.heads)
        layout = None
        if self.pp_size > 1:  # checked before anything is touched
            layout = split_layers(len(policy.decoder_layers(model)), self.pp_schedule, self.pp_size,
                                  self.virtual_stages, self.layers_per_stage)
        names_before = {id(p): n for n, p in model.named_parameters()}
        source = lazy.source_for(model, device=self.device)
        mode = self.sequence_parallelism
        plan = apply_tp(model, policy, group=self.tp_group, sequence_parallel=mode == "split_gather", source=source)
        lazy.materialise_buffers(model, source)
        if layout is not None:
            return self._configure_pipeline(model, policy, plan, layout, names_before)
        seq = None
        if mode is not None:
            seq = apply_sp(model, policy, mode=mode, group=self.tp_group if mode == "split_gather" else self.sp_group)
        self._checkpoint_and_cast(model)
        if hasattr(type(model), "loss_function"):
            head = model.get_submodule(policy.head) if self.tp_size > 1 else None
            seq_group = self.sp_group if mode in ("ulysses", "ring") else None
            model.loss_function = CausalLMLoss(head, self.tp_group, seq_group)
        self._sync_replicas(model, plan)
        wrapper = ModelWrapper(HybridModel(model, plan, seq, self.tp_group), model)
        self._record(model, wrapper, plan=plan, param_names=names_before)
        log.info("%s: %s", self.describe(), policy.family)
        return wrapper

    def _checkpoint_and_cast(self, model: nn.Module) -> None:
        if self.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        model.to(self.device)
        if self.precision.mixed:
            model.to(self.precision.compute_dtype)

    def _configure_pipeline(self, model: nn.Module, policy, plan: TPPlan, layout, names_before) -> ModelWrapper:
        """pp > 1: cut the tensor-parallel model into this rank's stages (trimming the rest),
        split-gather per stage, cast, make replicas and tied copies identical, build the schedule."""
        aliases = tie_aliases(model)
        stages = split_model(model, policy, layout, self.pp_rank)
        if self.sequence_parallelism == "split_gather":
            for stage in stages:
                apply_split_gather(stage.layers, self.tp_group)
        self._checkpoint_and_cast(model)
        self._sync_replicas(model, plan)
        tied = tied_across_stages(model, aliases, stages)
        with torch.no_grad(), collective("pp.broadcast_tied"):
            for p in tied.values():  # the first stage's copy wins
                dist.broadcast(p.data, src=dist.get_global_rank(self.tie_group, 0), group=self.tie_group)
        last = next((s for s in stages if s.is_last), None)
        head = last.head if last is not None and isinstance(last.head, VocabParallelLMHead) else None
        runner = PipelineRunner(stages, layout, pp_group=self.pp_group, microbatches=self.num_microbatches,
                                device=self.device, lm_loss=CausalLMLoss(head, self.tp_group))
        wrapper = ModelWrapper(PipelineModel(stages), model)
        self._record(model, wrapper, plan=plan, param_names=names_before, pipeline=runner, tied=tied,
                     tied_aliases=aliases)
        log.info("%s: %s, stages %s on this rank (layers %s)", self.describe(), policy.family,
                 [s.index for s in stages], [s.layer_ids for s in stages])
        return wrapper

    def _record(self, model: nn.Module, wrapper: ModelWrapper, **fields: Any) -> None:
        """The boosted model's state, on the user's model too: evaluation code
        (`phalanx.train.eval_loss_sum`, `data_replica`, `causal_lm_eval`) is given the user's model,
        which holds only this rank's pieces (with pp, only its stages). The state tells it which
        data replica this rank is (tensor, sequence and pipeline peers must see the same batches),
        the boosted model to call (it cuts batches into sequence shards and computes the
        vocabulary-parallel loss from labels) and, with pp, the pipeline runner."""
        self.boosted(wrapper, **fields)
        boosted_state(wrapper).attach(model)

    def _sync_replicas(self, model: nn.Module, plan: TPPlan) -> None:
        """Start every replica from the same values: replicated pieces from the first tp rank, all
        pieces from the first rank of the data × sequence group."""
        seen: set[int] = set()
        named = list(model.named_parameters()) + list(model.named_buffers())
        with torch.no_grad(), collective("hybrid.broadcast_model"):
            for name, t in named:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                for group, only_replicated in ((self.tp_group, True), (self.dp_sp_group, False)):
                    if dist.get_world_size(group) == 1 or (only_replicated and plan.spec(name).is_sharded):
                        continue
                    dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)

    # ------------------------------------------------------------------ optimizer
    def configure_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module):
        hf = unwrap_model(model)
        state = hybrid_state(model)
        plan = state.plan
        tied: set[int] = set()
        if self.pp_size > 1:
            names = rebind_to_stages(optimizer, hf, state.param_names, state.tied_aliases)
            tied = {id(p) for p in state.tied.values()}
        else:
            names = rebind_optimizer_params(optimizer, hf, state.param_names)
        by_name = dict(hf.named_parameters())
        # each element counts once in the norm: 1 / its copies over tp (replicated) and over the two
        # pipeline stages holding a tied embedding
        weights = {id(p): (1.0 if plan.spec(n).is_sharded else 1.0 / plan.size) * (0.5 if id(p) in tied else 1.0)
                   for n, p in by_name.items()}
        partial = [p for n, p in by_name.items() if plan.spec(n).partial_grad]
        if self.zero_stage == 0:
            return HybridOptimizer(optimizer, names=names, precision=self.precision, max_norm=self.max_norm,
                                   dp_group=self.dp_sp_group, tp_group=self.tp_group,
                                   partial_ids={id(p) for p in partial}, weights=weights, device=self.device)
        config = ZeroConfig(stage=self.zero_stage, max_norm=self.max_norm, **self.zero_options)
        return HybridZeroOptimizer(optimizer, config, names=names, process_group=self.dp_sp_group,
                                   weights=weights, partial=PartialGradSync(partial, self.tp_group),
                                   precision=self.precision)
