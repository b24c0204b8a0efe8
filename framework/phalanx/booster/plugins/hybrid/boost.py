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
   the first stage's copy of each tied embedding to the last stage);
8. with ep_size > 1, `apply_expert_parallel` (phalanx.shard.expert_parallel): each rank keeps its
   EP group's share of the routed experts (after 7, so every rank starts from the same experts),
   and under LoRA the expert adapters' rows of those experts (docs/lora.md).

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
from phalanx.shard.lora_tp import peft_root_prefix
from phalanx.shard.policy import rooted_policy
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
        # a PEFT (LoRA) model keeps the Hugging Face model the policy describes one level down
        policy = rooted_policy(self.policy or policy_for(model), peft_root_prefix(model))
        heads = policy.heads(model.config)
        check_heads(heads, self.tp_size)
        local = local_head_counts(heads, self.tp_size)
        check_sequence_layout(self.sequence_parallelism, sp=self.sp_size, tp=self.tp_size,
                              local_heads=local.heads, heads=heads.heads)
        if self.sequence_parallelism == "split_gather" and self.pp_size == 1:  # (pp: _pipeline_router_losses)
            self._refuse_router_losses_under_split_gather(model)
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
        hf = model.get_base_model() if peft_root_prefix(model) else model  # the model that computes the loss
        if hasattr(type(hf), "loss_function"):
            head = model.get_submodule(policy.head) if self.tp_size > 1 else None
            seq_group = self.sp_group if mode in ("ulysses", "ring") else None
            hf.loss_function = CausalLMLoss(head, self.tp_group, seq_group)
        self._sync_replicas(model, plan)
        self._apply_ep(model)
        wrapper = ModelWrapper(HybridModel(model, plan, seq, self.tp_group, ep=self.ep_plan,
                                           z_loss=self.router_z_loss, dp_group=self.dp_group,
                                           batch_group=self.dp_sp_group,
                                           sequence_group=self.sp_group if self.sp_size > 1 else None), model)
        self._record(model, wrapper, plan=plan, param_names=names_before)
        log.info("%s: %s", self.describe(), policy.family)
        return wrapper

    def _refuse_router_losses_under_split_gather(self, model: nn.Module) -> None:
        """Split-gather runs an expert block on this tensor-parallel rank's tokens (EP is refused with
        it): the router losses of the global batch would have to count over dp × tp, which the plugin
        does not do."""
        from phalanx.models.deepseek import balance_settings
        config = getattr(model, "config", None)
        switch = bool(getattr(config, "output_router_logits", False)) and balance_settings(config) is None
        if switch or self.router_z_loss:
            raise ValueError("the router losses (config.output_router_logits, router_z_loss) are not combined with "
                             "split-gather sequence parallelism (each tensor-parallel rank routes its own tokens): use "
                             "sequence_parallelism='ulysses' or 'ring' with sp_size > 1, or set "
                             "config.output_router_logits=False and router_z_loss=0")

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
        router_losses = self._pipeline_router_losses(model)  # (every router is still here: before the cut)
        stages = split_model(model, policy, layout, self.pp_rank)
        if self.sequence_parallelism == "split_gather":
            for stage in stages:
                apply_split_gather(stage.layers, self.tp_group)
        self._checkpoint_and_cast(model)
        self._sync_replicas(model, plan)
        self._apply_ep(model)
        tied = tied_across_stages(model, aliases, stages)
        with torch.no_grad(), collective("pp.broadcast_tied"):
            for p in tied.values():  # the first stage's copy wins
                dist.broadcast(p.data, src=dist.get_global_rank(self.tie_group, 0), group=self.tie_group)
        last = next((s for s in stages if s.is_last), None)
        head = last.head if last is not None and isinstance(last.head, VocabParallelLMHead) else None
        runner = PipelineRunner(stages, layout, pp_group=self.pp_group, microbatches=self.num_microbatches,
                                device=self.device, lm_loss=CausalLMLoss(head, self.tp_group),
                                router_losses=router_losses)
        wrapper = ModelWrapper(PipelineModel(stages), model)
        self._record(model, wrapper, plan=plan, param_names=names_before, pipeline=runner, tied=tied,
                     tied_aliases=aliases)
        log.info("%s: %s, stages %s on this rank (layers %s)", self.describe(), policy.family,
                 [s.index for s in stages], [s.layer_ids for s in stages])
        return wrapper

    def _pipeline_router_losses(self, model: nn.Module):
        """pp > 1: the load-balancing loss (config.output_router_logits: Mixtral / Qwen-MoE's Switch loss
        times router_aux_loss_coef, or DeepSeek's balance loss times aux_loss_alpha) and the z-loss
        (router_z_loss) as totals carried through the stages (`phalanx.pipeline.router_losses`), over
        the data-parallel group's batch; None when neither is asked for."""
        from phalanx.models.deepseek import BalanceLoss, balance_settings
        from phalanx.pipeline.router_losses import RouterLossCarry, expert_routers
        config = getattr(model, "config", None)
        deepseek = balance_settings(config)  # raises when aux_loss_alpha is missing
        aux = bool(getattr(config, "output_router_logits", False)) and deepseek is None
        if not aux and not self.router_z_loss and deepseek is None:
            return None
        if aux and not hasattr(config, "router_aux_loss_coef"):
            raise ValueError(f"config.output_router_logits=True on a {config.model_type} model, whose config has no "
                             "router_aux_loss_coef: the plugin's load-balancing loss is the softmax (Switch) loss of "
                             "Mixtral / Qwen-MoE, which this family does not train with. Set "
                             "config.output_router_logits=False")
        if self.sequence_parallelism is not None:
            raise ValueError(f"the router losses (config.output_router_logits, router_z_loss) under pipeline parallelism "
                             f"are not combined with sequence_parallelism={self.sequence_parallelism!r}: set "
                             f"sequence_parallelism=None, or config.output_router_logits=False and router_z_loss=0")
        routers = expert_routers(model)
        if not routers:
            raise ValueError(f"the router losses (config.output_router_logits, router_z_loss) need expert blocks with a "
                             f"router (mlp.gate); {type(model).__name__} has none: set config.output_router_logits=False "
                             f"and router_z_loss=0")
        if deepseek is not None:  # the form of the loss only: the carry records the routers itself
            deepseek = BalanceLoss({}, sigmoid=config.model_type == "deepseek_v3", alpha=deepseek[0],
                                   per_sequence=deepseek[1])
        return RouterLossCarry(routers[0].num_experts, routers[0].top_k,
                               aux_coef=float(config.router_aux_loss_coef) if aux else 0.0,
                               z_coef=float(self.router_z_loss), batch_group=self.dp_sp_group, deepseek=deepseek,
                               num_layers=config.num_hidden_layers)

    def _apply_ep(self, model: nn.Module) -> None:
        """ep_size > 1: split the experts over the EP groups (`self.ep_plan`); the load-balancing
        loss, z-loss and token counts are taken over the data × sequence-parallel group (the global
        batch; under Ulysses/ring each rank routes its own shard of the sequence).
        DeepSeek with config.output_router_logits: its own balance loss (HybridModel adds
        `phalanx.models.deepseek.BalanceLoss`, with or without EP) is checked here. Under pp, a
        stage holding only dense layers (DeepSeek's first_k_dense_replace) keeps no expert plan."""
        from phalanx.models.deepseek import balance_settings
        deepseek_balance = balance_settings(getattr(model, "config", None))  # raises when aux_loss_alpha is missing
        if deepseek_balance is not None and (self.sequence_parallelism is not None or self.sp_size > 1):
            raise ValueError(f"DeepSeek's balance loss (config.output_router_logits=True) needs every router to see "
                             f"whole sequences: set sequence_parallelism=None (now {self.sequence_parallelism!r}, "
                             f"sp_size={self.sp_size}) or config.output_router_logits=False")
        if self.ep_size == 1:
            return
        from phalanx.shard.expert_parallel import apply_expert_parallel
        if deepseek_balance is None and getattr(model.config, "output_router_logits", False) and \
                not hasattr(model.config, "router_aux_loss_coef"):
            raise ValueError(f"config.output_router_logits=True on a {model.config.model_type} model, whose config has no "
                             "router_aux_loss_coef: the plugin's load-balancing loss is the softmax (Switch) loss of "
                             "Mixtral / Qwen-MoE, which this family does not train with. Set "
                             "config.output_router_logits=False")
        if self.pp_size > 1 and not any(isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
                                        and m.gate_up_proj.dim() == 3 for m in model.modules()):
            # this rank's stages hold dense layers only: its weights are all dense (averaged over dp)
            log.info("expert parallelism: no expert block on pipeline rank %d's stages", self.pp_rank)
            return
        self.ep_plan = apply_expert_parallel(model, self.ep_size, self.expert_groups)
        # the global batch: every token once over dp x sp (Ulysses/ring ranks hold sequence shards);
        # the router losses' values are summed over the shards of a sequence, as the cross-entropy's
        self.ep_plan.batch_group = self.dp_sp_group
        self.ep_plan.sequence_group = self.sp_group if self.sp_size > 1 else None
        log.info("expert parallelism: %d experts per block on this rank, ep=%d",
                 next(iter(self.ep_plan.experts.values())).local, self.ep_size)

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
        if self.ep_plan is not None:
            return self._expert_optimizer(optimizer, hf, names, weights, partial)
        if self.zero_stage == 0:
            return HybridOptimizer(optimizer, names=names, precision=self.precision, max_norm=self.max_norm,
                                   dp_group=self.dp_sp_group, tp_group=self.tp_group,
                                   partial_ids={id(p) for p in partial}, weights=weights, device=self.device)
        config = ZeroConfig(stage=self.zero_stage, max_norm=self.max_norm, **self.zero_options)
        return HybridZeroOptimizer(optimizer, config, names=names, process_group=self.dp_sp_group,
                                   weights=weights, partial=PartialGradSync(partial, self.tp_group),
                                   precision=self.precision)

    def _expert_optimizer(self, optimizer, hf: nn.Module, names, weights, partial):
        """ep_size > 1: dense gradients over dp × sp, expert gradients over their own replicas
        (`phalanx.shard.expert_optim`)."""
        from phalanx.shard.expert_optim import ExpertHybridOptimizer, ExpertZeroOptimizer, scale_expert_grads

        experts = [p for n, p in hf.named_parameters() if n in self.ep_plan.expert_param_names()]
        expert_ids = {id(p) for p in experts}
        scale_expert_grads(experts, self.ep_size)
        edp = self.expert_groups.dp_group
        if self.zero_stage == 0:
            # the norm divides every weight by dp (the dense copies); an expert has dp / ep copies
            weights = {k: w * self.ep_size if k in expert_ids else w for k, w in weights.items()}
            return ExpertHybridOptimizer(optimizer, expert_ids=expert_ids, expert_dp_group=edp, names=names,
                                         precision=self.precision, max_norm=self.max_norm, dp_group=self.dp_sp_group,
                                         tp_group=self.tp_group, partial_ids={id(p) for p in partial},
                                         weights=weights, device=self.device)
        config = ZeroConfig(stage=self.zero_stage, max_norm=self.max_norm, **self.zero_options)
        return ExpertZeroOptimizer(optimizer, config, expert_ids=expert_ids, expert_dp_group=edp, names=names,
                                   weights=weights, partial=PartialGradSync(partial, self.tp_group),
                                   tp_group=self.tp_group, process_group=self.dp_sp_group, precision=self.precision)
