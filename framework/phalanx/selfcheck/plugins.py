"""Each plugin trains a tiny Llama for 10 steps on its share of every global batch; the losses
must equal one process training on the whole batch (fp32, within 1e-4 relative: different
summation orders only)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.device import to_device
from phalanx.launch import context
from phalanx.testing import tiny_llama, train_one_process

STEPS, GLOBAL_BATCH, SEQ, LR, RTOL = 10, 8, 16, 1e-2, 1e-4


def _batches():
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _reference() -> list[float]:
    return train_one_process(tiny_llama(seed=0), _batches(), LR, device=context().device)


_REFERENCE: list[float] = []


def _plugin_losses(name: str, **kwargs) -> list[float]:
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    ctx = context()
    booster = Booster(plugin=make_plugin(name, precision="fp32", **kwargs))
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, opt, *_ = booster.boost(model, opt)
    dp_rank, dp_size = getattr(booster.plugin, "dp_rank", ctx.rank), getattr(booster.plugin, "dp_size", ctx.world_size)
    losses = []
    for batch in _batches():
        local = to_device(batch.chunk(dp_size)[dp_rank], ctx.device)
        loss = model(input_ids=local, labels=local).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return losses


def _check(name: str, **kwargs):
    if not _REFERENCE:
        _REFERENCE.extend(_reference())
    got = _plugin_losses(name, **kwargs)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, _REFERENCE, strict=True))
    assert worst <= RTOL, f"losses differ from one process by {worst:.2e} (> {RTOL:.0e}): {got} vs {_REFERENCE}"
    return f"{STEPS} steps, loss {_REFERENCE[0]:.3f} -> {got[-1]:.3f}, max rel diff {worst:.1e}", {"max_rel_diff": worst}


def checks():
    out = [(name, lambda n=name: _check(n)) for name in ("ddp", "zero1", "zero2", "fsdp", "gemini")]
    world = context().world_size
    if world in (2, 4):
        out.append((f"hybrid tp{world}", lambda: _check("hybrid", tp_size=world)))
    return out
