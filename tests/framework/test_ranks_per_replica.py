"""`ranks_per_replica` on every data-parallel plugin (`phalanx.booster.plugins.base.Plugin`), 4 gloo
ranks in one spawn, ranks_per_replica=2: ranks {0, 1} and {2, 3} are two data-parallel replicas (the
SP groups of apps/video_gen, the DAP groups of apps/protein).

- Each plugin deals 2 replicas (`dp_size` 2, `dp_rank` = rank // 2, `seed_rank` the replica's): the two
  ranks of a replica get the same rows from the boosted DataLoader, the replicas different rows, while
  the plugin shards over (`shard_size` 4) and averages gradients over all four ranks. Each rank runs
  its replica's whole micro-batch here (a model-parallel group would split it), so the mean over the
  world is the mean over the replicas: the losses and weights after 5 AdamW steps equal one process on
  the global batch, and ZeRO-2 / FSDP2 / Gemini equal DDP with ranks_per_replica=2.
- DDP with ranks_per_replica=2 saves a training checkpoint after 2 steps and resumes it into a model
  built from another seed: the 3 further steps equal the uninterrupted run. (Before the fix every rank
  of the first replica wrote the optimizer state, and loading refused the doubled coverage.)

Mutants checked when this was written (each fails the named test): the replica split ignored in
`Plugin.setup` (dp_rank = rank: 4 replicas) fails every layout's test; Gemini's chunk manager
built with `dp_rank` / `dp_size` instead of `shard_rank` / `shard_size` fails Gemini's losses (inf)
and its comparison with DDP; FSDP2's mesh over `dp_size` ranks fails FSDP2's run;
`DDPPlugin.optimizer_fragments` writing on `dp_rank == 0` fails the resume ("optimizer checkpoint
covers only 8192 of elements 0:4096 ... some rank's fragment file is missing").
"""
from __future__ import annotations

import pytest
import torch

from phalanx.testing import ADAMW_UPDATE_RTOL, check, rel_diff, rounding_rtol, spawn, update_diff

from plugin_cases import GLOBAL_BATCH, LR, SEQ, STEPS, initial_state, make_batches, single_process_reference
from spawn_batch import SuiteResults, run_suites

K = 2            # ranks per replica
WORLD = 4
SAVE_AT = 2      # the resume suite saves after this many steps
PLUGINS = ("ddp", "zero2", "fsdp", "gemini")


def _boosted(name: str, seed: int, loader=None):
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.testing import tiny_llama

    model = tiny_llama(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    booster = Booster(plugin=make_plugin(name, "fp32", None, ranks_per_replica=K))
    model, opt, _, loader, _ = booster.boost(model, opt, None, loader)
    return booster, model, opt, loader


def _step(booster, model, opt, batch: torch.Tensor) -> float:
    """One step on this rank's micro-batch; the loss averaged over every rank (= over the replicas)."""
    import torch.distributed as dist

    from phalanx.device import run_device, to_device
    from phalanx.testing import boosted_step

    loss = boosted_step(booster, model, opt, to_device(batch, run_device()))
    mean = loss.detach().clone().float()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def train_per_replica(name: str) -> dict:
    """5 steps with `name`(ranks_per_replica=2), data dealt by the boosted DataLoader."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rows = list(torch.cat(make_batches()))   # step s's global batch: rows 8s .. 8s+7
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // (WORLD // K), shuffle=False)
    booster, model, opt, loader = _boosted(name, 0, loader)
    plugin = booster.plugin
    seen, losses = [], []
    for batch in loader:
        seen.append(batch[:, :4].tolist())   # which rows this rank got
        losses.append(_step(booster, model, opt, batch))
    state = {k: v.cpu() for k, v in plugin.full_model_state_dict(model).items()}   # a collective
    return {"split": (plugin.dp_rank, plugin.dp_size, plugin.shard_rank, plugin.shard_size, plugin.seed_rank),
            "seen": seen, "losses": losses, "state": state if dist.get_rank() == 0 else None}


def resume_ddp(directory: str) -> dict:
    """DDP(ranks_per_replica=2): 2 steps, save, resume into a model from another seed, 3 more steps."""
    import torch.distributed as dist

    from phalanx.checkpoint import TrainState

    def rows(booster, step):
        plugin = booster.plugin
        return make_batches()[step][plugin.dp_rank::plugin.dp_size]   # the loader's split (train_per_replica)

    booster, model, opt, _ = _boosted("ddp", 0)
    before = [_step(booster, model, opt, rows(booster, s)) for s in range(SAVE_AT)]
    booster.save_checkpoint(directory, model, opt, train_state=TrainState(step=SAVE_AT))
    booster, model, opt, _ = _boosted("ddp", 99)   # another init: everything must come from the checkpoint
    assert booster.load_checkpoint(directory, model, opt).step == SAVE_AT
    after = [_step(booster, model, opt, rows(booster, s)) for s in range(SAVE_AT, STEPS)]
    state = {k: v.cpu() for k, v in booster.plugin.full_model_state_dict(model).items()}
    return {"losses": before + after, "state": state if dist.get_rank() == 0 else None}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One spawn for the whole file (every test that needs ranks reads several of its suites)."""
    root = tmp_path_factory.mktemp("ranks_per_replica")
    suites = {name: (train_per_replica, (name,), {}) for name in PLUGINS}
    suites["resume"] = (resume_ddp, (str(root / "ckpt"),), {})
    return SuiteResults(spawn(run_suites, WORLD, suites, timeout=900))


@pytest.fixture(scope="module")
def reference():
    return single_process_reference(STEPS)


def _check_run(got: dict, want_losses: list, want_state: dict, what: str) -> None:
    check(rel_diff(got["losses"], want_losses), rounding_rtol(torch.float32, GLOBAL_BATCH * SEQ), f"{what}: losses")
    check(update_diff(got["state"], want_state, initial_state()), ADAMW_UPDATE_RTOL,
          f"{what}: weights after {STEPS} steps")


@pytest.mark.parametrize("name", PLUGINS)
def test_plugin_deals_per_replica_and_shards_over_every_rank(spawned, reference, name):
    ranks = spawned.get(name)
    assert [r["split"] for r in ranks] == [(0, 2, 0, 4, 0), (0, 2, 1, 4, 0), (1, 2, 2, 4, 1), (1, 2, 3, 4, 1)]
    seen = [r["seen"] for r in ranks]
    assert len(seen[0]) == STEPS and seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    for rank, r in enumerate(ranks):
        check(rel_diff(r["losses"], reference[0]), rounding_rtol(torch.float32, GLOBAL_BATCH * SEQ),
              f"{name}(ranks_per_replica=2) rank {rank}: losses vs one process")
    _check_run(ranks[0], reference[0], reference[1], f"{name}(ranks_per_replica=2) vs one process")


def test_sharding_plugins_equal_ddp_with_the_same_replicas(spawned):
    ddp = spawned.get("ddp")[0]
    for name in PLUGINS[1:]:
        got = spawned.get(name)[0]
        _check_run(got, ddp["losses"], ddp["state"], f"{name} vs ddp (ranks_per_replica=2)")


def test_ddp_with_replicas_resumes_from_its_checkpoint(spawned, reference):
    """Save after 2 steps, resume into a model from another seed, 3 more steps: the same as 5 uninterrupted
    steps (one process on the same global batches)."""
    got = spawned.get("resume")[0]
    _check_run(got, reference[0], reference[1], "ddp(ranks_per_replica=2) resumed after 2 steps")


def test_ranks_per_replica_is_validated_on_every_plugin():
    from phalanx.booster.plugins import make_plugin

    for name in ("ddp", "zero1", "zero2", "fsdp", "gemini"):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="ranks_per_replica"):
                make_plugin(name, "fp32", None, ranks_per_replica=bad)
        assert make_plugin(name, "fp32", None, ranks_per_replica=2).ranks_per_replica == 2
