"""Data x sequence parallelism under every data-parallel plugin: DDP, ZeRO-1/2, FSDP2 and Gemini.

With `parallel.sp_size` = sp > 1 the world is dp x sp: consecutive groups of sp ranks are the SP
groups (`sequence_parallel.sequence_layout`), each group one data-parallel replica. The framework's
plugins take that split themselves (`ranks_per_replica=sp`, `phalanx.booster.plugins.base.Plugin`):
they deal one micro-batch per replica (`dp_rank` = rank // sp, `dp_size` = world / sp: fit's
sampler, its loss accounting and `data_replica`) and seed per replica (`seed_rank`, so a group's
ranks draw the same timesteps, noise and caption dropout), while their process group and the rank
and size they shard by stay the whole world. Every rank holds the same parameters (the SP ranks of a
group run the same model on different tokens), so what a sharding plugin splits -- ZeRO's optimizer
states and gradients, FSDP2's parameters, Gemini's chunks -- is split over *every* rank (dp x sp, as
DeepSpeed-Ulysses shards ZeRO over its "sequence data parallel" group), and gradients are averaged
over every rank: each rank returns sp x its shard's loss (`VideoFlowModel.shard_loss`), so the mean
over the world is the mean over the replicas of full-sequence gradients.
"""
from __future__ import annotations

import torch.distributed as dist

from phalanx.observe import get_logger
from phalanx.train import fit

log = get_logger("apps.video_gen")


def sequence_replicas_config(train_cfg, sp: int):
    """The train config fit gets for SP groups of `sp` ranks: the plugin's `ranks_per_replica=sp`
    (sp = 1: the config as it is)."""
    return train_cfg.with_replica_groups(sp, "parallel.sp_size")


def fit_data_sequence(train_cfg, sp: int, model, train_dataset, **fit_kwargs):
    """`phalanx.train.fit` with data x sequence parallelism over SP groups of `sp` ranks (sp = 1: plain fit)."""
    cfg = sequence_replicas_config(train_cfg, sp)
    if sp > 1 and dist.is_initialized():
        world = dist.get_world_size()
        how = "sharded" if cfg.plugin != "ddp" else "gradients averaged"
        log.info(f"{cfg.plugin} with data x sequence parallelism: dp={world // sp} x sp={sp}, {how} over all "
                 f"{world} ranks (ranks_per_replica={sp})")
    return fit(cfg, model, train_dataset, **fit_kwargs)
