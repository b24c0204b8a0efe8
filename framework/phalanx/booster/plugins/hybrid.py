"""HybridParallelPlugin: data × sequence × tensor parallelism for Hugging Face models, with ZeRO.

    plugin = HybridParallelPlugin(tp_size=2, sp_size=1, zero_stage=1, precision="bf16")
    model, optimizer, *_ = Booster(plugin).boost(model, optimizer)

`configure_model` applies, in this order (each step one function, see docs/hybrid.md):
1. check the layout against the model (heads, key/value heads, sequence mode) — before any work;
2. `apply_tp` (phalanx.shard): split attention heads, MLP and vocabulary over the tp group
   (materialising only this rank's pieces when the model was built lazily, phalanx.lazy);
3. `apply_sp` (phalanx.sequence): split-gather hooks, or Ulysses/ring attention functions;
4. activation checkpointing, if asked for;
5. move to the device and cast to the compute precision;
6. install the vocabulary-parallel, sequence-aware causal-LM loss as the model's loss function;
7. make replicas identical (broadcast replicated pieces over tp, everything over dp × sp).

The optimizer is ZeRO-1/2 (`phalanx.zero`) over the data × sequence group of each tensor-parallel
rank, or plain all-reduce data parallelism for zero_stage=0. Checkpoints are the full model in
Hugging Face layout and layout-independent optimizer fragments, loadable by every plugin.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.amp.precision import dtype_of
from phalanx.booster.plugins.base import Plugin, rebind_optimizer_params, unwrap_model
from phalanx.booster.wrappers import ModelWrapper
from phalanx.checkpoint.optimizer import (FragmentReader, OptimizerFragments, fragments_from_full_state,
                                          load_full_state_into)
from phalanx.launch import collective
from phalanx.mesh import LayoutError, ParallelConfig, build_mesh
from phalanx.pipeline import (PipelineModel, PipelineRunner, batch_tensors, check_microbatches, split_layers,
                              split_model, tie_aliases, virtual_stages_for)
from phalanx.pipeline.params import rebind_to_stages, tied_across_stages, with_tied_aliases
from phalanx.sequence import apply_sp, check_sequence_layout, gather_sequence, shard_inputs
from phalanx.sequence.split_gather import apply_split_gather
from phalanx.shard import CausalLMLoss, apply_tp, check_heads, policy_for
from phalanx.shard.grads import PartialGradSync, flat_all_reduce
from phalanx.shard.layers import VocabParallelLMHead
from phalanx.shard.optim import HybridOptimizer, HybridZeroOptimizer
from phalanx.shard.state import LocalFragmentReader, full_state_dict, local_state_dict, to_full_fragments
from phalanx.shard.tensor_parallel import TPPlan, local_head_counts
from phalanx.zero.checkpoint import load_zero_fragments, zero_fragments
from phalanx.zero.optimizer import ZeroConfig

log = logging.getLogger(__name__)


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
        with _local_logits(head, not wants_logits), _sharded(self.seq, seq_len is not None):
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


@contextlib.contextmanager
def _local_logits(head, local: bool) -> Iterator[None]:
    """With labels, keep the logits vocabulary-parallel (the loss needs no gather)."""
    if head is None or not local:
        yield
        return
    head.local_output = True
    try:
        yield
    finally:
        head.local_output = False


@contextlib.contextmanager
def _sharded(seq, active: bool) -> Iterator[None]:
    if seq is None or not active:
        yield
        return
    seq.inputs_sharded = True
    try:
        yield
    finally:
        seq.inputs_sharded = False


class HybridParallelPlugin(Plugin):
    """pp × dp × sp × tp with ZeRO-1/2.

    tp_size: tensor-parallel ranks (split heads, MLP, vocabulary). sp_size: sequence-parallel
    ranks for sequence_parallelism="ulysses" or "ring"; "split_gather" splits the sequence over the
    tp ranks instead (sp_size=1). The data-parallel size is what is left of the world size.
    zero_stage: 0 (all-reduce), 1 or 2 (ZeRO over data × sequence ranks). precision: fp32, bf16,
    fp16 (fp32 masters, loss scaling for fp16). max_norm: clip the norm over all shards.
    gradient_checkpointing: recompute each decoder layer in backward. policy: a
    `phalanx.shard.Policy` for a model family without a built-in one. reduce_bucket_mb,
    overlap_communication, cpu_offload: passed to the ZeRO optimizer (docs/zero.md).
    pp_size: pipeline ranks (docs/pipeline.md); the model is cut into stages by its policy and
    trained with `booster.execute_pipeline` under pp_schedule ("gpipe", "1f1b", "interleaved",
    "zero_bubble") with num_microbatches per batch; virtual_stages: stages per rank for
    "interleaved" (default 2); layers_per_stage: decoder layers of each stage (default: even).
    """

    name = "hybrid"
    # The sharded model's forward computes the causal-LM loss (vocabulary-parallel, sequence-aware)
    # from `labels`; phalanx.train uses it instead of its fused-head wrapper.
    model_computes_causal_lm_loss = True

    def __init__(self, tp_size: int = 1, sp_size: int = 1, pp_size: int = 1, zero_stage: int = 0,
                 precision: str = "fp32", sequence_parallelism: str | None = None, max_norm: float | None = None,
                 gradient_checkpointing: bool = False, policy=None, reduce_bucket_mb: float = 25.0,
                 overlap_communication: bool = True, cpu_offload: bool = False, num_microbatches: int = 1,
                 pp_schedule: str = "1f1b", virtual_stages: int | None = None,
                 layers_per_stage: list[int] | None = None):
        super().__init__(precision, max_norm)
        if zero_stage not in (0, 1, 2):
            raise LayoutError(f"zero_stage={zero_stage} must be 0, 1 or 2 (stage 3 shards parameters: FSDPPlugin)")
        self.parallel = ParallelConfig(dp=-1, tp=tp_size, pp=pp_size, sp=sp_size, zero_stage=zero_stage,
                                       microbatches=num_microbatches)
        self.parallel.validate()
        self.tp_size, self.sp_size, self.pp_size, self.zero_stage = tp_size, sp_size, pp_size, zero_stage
        self.pp_schedule, self.num_microbatches, self.layers_per_stage = pp_schedule, num_microbatches, layers_per_stage
        self.virtual_stages = 1
        if pp_size > 1:
            self.virtual_stages = virtual_stages_for(pp_schedule, virtual_stages)
            check_microbatches(pp_schedule, pp_size, num_microbatches)
            if sequence_parallelism in ("ulysses", "ring"):
                raise LayoutError(f"sequence_parallelism={sequence_parallelism!r} is not combined with pipeline "
                                  f"parallelism (pp_size={pp_size}); use 'split_gather' (on the tp ranks) or pp_size=1")
        self.sequence_parallelism = sequence_parallelism
        self.gradient_checkpointing = gradient_checkpointing
        self.policy = policy
        self.zero_options = dict(reduce_bucket_mb=reduce_bucket_mb, overlap_communication=overlap_communication,
                                 cpu_offload=cpu_offload)
        check_sequence_layout(sequence_parallelism, sp=sp_size, tp=tp_size)

    def describe(self) -> str:
        mode = f", sp_mode={self.sequence_parallelism}" if self.sequence_parallelism else ""
        pp = (f"pp={self.pp_size} ({self.pp_schedule}, {self.num_microbatches} microbatches), "
              if self.pp_size > 1 else "")
        return (f"hybrid(precision={self.precision}, {pp}dp={self.dp_size}, sp={self.sp_size}, tp={self.tp_size}, "
                f"zero={self.zero_stage}{mode})")

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        super().setup()
        self.parallel = self.parallel.resolve(dist.get_world_size())
        self.mesh = build_mesh(self.parallel, self.device.type)
        self.tp_group = self.mesh.get_group("tp")
        self.sp_group = self.mesh.get_group("sp")
        self.dp_group = self.mesh.get_group("dp")
        self.dp_size = self.parallel.dp
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.dp_sp_group = self._flat_group(("dp", "sp"))
        self.pp_group = self.mesh.get_group("pp")
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.sp_rank = self.mesh.get_local_rank("sp")
        # the first and last pipeline ranks of each (dp, sp, tp) coordinate: tied embeddings' group
        self.tie_group = self._flat_group(("pp",), ends_only=True) if self.pp_size > 1 else None

    def _flat_group(self, dims: tuple[str, ...], ends_only: bool = False):
        """One process group over the ranks that differ only in `dims` (every rank creates every
        such group, in the same order, as torch.distributed requires); `ends_only`: only the first
        and last of those ranks (None for the ranks in between)."""
        names = ("pp", "dp", "sp", "tp")
        grid = self.mesh.mesh
        keep = [i for i, d in enumerate(names) if d not in dims]
        flat = [i for i, d in enumerate(names) if d in dims]
        blocks = grid.permute(*keep, *flat).reshape(-1, math.prod(grid.shape[i] for i in flat))
        mine = None
        for ranks in blocks.tolist():
            ranks = [ranks[0], ranks[-1]] if ends_only else ranks
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    # ------------------------------------------------------------------ model
    def configure_model(self, model: nn.Module) -> ModelWrapper:
        from phalanx import lazy

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
        self._mark_for_evaluation(model, wrapper)
        object.__setattr__(wrapper, "phalanx_plan", plan)
        object.__setattr__(wrapper, "_names_before_sharding", names_before)
        log.info("%s: %s", self.describe(), policy.family)
        return wrapper

    def _checkpoint_and_cast(self, model: nn.Module) -> None:
        if self.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        model.to(self.device)
        if self.precision != "fp32":
            model.to(dtype_of(self.precision))

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
            for p in tied:  # the first stage's copy wins
                dist.broadcast(p.data, src=dist.get_global_rank(self.tie_group, 0), group=self.tie_group)
        last = next((s for s in stages if s.is_last), None)
        head = last.head if last is not None and isinstance(last.head, VocabParallelLMHead) else None
        runner = PipelineRunner(stages, layout, pp_group=self.pp_group, microbatches=self.num_microbatches,
                                device=self.device, lm_loss=CausalLMLoss(head, self.tp_group))
        wrapper = ModelWrapper(PipelineModel(stages), model)
        self._mark_for_evaluation(model, wrapper, runner)
        for key, value in (("phalanx_plan", plan), ("_names_before_sharding", names_before),
                           ("phalanx_pipeline", runner), ("_pp_aliases", aliases), ("_pp_tied", tied)):
            object.__setattr__(wrapper, key, value)
        log.info("%s: %s, stages %s on this rank (layers %s)", self.describe(), policy.family,
                 [s.index for s in stages], [s.layer_ids for s in stages])
        return wrapper

    def _mark_for_evaluation(self, model: nn.Module, wrapper: ModelWrapper, runner: PipelineRunner | None = None) -> None:
        """Tell evaluation code (`phalanx.train.eval_loss_sum`, `causal_lm_eval`) how to score the
        user's model: which data replica this rank is (tensor, sequence and pipeline peers must see
        the same batches), the boosted model to call (it cuts batches into sequence shards), whose
        forward computes the (vocabulary-parallel) loss from labels, and, with pp, the pipeline
        runner that holds the stages this rank's trimmed model lacks. (Plain attributes, not
        submodules: the boosted model holds the user's model.)"""
        object.__setattr__(model, "phalanx_data_replica", (self.dp_rank, self.dp_size))
        object.__setattr__(model, "phalanx_boosted", wrapper)
        if runner is not None:
            object.__setattr__(model, "phalanx_pipeline", runner)

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
        plan: TPPlan = model.phalanx_plan
        tied: set[int] = set()
        if self.pp_size > 1:
            names = rebind_to_stages(optimizer, hf, model._names_before_sharding, model._pp_aliases)
            tied = {id(p) for p in model._pp_tied}
        else:
            names = rebind_optimizer_params(optimizer, model, model._names_before_sharding)
        by_name = dict(hf.named_parameters())
        # each element counts once in the norm: 1 / its copies over tp (replicated) and over the two
        # pipeline stages holding a tied embedding
        weights = {id(p): (1.0 if plan.spec(n).is_sharded else 1.0 / plan.size) * (0.5 if id(p) in tied else 1.0)
                   for n, p in by_name.items()}
        partial = [p for n, p in by_name.items() if plan.spec(n).partial_grad]
        if self.zero_stage == 0:
            wrapped = HybridOptimizer(optimizer, names=names, precision=self.precision, max_norm=self.max_norm,
                                      dp_group=self.dp_sp_group, tp_group=self.tp_group,
                                      partial_ids={id(p) for p in partial}, weights=weights)
        else:
            config = ZeroConfig(stage=self.zero_stage, max_norm=self.max_norm, **self.zero_options)
            wrapped = HybridZeroOptimizer(optimizer, config, names=names, process_group=self.dp_sp_group,
                                          weights=weights, partial=PartialGradSync(partial, self.tp_group))
        wrapped.phalanx_plan = plan
        if tied and not any(s.is_first for s in model.phalanx_pipeline.stages):
            wrapped.phalanx_tied_second = {names[i] for i in tied}
        return wrapped

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None, optimizer) -> Iterator[None]:
        optimizer = optimizer or getattr(model, "phalanx_optimizer", None)
        if optimizer is None or not hasattr(optimizer, "no_sync"):
            yield  # stage 0 reduces at step: accumulation needs nothing
            return
        with optimizer.no_sync():
            yield

    def clip_grad_norm(self, optimizer, max_norm: float) -> float:
        return optimizer.clip_grad_norm(max_norm)

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion=None, optimizer=None, *,
                         return_outputs: bool = False, loss_weight: float = 1.0, forward_only: bool = False) -> dict:
        """One batch through the schedule (see `Booster.execute_pipeline`); `loss_weight` multiplies
        the gradients, not the returned loss (phalanx.train's token weighting). Microbatches accumulate
        locally; then the tied embedding copies and the tensor-parallel partial gradients are
        summed and ZeRO reduces once, as after one ordinary backward. `forward_only`: the loss
        (and logits) of the batch without a backward, for evaluation."""
        runner = getattr(model, "phalanx_pipeline", None)
        if runner is None:
            raise ValueError("execute_pipeline needs a model boosted with HybridParallelPlugin(pp_size>1); "
                             "with pp_size=1 call the model and booster.backward")
        input_ids, labels = batch_tensors(next(data_iter))
        if forward_only:
            return runner.evaluate(input_ids, labels, criterion=criterion, return_outputs=return_outputs)
        optimizer = optimizer or getattr(model, "phalanx_optimizer", None)
        scaler = getattr(optimizer, "scaler", None)
        scale = (scaler.scale if scaler is not None and scaler.enabled else 1.0) * loss_weight
        with self.no_sync(model, optimizer):
            out = runner.run(input_ids, labels, criterion=criterion, return_outputs=return_outputs, loss_scale=scale)
        self._finish_pipeline_grads(model, optimizer)
        return out

    def _finish_pipeline_grads(self, model: nn.Module, optimizer) -> None:
        def grads(params):
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return [p.grad for p in params]

        flat_all_reduce(grads(model._pp_tied), self.tie_group, name="pp.tied_grads")
        if isinstance(optimizer, HybridZeroOptimizer):  # stage 0 sums partial gradients at step
            flat_all_reduce(grads(optimizer.partial.params), self.tp_group, name="tp.partial_grad")
            optimizer.reducer.flush()

    # ------------------------------------------------------------------ checkpoint hooks
    def _masters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """fp32 master values of this rank's pieces, by parameter name (all aliases)."""
        optimizer = getattr(model, "phalanx_optimizer", None)
        hf = unwrap_model(model)
        if optimizer is None:
            return {}
        if isinstance(optimizer, HybridZeroOptimizer):
            by_id = optimizer.full_master_weights()
        else:
            by_id = {pid: m.detach() for pid, m in optimizer.master_of.items()}
        return {n: by_id[id(p)] for n, p in hf.named_parameters(remove_duplicate=False) if id(p) in by_id}

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = full_state_dict(unwrap_model(model), model.phalanx_plan, self._masters(model))
        if self.pp_size == 1:
            return state
        aliases = model._pp_aliases
        state = {aliases.get(n, n): t for n, t in state.items()}
        if self.dp_rank or self.sp_rank or self.tp_rank:
            return state
        parts = [None] * self.pp_size if self.pp_rank == 0 else None
        with collective("pp.gather_state"):
            dist.gather_object(state, parts, dst=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()} if parts else state

    def check_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        from phalanx.checkpoint.hf import check_state_dict_matches
        state_dict = with_tied_aliases(getattr(model, "_pp_aliases", None), state_dict)
        plan: TPPlan = model.phalanx_plan
        hf = unwrap_model(model)
        shapes = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
        shapes.update({n: p.full_shape for n, p in plan.params.items()})
        check_state_dict_matches(hf, state_dict, shapes=shapes)

    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        hf = unwrap_model(model)
        plan: TPPlan = model.phalanx_plan
        state_dict = with_tied_aliases(getattr(model, "_pp_aliases", None), state_dict)
        if self.pp_size > 1:  # this rank's stages only
            mine = hf.state_dict().keys()
            state_dict = {k: v for k, v in state_dict.items() if k in mine}
        local = local_state_dict(plan, state_dict)
        hf.load_state_dict(local, strict=False)
        optimizer = getattr(model, "phalanx_optimizer", None)
        if isinstance(optimizer, HybridZeroOptimizer):
            optimizer.load_master_weights({id(p): local[n] for n, p in hf.named_parameters(remove_duplicate=False)
                                           if n in local})
        elif optimizer is not None and optimizer.master_of:
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    master = optimizer.master_of.get(id(p))
                    if master is not None and n in local:
                        master.copy_(local[n].float())

    def optimizer_fragments(self, optimizer) -> OptimizerFragments:
        plan = self._plan_of(optimizer)
        if isinstance(optimizer, HybridZeroOptimizer):
            frags = to_full_fragments(zero_fragments(optimizer), plan)
        else:
            write = dist.get_rank(self.dp_sp_group) == 0
            local = fragments_from_full_state(optimizer.optim, optimizer.names) if write else OptimizerFragments()
            frags = to_full_fragments(local, plan, write=write)
        frags.extra["loss_scaler"] = optimizer.scaler.state_dict()
        tied = getattr(optimizer, "phalanx_tied_second", ())
        if tied:  # the last stage's copy of a tied embedding: the first stage writes its state
            frags.fragments = [f for f in frags.fragments if f.param not in tied]
        return frags

    def load_optimizer_fragments(self, optimizer, reader: FragmentReader) -> None:
        local = LocalFragmentReader(reader, self._plan_of(optimizer))
        if isinstance(optimizer, HybridZeroOptimizer):
            load_zero_fragments(optimizer, local)
        else:
            load_full_state_into(optimizer.optim, optimizer.names, local)
            if "loss_scaler" in reader.extra:
                optimizer.scaler.load_state_dict(reader.extra["loss_scaler"])

    def _plan_of(self, optimizer) -> TPPlan:
        plan = getattr(optimizer, "phalanx_plan", None)
        if plan is None:
            raise ValueError("this optimizer was not boosted by a HybridParallelPlugin")
        return plan
