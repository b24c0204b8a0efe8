"""Data x sequence parallelism under the sharding plugins: ZeRO-1/2, FSDP2 and Gemini.

With `parallel.sp_size` = sp > 1 the world is dp x sp: consecutive groups of sp ranks are the SP
groups (`sequence_parallel.sequence_layout`), each group one data-parallel replica. Every rank holds
the same parameters (the SP ranks of a group run the same model on different tokens), so what a
sharding plugin splits -- ZeRO's optimizer states and gradients, FSDP2's parameters, Gemini's
chunks -- is split over *every* rank (dp x sp, as DeepSpeed-Ulysses shards ZeRO over its "sequence
data parallel" group), and gradients are averaged over every rank as DDP does: each rank returns
sp x its shard's loss (`VideoFlowModel.shard_loss`), so the mean over the world is the mean over the
replicas of full-sequence gradients.

What differs from the plugins as `fit` builds them is only the data: they deal one micro-batch to
every rank, which would give the ranks of an SP group different clips. `SequenceGroupData` makes a
plugin deal per replica (`dp_rank` = rank // sp, `dp_size` = world / sp: fit's sampler, its loss
accounting and `data_replica`) and seed per replica (`seed_rank`, so a group's ranks draw the same
timesteps, noise and caption dropout), while its process group and, during `configure_model`, the
rank and size it shards by stay the whole world. DDP has this built in (`ranks_per_replica`,
`with_sequence_replicas`). `fit_data_sequence` runs `fit`'s own `TrainingRun` with such a plugin.

A framework change would make this module a one-liner (see docs/video.md): `ranks_per_replica`
on the base plugin, as DDPPlugin has it, honoured by ZeroPlugin, FSDPPlugin and GeminiPlugin.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist

from phalanx.booster import Booster
from phalanx.booster.plugins.fsdp import FSDPPlugin
from phalanx.booster.plugins.gemini import GeminiPlugin
from phalanx.booster.plugins.zero import ZeroPlugin
from phalanx.config import ConfigError
from phalanx.train import TrainingRun, fit
from phalanx.train.data import check_dataset

from .config import SP_PLUGINS
from .sequence_parallel import with_sequence_replicas


def check_sp_plugin(plugin: str, sp: int) -> None:
    if sp > 1 and plugin not in SP_PLUGINS:
        raise ConfigError(f"config 'parallel.sp_size'={sp} runs under train.plugin = {' / '.join(SP_PLUGINS)} (the "
                          f"SP groups inside their data-parallel replicas), got train.plugin={plugin!r}: choose one "
                          "of those, or parallel.sp_size=1")


class SequenceGroupData:
    """Mixin for a sharding plugin: data dealt and random streams seeded per SP group of `sp`
    consecutive ranks; parameters, optimizer states and gradients sharded and averaged over every
    rank (the plugin's process group stays the world)."""

    def __init__(self, sp: int, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sp = sp

    def setup(self) -> None:
        super().setup()   # dp_group: the world (FSDP2: its mesh over every rank)
        world = dist.get_world_size()
        if world % self.sp:
            raise ConfigError(f"config 'parallel.sp_size'={self.sp}: the {world} ranks split into data-parallel "
                              f"replicas of sp_size ranks each; choose an sp_size that divides {world}")
        self.shard_rank, self.shard_size = dist.get_rank(), world
        self.dp_rank, self.dp_size = self.shard_rank // self.sp, world // self.sp

    @property
    def seed_rank(self) -> int:
        return self.dp_rank

    @contextlib.contextmanager
    def _shard_over_every_rank(self) -> Iterator[None]:
        """While the model is sharded: the rank and size a plugin shards by are the world's (ZeRO's
        start-up broadcast, Gemini's chunk manager)."""
        replica = self.dp_rank, self.dp_size
        self.dp_rank, self.dp_size = self.shard_rank, self.shard_size
        try:
            yield
        finally:
            self.dp_rank, self.dp_size = replica

    def configure_model(self, model):
        from phalanx.booster.state import boosted_state

        with self._shard_over_every_rank():
            wrapper = super().configure_model(model)
        boosted_state(wrapper).data_replica = (self.dp_rank, self.dp_size)   # the SP peers are one replica
        return wrapper

    def describe(self) -> str:
        return (f"{super().describe()} with data x sequence parallelism: dp={self.dp_size} x sp={self.sp}, "
                f"sharded over all {self.shard_size} ranks")


class SequenceGroupZero(SequenceGroupData, ZeroPlugin):
    pass


class SequenceGroupFSDP(SequenceGroupData, FSDPPlugin):
    pass


class SequenceGroupGemini(SequenceGroupData, GeminiPlugin):
    pass


def sequence_group_plugin(train_cfg, precision, sp: int):
    """The plugin of `train_cfg` (zero1 / zero2 / fsdp / gemini, with its plugin_options), dealing per SP group."""
    kwargs = {"precision": precision, "max_norm": train_cfg.max_grad_norm or None, **train_cfg.plugin_options}
    name = train_cfg.plugin
    if name in ("zero1", "zero2"):
        return SequenceGroupZero(sp, stage=int(name[-1]), **kwargs)
    if name == "fsdp":
        return SequenceGroupFSDP(sp, **kwargs)
    if name == "gemini":
        return SequenceGroupGemini(sp, **kwargs)
    check_sp_plugin(name, sp)
    raise ValueError(f"sequence_group_plugin: {name!r} deals data itself (ddp: with_sequence_replicas)")


def fit_data_sequence(train_cfg, sp: int, model, train_dataset, **fit_kwargs):
    """`phalanx.train.fit` with data x sequence parallelism over SP groups of `sp` ranks (sp = 1: plain fit)."""
    check_sp_plugin(train_cfg.plugin, sp)
    if sp == 1 or train_cfg.plugin == "ddp":
        return fit(with_sequence_replicas(train_cfg, sp), model, train_dataset, **fit_kwargs)
    run = _SequenceGroupRun(sp, train_cfg, model, train_dataset, **fit_kwargs)
    run.setup()
    try:
        run.train()
    finally:
        run.close()
    return run.result()


class _SequenceGroupRun(TrainingRun):
    """fit's run (`TrainingRun`: the same checks, loop, checkpoints and evaluation) with the plugin of
    `sequence_group_plugin` in place of the one fit builds from the config's name."""

    def __init__(self, sp: int, cfg, model, train_dataset, **kwargs):
        super().__init__(cfg, model, train_dataset, **kwargs)
        self.plugin = sequence_group_plugin(self.cfg, self.precision, sp)
        self.booster = Booster(self.plugin)
        self.dp_size = self.plugin.dp_size
        check_dataset(train_dataset, self.cfg.micro_batch_size, self.dp_size)
