"""Shared per-rank training routines for the plugin equivalence tests (importable by spawned ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.testing import MasterWeights, tiny_llama

GLOBAL_BATCH, SEQ, STEPS, LR = 8, 16, 5, 1e-2


def make_batches(steps: int = STEPS, global_batch: int = GLOBAL_BATCH, seq: int = SEQ, vocab: int = 128):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (global_batch, seq), generator=g) for _ in range(steps)]


def initial_state() -> dict[str, torch.Tensor]:
    """The weights every run starts from (for update measures)."""
    return tiny_llama(seed=0).state_dict()


def single_process_reference(steps: int = STEPS, max_norm: float | None = None, precision: str = "fp32"):
    """Plain torch: one process, whole global batch, AdamW; with precision="bf16" the model
    computes in bf16 and AdamW updates fp32 master copies (what the plugins' bf16 does)."""
    mp = MasterWeights(tiny_llama(seed=0), {"fp32": torch.float32, "bf16": torch.bfloat16}[precision])
    opt = torch.optim.AdamW(mp.masters.values(), lr=LR, weight_decay=0.01)
    losses = []
    for batch in make_batches(steps):
        loss = mp.model(input_ids=batch, labels=batch).loss
        loss.backward()
        mp.step(opt, max_norm=max_norm)
        losses.append(loss.item())
    return losses, mp.state()


def run_plugin(plugin_factory, steps: int = STEPS, accumulate: int = 1):
    """Train with `plugin_factory()` on this rank's share of each global batch."""
    from phalanx.booster import Booster
    from phalanx.device import run_device, to_device

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    booster = Booster(plugin=plugin_factory())
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for batch in make_batches(steps):
        local = to_device(batch.chunk(world)[rank], run_device())
        micro = local.chunk(accumulate)
        total = 0.0
        for i, mb in enumerate(micro):
            ctx = booster.no_sync(model, opt) if i < accumulate - 1 else _null()
            with ctx:
                loss = model(input_ids=mb, labels=mb).loss.float() / accumulate
                booster.backward(loss, opt)
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        reduced = total.clone().float()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
    state = {k: v.cpu() for k, v in booster.plugin.full_model_state_dict(model).items()}
    return losses, state


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def make_plugin_by_name(name: str, precision: str = "fp32", max_norm: float | None = None):
    from phalanx.booster.plugins import make_plugin
    return make_plugin(name, precision=precision, max_norm=max_norm)


def equivalence_suite(name: str, precisions=("fp32",), accumulate_check: bool = True, max_norm=None):
    """Everything one spawn checks for a plugin: training per precision, then accumulation."""
    out = {}
    for precision in precisions:
        out[precision] = run_plugin(lambda: make_plugin_by_name(name, precision, max_norm))
    if accumulate_check:
        out["accumulate"] = run_plugin(lambda: make_plugin_by_name(name, "fp32", max_norm), accumulate=2)
    return out


def train_and_checkpoint(name: str, directory: str, steps: int = STEPS):
    """Train `steps` steps with plugin `name`, then save a full training checkpoint."""
    from phalanx.booster import Booster
    from phalanx.checkpoint import TrainState

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    booster = Booster(plugin=make_plugin_by_name(name))
    model, opt, *_ = booster.boost(model, opt)
    for batch in make_batches(steps):
        local = batch.chunk(world)[rank]
        booster.backward(model(input_ids=local, labels=local).loss, opt)
        opt.step()
        opt.zero_grad()
    booster.save_checkpoint(directory, model, opt, train_state=TrainState(step=steps))
    booster.save_model(model, directory + "-hf", shard=True, max_shard_size="40KB")
    return True


def resume_and_continue(name: str, directory: str, start: int = STEPS, extra: int = 2):
    """Load the checkpoint into a new layout and train `extra` more steps; return their losses."""
    from phalanx.booster import Booster
    from phalanx.device import run_device, to_device

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed=99)  # different init: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    booster = Booster(plugin=make_plugin_by_name(name))
    model, opt, *_ = booster.boost(model, opt)
    state = booster.load_checkpoint(directory, model, opt)
    assert state.step == start
    losses = []
    for batch in make_batches(start + extra)[start:]:
        local = batch.chunk(world)[rank]
        loss = model(input_ids=local, labels=local).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
    return losses
