"""ZeroPlugin: data parallelism with our own ZeRO-1/2 optimizer (`phalanx.zero`).

Every rank holds the whole model (in the compute precision) and runs it on its part of the
batch; the fp32 master weights and optimizer states are partitioned over the ranks (stage 1),
and so are the reduced gradients (stage 2). See docs/zero.md for the design and the options.

A lazy model (`phalanx.lazy`) is materialised whole on every rank (ZeRO-1/2 keep the full model
by design), one tensor at a time and straight into the compute dtype; loaded from a checkpoint in
bf16/fp16, each rank's fp32 master shard is then read from the file in fp32 (only its own range),
not widened from the rounded weights. Saving streams the masters one parameter at a time.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from phalanx.amp.fp8_comm import Fp8Traffic, check_format
from phalanx.amp.precision import Precision
from phalanx.booster.plugins.base import Plugin, unwrap_model
from phalanx.booster.state import boosted_optimizer
from phalanx.booster.wrappers import ModelWrapper
from phalanx.checkpoint.optimizer import FragmentReader, OptimizerFragments
from phalanx.layout import Layout
from phalanx.param_binding import optimizer_param_names
from phalanx.zero import comm
from phalanx.zero.checkpoint import load_zero_fragments, zero_fragments
from phalanx.zero.optimizer import ZeroConfig, ZeroOptimizer


class ZeroPlugin(Plugin):
    """ZeroPlugin(stage=2, precision="bf16", reduce_bucket_mb=25, overlap_communication=True,
    cpu_offload=False, max_norm=1.0, overlap_param_gather=False, grad_collective="auto",
    fp8_communication=False, ranks_per_replica=1) — fp8_communication="e4m3"/"e5m2" sends gradient
    buckets as fp8 (`phalanx.amp.fp8_comm`). ranks_per_replica=k (`Plugin.setup`): groups of k
    consecutive ranks share their samples (a sequence-parallel group); states and gradients are
    still partitioned over, and gradients averaged over, every rank."""

    full_state_on_every_rank = True

    def __init__(self, stage: int = 2, precision: str | Precision = "fp32", reduce_bucket_mb: float = 25.0,
                 overlap_communication: bool = True, cpu_offload: bool = False, max_norm: float | None = None,
                 overlap_param_gather: bool = False, grad_collective: str = "auto",
                 fp8_communication: str | bool = False, ranks_per_replica: int = 1):
        super().__init__(precision, max_norm, ranks_per_replica)
        self._lazy_source = None  # a lazy model's checkpoint, until the optimizer's masters are read
        self.config = ZeroConfig(stage=stage, reduce_bucket_mb=reduce_bucket_mb,
                                 overlap_communication=overlap_communication, cpu_offload=cpu_offload,
                                 max_norm=max_norm, overlap_param_gather=overlap_param_gather,
                                 grad_collective=grad_collective,
                                 fp8_communication=check_format(fp8_communication, "ZeroPlugin"))
        self.fp8_traffic = Fp8Traffic()

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"zero{self.config.stage}"

    def describe(self) -> str:
        c = self.config
        return (f"{self.name}(precision={self.precision.name}, {self.describe_data_parallel()}, "
                f"bucket={c.reduce_bucket_mb}MB, "
                f"overlap={c.overlap_communication}, cpu_offload={c.cpu_offload}, "
                f"overlap_param_gather={c.overlap_param_gather})")

    def plan_layout(self, world: int) -> tuple[Layout, dict]:
        c = self.config
        return (Layout("zero", world, zero_stage=c.stage, offload_optim=c.cpu_offload),
                {"dtype": self.precision, "bucket_mb": c.reduce_bucket_mb})

    # ------------------------------------------------------------------ set-up
    def configure_model(self, model: nn.Module) -> ModelWrapper:
        """Move to the device, cast to the compute precision, and make every rank start from rank
        0's weights and buffers (as DDP does at construction). A lazy model is materialised here."""
        from phalanx import lazy
        from phalanx.lazy.sources import CheckpointSource

        source = lazy.source_for(model, device=self.device, group=self.dp_group)
        if source is not None:
            lazy.materialise_whole(model, source, self.device, self.precision.low_dtype)
        self._lazy_source = source if isinstance(source, CheckpointSource) and self.precision.mixed else None
        model = model.to(self.device)
        if self.precision.mixed:
            model = model.to(self.precision.compute_dtype)
        # A lazy model is already the same on every rank (the same file, or the same agreed seed).
        # Over every rank of the process group (shard_size), not the data replicas (dp_size).
        if self.shard_size > 1 and source is None:
            with torch.no_grad():
                seen = set()
                for tensor in list(model.parameters()) + list(model.buffers()):
                    if id(tensor) not in seen:
                        seen.add(id(tensor))
                        comm.broadcast_from_first(tensor.data, self.dp_group, "zero.broadcast_model")
        return self.boosted(ModelWrapper(model, model))

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> ZeroOptimizer:
        names = optimizer_param_names(optimizer, unwrap_model(model))
        zero = ZeroOptimizer(optimizer, self.config, names=names, process_group=self.dp_group,
                             model=unwrap_model(model), precision=self.precision)
        self.fp8_traffic = zero.reducer.fp8_traffic  # bytes sent with fp8_communication (phalanx.amp.fp8_comm)
        if self._lazy_source is not None:
            _read_fp32_masters(zero, self._lazy_source)
            self._lazy_source = None
        return zero

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None, optimizer: ZeroOptimizer | None) -> Iterator[None]:
        optimizer = optimizer or boosted_optimizer(model)
        if optimizer is None:
            yield
            return
        with optimizer.no_sync():
            yield

    def clip_grad_norm(self, optimizer: ZeroOptimizer, max_norm: float) -> float:
        return optimizer.clip_grad_norm(max_norm)

    # ------------------------------------------------------------------ checkpoint hooks
    def iter_full_model_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffers as they are; parameters from the fp32 masters (full precision even when the
        model computes in bf16/fp16), gathered one parameter at a time (each owner broadcasts its
        part). Every rank gets every tensor."""
        unwrapped = unwrap_model(model)
        optimizer = boosted_optimizer(model)
        slots = optimizer.master_slots() if optimizer is not None else {}
        param_ids = {n: id(p) for n, p in unwrapped.named_parameters(remove_duplicate=False)}
        for name, value in unwrapped.state_dict().items():
            place = slots.get(param_ids.get(name, -1))
            if place is None:
                yield name, value.detach().cpu().clone()
            else:
                group, slot = place
                yield name, group.gather_master_slot(slot).view(value.shape)

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dict(self.iter_full_model_state(model))

    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        unwrapped = unwrap_model(model)
        optimizer = boosted_optimizer(model)
        if optimizer is not None:
            optimizer.wait_for_params()  # a publication still in flight would overwrite what loads
        unwrapped.load_state_dict(state_dict, strict=False)  # copies into the flat buffer views
        if optimizer is not None:
            values = {id(p): state_dict[n] for n, p in unwrapped.named_parameters(remove_duplicate=False)
                      if n in state_dict}
            optimizer.load_master_weights(values)

    def optimizer_fragments(self, optimizer: ZeroOptimizer) -> OptimizerFragments:
        return zero_fragments(optimizer)

    def load_optimizer_fragments(self, optimizer: ZeroOptimizer, reader: FragmentReader) -> None:
        load_zero_fragments(optimizer, reader)


def _read_fp32_masters(optimizer: ZeroOptimizer, source) -> None:
    """Set this rank's fp32 master shard from the checkpoint `source` in fp32 (only its range)."""
    from phalanx.lazy import flat_range

    with torch.no_grad():
        for g in optimizer.flat_groups:
            if g is None:
                continue
            for slot, a, b in g.layout.owned_slots(g.rank):
                p = g.params[slot.index]
                start = g.layout.to_shard(g.rank, slot.offset + a)
                g.master[start:start + (b - a)].copy_(flat_range(source, optimizer.names[id(p)], p, a, b, torch.float32))
