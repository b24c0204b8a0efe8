"""DDPPlugin: torch DistributedDataParallel, with bf16/fp16 through fp32 master weights."""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from phalanx.amp.fp8_comm import DDPHookState, Fp8Traffic, check_format, ddp_fp8_hook
from phalanx.amp.mixed_precision_optimizer import MixedPrecisionOptimizer
from phalanx.amp.precision import Precision
from phalanx.booster.plugins.base import Plugin, unwrap_model
from phalanx.booster.state import boosted_optimizer
from phalanx.booster.wrappers import ModelWrapper
from phalanx.checkpoint.optimizer import (FragmentReader, OptimizerFragments, fragments_from_full_state,
                                          load_full_state_into)
from phalanx.layout import Layout
from phalanx.param_binding import optimizer_param_names


# Buffers are not broadcast before each forward: torch 2.13 names the switch forward_sync_buffers
# (broadcast_buffers is deprecated there); the torch of some GPU images (2.11) knows only the old name.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False})


class DDPPlugin(Plugin):
    """Every rank holds the whole model; gradients are all-reduced in buckets during backward.

    precision="bf16"/"fp16": the model computes in low precision and the optimizer updates fp32
    master weights (the gradient all-reduce then runs in the low precision too).

    A lazy model (`phalanx.lazy`) is materialised whole on every rank (DDP replicates it by
    design), one tensor at a time, straight into the compute dtype.

    ranks_per_replica=k (`Plugin.setup`): consecutive groups of k ranks work on the same samples,
    as the ranks of a model-parallel group this plugin does not manage (the protein recipe's
    Dynamic Axial Parallelism: every rank of a DAP group holds a slice of one sample's
    activations; the video recipe's sequence-parallel groups). The data is split over world/k
    replicas, each group's ranks draw the same random numbers (`seed_rank`), and gradients are
    still averaged over every rank: the mean over a group is that replica's gradient (each
    rank's backward gives its share of it), so the mean over the world is the data-parallel mean
    over replicas. The optimizer state is written by global rank 0 alone.

    fp8_communication="e4m3" / "e5m2" (True: e4m3): gradient buckets travel as fp8 with one scale
    per rank's part (`phalanx.amp.fp8_comm`: a quarter of fp32's bytes, sums in fp32);
    `fp8_traffic` counts the bytes."""

    name = "ddp"
    full_state_on_every_rank = True

    def __init__(self, precision: str | Precision = "fp32", max_norm: float | None = None, bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, static_graph: bool = False, ranks_per_replica: int = 1,
                 fp8_communication: str | bool = False):
        super().__init__(precision, max_norm, ranks_per_replica)  # the replica split: Plugin.setup
        self.fp8_communication = check_format(fp8_communication, "DDPPlugin")
        self.fp8_traffic = Fp8Traffic()  # bytes the fp8 hook sent (and would have sent uncompressed)
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph

    def configure_model(self, model: nn.Module) -> ModelWrapper:
        from phalanx import lazy

        source = lazy.source_for(model, device=self.device, group=self.dp_group)
        if source is not None:
            lazy.materialise_whole(model, source, self.device, self.precision.low_dtype)
        model = model.to(self.device)
        if self.precision.mixed:
            model = model.to(self.precision.compute_dtype)
        device_ids = [self.device.index] if self.device.type == "cuda" else None  # the emulated GPU: None, as a custom device
        ddp = DDP(model, device_ids=device_ids, process_group=self.dp_group, bucket_cap_mb=self.bucket_cap_mb,
                  find_unused_parameters=self.find_unused_parameters, gradient_as_bucket_view=True,
                  static_graph=self.static_graph, **_NO_BUFFER_SYNC)
        if self.fp8_communication:
            ddp.register_comm_hook(DDPHookState(self.dp_group, self.fp8_communication, self.fp8_traffic), ddp_fp8_hook)
        return self.boosted(ModelWrapper(ddp, model))

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> MixedPrecisionOptimizer:
        names = optimizer_param_names(optimizer, unwrap_model(model))
        return MixedPrecisionOptimizer(optimizer, precision=self.precision, max_norm=self.max_norm, names=names)

    def plan_layout(self, world: int) -> tuple[Layout, dict]:
        return Layout("ddp", world), {"dtype": self.precision}

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, optimizer) -> Iterator[None]:
        ddp = model.module if isinstance(model, ModelWrapper) else model
        with ddp.no_sync():
            yield

    # ---- checkpoint hooks ----
    def iter_full_model_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank holds the model: no communication; parameters from the fp32 masters if any."""
        unwrapped = unwrap_model(model)
        optimizer = boosted_optimizer(model)
        masters = optimizer.master_of if optimizer is not None and optimizer.master_of else {}
        param_ids = {n: id(p) for n, p in unwrapped.named_parameters()}
        for name, value in unwrapped.state_dict().items():
            master = masters.get(param_ids.get(name, -1))
            yield name, (master.detach().cpu().clone() if master is not None else value.detach().cpu())

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dict(self.iter_full_model_state(model))

    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        unwrapped = unwrap_model(model)
        unwrapped.load_state_dict(state_dict, strict=False)
        optimizer = boosted_optimizer(model)
        if optimizer is not None:
            optimizer.load_masters(unwrapped.named_parameters(), state_dict)

    def optimizer_fragments(self, optimizer: MixedPrecisionOptimizer) -> OptimizerFragments:
        # Every rank holds the same state: one rank writes it. Not `dp_rank == 0`, which with
        # ranks_per_replica = k is every rank of the first replica (the reader refuses k copies).
        if self.shard_rank != 0:
            frags = OptimizerFragments()
        else:
            frags = fragments_from_full_state(optimizer.optim, optimizer.names)
        return frags

    def load_optimizer_fragments(self, optimizer: MixedPrecisionOptimizer, reader: FragmentReader) -> None:
        load_full_state_into(optimizer.optim, optimizer.names, reader)
