"""What every plugin provides to the Booster.

A plugin decides how the model, optimizer and data are spread over ranks. It implements:

- `configure_model`, `configure_optimizer`, `configure_dataloader`: wrap them for its parallel
  layout; `configure_model` records what the loop and the checkpoint hooks need to know about
  the boosted model in a `phalanx.booster.state.BoostedState` (`self.boosted(wrapper, ...)`);
- `backward`, `no_sync` (gradient accumulation), `clip_grad_norm`;
- the checkpoint hooks used by `phalanx.checkpoint`:
  * `full_model_state_dict(model)`: the full, unsharded weights keyed by the *unwrapped* model's
    parameter/buffer names, on CPU (a collective: every rank calls it; only rank 0's result
    must be complete);
  * `iter_full_model_state(model)`: the same, one `(name, full tensor)` at a time, so that a save
    holds one tensor (not the model) on each rank (a collective: every rank consumes all of it;
    only rank 0's values must be complete). The DDP, ZeRO, FSDP, Gemini and hybrid plugins stream (their
    `full_model_state_dict` is `dict(iter_full_model_state(model))`); the default walks
    `full_model_state_dict`;
  * `load_full_model_state_dict(model, state_dict)`: every rank passes the full state dict;
  * `optimizer_fragments(optimizer)`: this rank's pieces of optimizer state (see
    `phalanx.checkpoint.optimizer.Fragment`);
  * `load_optimizer_fragments(optimizer, reader)`: take the pieces this rank owns now;
- `plan_layout(world)`: its layout as `phalanx.plan` models it (`phalanx.layout.Layout`) and the
  workload settings it fixes, so the planner needs no list of plugin types.

`precision` is a name or a `phalanx.amp.precision.Precision`, resolved once in the constructor;
`self.precision` is always the typed value.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from phalanx.amp.precision import Precision, resolve_precision
from phalanx.booster.state import BoostedState
from phalanx.booster.wrappers import ModelWrapper
from phalanx.layout import Layout


class Plugin(ABC):
    name: str = "plugin"
    # True when the boosted model's forward computes the causal-LM loss from `labels` itself
    # (vocabulary-parallel, sequence-aware): phalanx.train then uses it, not its fused-head wrapper.
    model_computes_causal_lm_loss: bool = False
    # True when `iter_full_model_state` hands every rank every full tensor (not only rank 0): an
    # asynchronous checkpoint then keeps its copy of the model spread over the ranks (1/N each,
    # `phalanx.checkpoint.hf.spread_model_copy`) instead of whole on rank 0.
    full_state_on_every_rank: bool = False
    # True when the plugin's stream does not reach every rank but the plugin builds that spread
    # copy itself: `spread_model_copy(model) -> phalanx.checkpoint.hf.SpreadModelCopy`, a collective
    # that moves each tensor to the rank keeping it (HybridParallelPlugin: a pipeline stage's
    # tensors reach only that stage's ranks). With neither flag the copy is whole on rank 0.
    spreads_model_copy: bool = False

    def __init__(self, precision: str | Precision = "fp32", max_norm: float | None = None, ranks_per_replica: int = 1):
        self.precision: Precision = resolve_precision(precision)
        self.max_norm = max_norm
        if isinstance(ranks_per_replica, bool) or not isinstance(ranks_per_replica, int) or ranks_per_replica < 1:
            raise ValueError(f"{type(self).__name__}(ranks_per_replica={ranks_per_replica!r}): must be a whole "
                             "number >= 1 (the consecutive ranks that share one data-parallel replica's samples)")
        self.ranks_per_replica = ranks_per_replica
        self.dp_group: dist.ProcessGroup | None = None
        self.dp_rank = 0
        self.dp_size = 1
        self.shard_rank = 0
        self.shard_size = 1
        self.device = torch.device("cpu")

    # ---- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        """Called once by the Booster after `launch()`; builds process groups.

        `ranks_per_replica` = k: consecutive groups of k ranks work on the same samples, as the
        ranks of a model-parallel group the plugin does not manage (a sequence-parallel group, the
        protein recipe's DAP group). The process group and the rank / size the plugin shards by
        (`shard_rank`, `shard_size`) stay the whole world: every rank holds the same parameters,
        so what a plugin splits (ZeRO's states, FSDP2's parameters, Gemini's chunks) is split over
        every rank and gradients are averaged over every rank (the mean over a group is that
        replica's gradient). The data is dealt per replica: `dp_rank` = rank // k, `dp_size` =
        world // k, and `seed_rank` is the replica's."""
        from phalanx.launch import context
        ctx = context()
        self.device = ctx.device
        self.dp_group = dist.group.WORLD
        rank, world, k = dist.get_rank(), dist.get_world_size(), self.ranks_per_replica
        if world % k:
            raise ValueError(f"{type(self).__name__}(ranks_per_replica={k}) needs a world size that is a multiple of "
                             f"{k}, got {world} ranks: launch a multiple of {k} processes or change ranks_per_replica")
        self.shard_rank, self.shard_size = rank, world
        self.dp_rank, self.dp_size = rank // k, world // k

    @property
    def seed_rank(self) -> int:
        """The rank number `fit` seeds this process's per-rank random streams with (data
        augmentation, dropout): its global rank, unless ranks must draw alike (ranks_per_replica
        > 1: the replica's number, so the ranks of a group draw the same)."""
        if self.ranks_per_replica > 1:
            return self.dp_rank
        return dist.get_rank() if dist.is_initialized() else 0

    def describe_data_parallel(self) -> str:
        """`dp=N`, and with ranks_per_replica > 1 how the replicas sit in the world."""
        if self.ranks_per_replica == 1:
            return f"dp={self.dp_size}"
        return f"dp={self.dp_size} x ranks_per_replica={self.ranks_per_replica} (over all {self.shard_size} ranks)"

    @abstractmethod
    def configure_model(self, model: nn.Module) -> nn.Module:
        ...

    @abstractmethod
    def configure_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> Any:
        ...

    def boosted(self, wrapper: ModelWrapper, **fields: Any) -> ModelWrapper:
        """Attach this plugin's `BoostedState` (its `fields`: layout, pipeline runner, …) to the
        boosted model and return it; every `configure_model` ends with it."""
        state = BoostedState(plugin=self, module=wrapper, data_replica=(self.dp_rank, self.dp_size), **fields)
        state.attach(wrapper)
        return wrapper

    def configure_dataloader(self, dataloader: DataLoader, seed: int = 0) -> DataLoader:
        from phalanx.data.loader import distribute_dataloader
        return distribute_dataloader(dataloader, self.dp_size, self.dp_rank, seed=seed)

    # ---- training -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        check_forward_went_through(optimizer)
        optimizer.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, optimizer: Any) -> Iterator[None]:
        yield

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> float:
        raise NotImplementedError

    # ---- checkpoint hooks ---------------------------------------------------------------
    @abstractmethod
    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        ...

    def iter_full_model_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.full_model_state_dict(model).items()

    @abstractmethod
    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        ...

    def check_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise CheckpointError, before anything is overwritten, unless the full state dict fits the
        model. Plugins that split parameters in place (HybridParallelPlugin) compare full shapes."""
        from phalanx.checkpoint.hf import check_state_dict_matches
        check_state_dict_matches(unwrap_model(model), state_dict)

    @abstractmethod
    def optimizer_fragments(self, optimizer: Any) -> "OptimizerFragments":
        ...

    @abstractmethod
    def load_optimizer_fragments(self, optimizer: Any, reader: "FragmentReader") -> None:
        ...

    def describe(self) -> str:
        return f"{self.name}(precision={self.precision.name}, {self.describe_data_parallel()})"

    # ---- the planner's view -------------------------------------------------------------
    def plan_layout(self, world: int) -> tuple[Layout, dict[str, Any]]:
        """This plugin's parallel layout over `world` ranks for `phalanx.plan`, and the workload
        settings it fixes (`phalanx.plan.Workload` fields: dtype, bucket_mb, gemini_chunk_mb; and
        `microbatches` for a pipeline). A plugin the planner cannot model raises ValueError."""
        raise ValueError(f"the planner does not know plugin {type(self).__name__}: use DDPPlugin, FSDPPlugin, "
                         "ZeroPlugin, GeminiPlugin or HybridParallelPlugin")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (ModelWrapper, DDP, torch.compile)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        for attr in ("unwrapped", "module", "_orig_mod"):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
        else:
            break
    return model


# Imported at the end to keep the type names available without import cycles.
from phalanx.checkpoint.optimizer import FragmentReader, OptimizerFragments  # noqa: E402,F401


def check_forward_went_through(optimizer: Any) -> None:
    """Refuse a backward whose loss did not come from the boosted model's own forward under DDP.

    A boosted model forwards unknown attributes to the user's model, so `model.get_decoder()(...)`
    or `model.unwrapped(...)` computes with the same parameters but past DDP's forward, which is
    where DDP arms its gradient all-reduce: the backward then leaves every rank with its own
    gradients and the replicas drift apart silently. (FSDP2 fails loudly in that case, and the
    ZeRO and Gemini plugins reduce from gradient hooks, so only DDP needs the check.) Catches a
    backward with no forward through the boosted model since the previous one; a step that mixes
    both kinds of forward is not caught.
    """
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.booster.state import boosted_state

    state = boosted_state(optimizer)
    wrapper = state.module if state is not None else None
    ddp = getattr(wrapper, "module", None)
    if not isinstance(ddp, DistributedDataParallel):
        return
    forwards = wrapper.grad_forwards.take() if isinstance(wrapper, ModelWrapper) else None
    if forwards == 0 and ddp.require_backward_grad_sync and torch.distributed.get_world_size(ddp.process_group) > 1:
        raise RuntimeError(
            "backward of a loss that did not go through the boosted model's forward: with the DDP plugin the "
            "gradients would not be all-reduced and the ranks would drift apart. Compute the loss from "
            "`model(...)` (the model Booster.boost returned), not from `model.unwrapped`, `model.get_decoder()` or "
            "another submodule; to get hidden states, call `model(..., output_hidden_states=True)`.")
