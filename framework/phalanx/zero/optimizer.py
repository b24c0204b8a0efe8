"""The low-level ZeRO optimizer: any elementwise torch optimizer, run on this rank's flat shard.

    zopt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=2))
    zopt.backward(loss); zopt.step(); zopt.zero_grad()

What happens, per optimizer param group:
1. construction: the group's trainable parameters are flattened (model order, padded to a
   multiple of the world size) into one buffer in the model's dtype, the parameters become views
   of it, and this rank's contiguous slice is copied to an fp32 master shard, which replaces the
   group's params in the *user's* optimizer object. The optimizer's state is thus created for
   1/N of the parameters, and an LR scheduler built on that optimizer keeps working;
2. backward: `GradReducer` reduce-scatters gradients in buckets from backward hooks,
   overlapping communication with compute, into the fp32 gradient of each master shard;
3. step: wait for the reductions; compute the gradient norm over all shards (one all-reduce of
   per-rank partial norms), which also tells every rank whether any rank overflowed (fp16);
   skip the step and halve the loss scale on overflow; otherwise unscale, clip, run the torch
   optimizer on the shards (with torch's fused kernel where it has one: `fused_step`), and
   all-gather the updated shards into the model's parameters.

Parameters that do not require gradients stay out of the flat buffers and are never updated.
Ranks must start from identical weights (`ZeroPlugin` broadcasts rank 0's).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.amp.clip import clip_coefficient, global_grad_norm
from phalanx.amp.loss_scaler import DynamicLossScaler
from phalanx.amp.precision import Precision, precision_of_dtype, resolve_precision
from phalanx.launch import collective
from phalanx.zero import comm
from phalanx.zero.flat_group import FlatParamGroup
from phalanx.amp.fused_step import fused_step
from phalanx.zero.offload import HostStore
from phalanx.zero.prefetch import ParamPrefetch
from phalanx.zero.reducer import GradReducer
from phalanx.zero.supported import check_elementwise, drop_unstepped_state
from phalanx.amp.optimizer_wrapper import OptimizerWrapper


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How the ZeRO optimizer shards and communicates.

    stage: 1 shards optimizer states and master weights (a whole gradient buffer is kept); 2
        also shards gradients (each rank keeps its fp32 slice only). Both reduce-scatter.
    reduce_bucket_mb: size of a gradient bucket, in MB of the model dtype. Larger buckets mean
        fewer, more efficient collectives; smaller ones start communicating earlier in backward.
    overlap_communication: reduce buckets from backward hooks while backward runs; False
        reduces everything after backward (simpler to profile, no overlap).
    cpu_offload: keep the fp32 master shard, its gradient and the optimizer state in host
        memory and run the optimizer step there (`phalanx.zero.offload`; the optimizer's
        `offload.traffic` counts the bytes moved each way).
    max_norm: clip the global gradient norm to this value (None: no clipping).
    overlap_param_gather: `step` only starts publishing the updated parameters; each module's
        forward waits for its own (`phalanx.zero.prefetch`). Needs the model
        (`ZeroOptimizer(..., model=)`, which ZeroPlugin passes); parameters read between `step`
        and the next forward need `optimizer.wait_for_params()` first.
    grad_collective: how buckets are reduced. "reduce_scatter" moves half the bytes of
        "all_reduce"; "all_to_all" moves the same bytes as the reduce-scatter and each rank adds
        the copies of its part; "auto" picks all_to_all on gloo, where torch's reduce-scatter
        costs twice its all-reduce (docs/zero.md; a bucket whose receive buffer would exceed
        twice the bucket is all-reduced), and reduce_scatter elsewhere.
    fp8_communication: None (off), "e4m3" or "e5m2": each rank's copy of each bucket part
        travels as fp8 with its own scale and is summed in fp32 by its owner
        (`phalanx.amp.fp8_comm`; the reducer's `fp8_traffic` counts the bytes).
    """

    stage: int = 2
    reduce_bucket_mb: float = 25.0
    overlap_communication: bool = True
    cpu_offload: bool = False
    max_norm: float | None = None
    overlap_param_gather: bool = False
    grad_collective: str = "auto"
    fp8_communication: str | None = None

    def __post_init__(self):
        if self.stage not in (1, 2):
            raise ValueError(f"ZeRO stage={self.stage} is not supported here: use 1 (shard optimizer states) or "
                             "2 (also shard gradients); stage 3 shards parameters: use FSDPPlugin or GeminiPlugin")
        from phalanx.zero.reducer import GRAD_COLLECTIVES
        if self.grad_collective not in GRAD_COLLECTIVES:
            raise ValueError(f"grad_collective={self.grad_collective!r}: use one of {', '.join(GRAD_COLLECTIVES)}")
        if not self.reduce_bucket_mb > 0:
            raise ValueError(f"reduce_bucket_mb={self.reduce_bucket_mb} must be positive")


class ZeroOptimizer(OptimizerWrapper):
    """Wraps a torch optimizer (kept as `.optim`); same surface as the DDP plugin's optimizer:
    backward, step, zero_grad, param_groups, state, scaler, last_grad_norm, skipped,
    clip_grad_norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: ZeroConfig | None = None, *,
                 names: dict[int, str] | None = None, process_group: dist.ProcessGroup | None = None,
                 model: nn.Module | None = None, precision: str | Precision | None = None):
        check_elementwise(optimizer)
        drop_unstepped_state(optimizer)
        self.optim = optimizer
        self.config = config or ZeroConfig()
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.max_norm = self.config.max_norm
        self.last_grad_norm: float | None = None
        self.skipped = False
        # Seconds spent in each phase of the last `step` (what a profile of the step needs):
        # reduce (waiting for gradient reductions still in flight), norm (gradient norm, unscale,
        # clip), optimizer (the torch optimizer on the shards), gather (the parameter all-gather).
        self.step_phases: dict[str, float] = {}

        self.names: dict[int, str] = {}
        self.offload = HostStore() if self.config.cpu_offload else None
        self.flat_groups: list[FlatParamGroup | None] = []
        order = self._flatten_groups(names or {})
        groups = [g for g in self.flat_groups if g is not None]
        if len({g.dtype for g in groups}) > 1:
            raise ValueError("the ZeRO optimizer needs all trainable parameters in one dtype; got "
                             f"{sorted({str(g.dtype) for g in groups})}: cast the model first (ZeroPlugin does)")
        dtype = groups[0].dtype if groups else torch.float32
        self.device = groups[0].device if groups else torch.device("cpu")
        bucket_numel = max(1, int(self.config.reduce_bucket_mb * 2**20) // (torch.finfo(dtype).bits // 8))
        self.reducer = GradReducer(groups, stage=self.config.stage, bucket_numel=bucket_numel,
                                   overlap=self.config.overlap_communication, process_group=process_group,
                                   rank=self.rank, world_size=self.world_size, model_order=order,
                                   collective=self.config.grad_collective, fp8=self.config.fp8_communication)
        # fp16 needs loss scaling; bf16 and fp32 have fp32's exponent range. Standalone (no
        # precision given) the parameters' dtype says which precision the model was cast to.
        self.precision = resolve_precision(precision) if precision is not None else precision_of_dtype(dtype)
        self.scaler = DynamicLossScaler.for_precision(self.precision)
        self.prefetch: ParamPrefetch | None = None
        if self.config.overlap_param_gather:
            if model is None:
                raise ValueError("ZeroConfig(overlap_param_gather=True) needs the model, whose forward waits for "
                                 "its parameters: pass ZeroOptimizer(..., model=model) (ZeroPlugin does)")
            chunks = [(b.group, b.lo, b.hi) for b in reversed(self.reducer.buckets)]  # forward order
            self.prefetch = ParamPrefetch(chunks, model)

    def _flatten_groups(self, names: dict[int, str]) -> dict[int, int]:
        """Replace each param group's trainable params by a flat master shard; returns every
        parameter's position in model order (the insertion order of `names`, which the plugin
        builds from `named_parameters()`), used to order the gradient buckets."""
        order = {pid: i for i, pid in enumerate(names)}
        for gi, group in enumerate(self.optim.param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            for i, p in enumerate(params):
                self.names[id(p)] = names.get(id(p), f"group{gi}.param{i}")
                order.setdefault(id(p), len(order))
            if not params:
                group["params"] = []
                self.flat_groups.append(None)
                continue
            flat = FlatParamGroup(params, rank=self.rank, world_size=self.world_size,
                                  process_group=self.process_group, store=self.offload)
            group["params"] = [flat.master]
            self.flat_groups.append(flat)
        return order

    # ------------------------------------------------------------------ torch.optim-like surface
    def master_params(self) -> list[nn.Parameter]:
        """The fp32 master shards (one per non-empty param group), which the optimizer updates."""
        return [g.master for g in self.flat_groups if g is not None]

    def model_params(self) -> list[nn.Parameter]:
        return [p for g in self.flat_groups if g is not None for p in g.params]

    def master_slots(self) -> dict[int, tuple]:
        """id(model parameter) -> (its FlatParamGroup, its Slot): where its fp32 master lives
        (`FlatParamGroup.gather_master_slot` gathers it). Waits for a publication in flight."""
        self.wait_for_params()
        return {id(p): (g, slot) for g in self.flat_groups if g is not None for slot, p in zip(g.layout.slots, g.params)}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate locally."""
        with self.reducer.no_sync():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()
        if self.reducer.sync:
            self.reducer.flush()  # buckets whose parameters got no gradient start now

    def step(self, closure=None) -> None:
        """Reduce, check overflow, unscale, clip, update the shards, all-gather the parameters.
        The fp32 gradient shards are consumed: they exist from a step's first reduction to the
        end of `step` (so `model.zero_grad()` is enough between steps, and they cost no memory
        during forward)."""
        if closure is not None:
            raise ValueError("the ZeRO optimizer does not take closures (they re-run the model on whole "
                             "parameters); call backward before step")
        clock = time.perf_counter
        t0 = clock()
        self.wait_for_params()  # the previous step's publication, if no forward consumed it
        self.reducer.finish()
        t1 = clock()
        grads = [g.master.grad for g in self.flat_groups if g is not None and g.master.grad is not None]
        norm = self._global_norm(grads)
        self.skipped = self.scaler.enabled and not math.isfinite(norm)
        if self.skipped:
            self.scaler.update(True)
            self.last_grad_norm = float("inf")
            t2 = t3 = clock()
        else:
            if self.scaler.enabled:
                inv = 1.0 / self.scaler.scale
                for g in grads:
                    g.mul_(inv)
                norm *= inv
            self.last_grad_norm = norm
            t2 = clock()
            with fused_step(self.optim, self._master_device, grads, clip_coefficient(self.max_norm, norm)):
                self.optim.step()
            if self.offload is not None:
                self.offload.adopt_state(self.optim.state)
            if self.scaler.enabled:
                self.scaler.update(False)
            t3 = clock()
            self._publish()
        for m in self.master_params():
            m.grad = None
        self.step_phases = {"reduce": t1 - t0, "norm": t2 - t1, "optimizer": t3 - t2, "gather": clock() - t3}

    @property
    def _master_device(self) -> torch.device:
        """Where the master shards and the optimizer state live (the host with CPU offload)."""
        return torch.device("cpu") if self.offload is not None else self.device

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.discard()
        for p in self.model_params():
            p.grad = None
        for m in self.master_params():
            m.grad = None

    def state_dict(self):
        raise NotImplementedError("a ZeRO optimizer's state is sharded over ranks: save it with "
                                  "booster.save_optimizer / booster.save_checkpoint")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("a ZeRO optimizer's state is sharded over ranks: load it with "
                                  "booster.load_optimizer / booster.load_checkpoint")

    # ------------------------------------------------------------------ internals
    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """The 2-norm of all ranks' gradient shards (of the scaled gradients under fp16).

        This rank's partial norm is taken where the shards live (the host with CPU offload), then
        one all-reduce on the communication device combines the partial norms (the norm of the
        per-rank norms is the global norm). An inf/nan on any rank makes the result non-finite on
        every rank, so all ranks agree on an fp16 overflow without a second collective."""
        local = global_grad_norm(grads, sharded=False)
        partial = torch.tensor([local], dtype=torch.float32, device=self.device)
        with collective("zero.grad_norm"):
            return global_grad_norm([partial], self.process_group, sharded=True)

    def wait_for_params(self) -> None:
        """Make the model's parameters current (with `overlap_param_gather`, `step` returns while
        they are still being written; without, they always are)."""
        if self.prefetch is not None:
            self.prefetch.wait_all()

    def _publish(self) -> None:
        """All-gather the updated master shards into the model's parameters (or, with
        `overlap_param_gather`, start publishing them chunk by chunk)."""
        if self.prefetch is not None:
            self.prefetch.launch()
            return
        started = [g.start_publish() for g in self.flat_groups if g is not None]
        for works, _shard in started:
            for work in works:
                comm.wait(work, "zero.publish_params")

    # ------------------------------------------------------------------ whole-model views
    def full_master_weights(self) -> dict[int, torch.Tensor]:
        """{id(model param): full fp32 master value on the CPU}. A collective: all ranks call it."""
        out: dict[int, torch.Tensor] = {}
        for g in self.flat_groups:
            if g is None:
                continue
            full = g.gather_full_master()
            for slot, p in zip(g.layout.slots, g.params):
                out[id(p)] = full[slot.offset:slot.end].view(p.shape).clone()
        return out

    def load_master_weights(self, values: dict[int, torch.Tensor]) -> None:
        """Set the master shards from full parameter values keyed by id(model param)."""
        for g in self.flat_groups:
            if g is not None:
                g.load_master({slot.index: values[id(p)] for slot, p in zip(g.layout.slots, g.params)
                               if id(p) in values})
