"""Rank bodies for test_fsdp_comms.py: the gloo replacements against torch's own collectives."""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.booster.plugins.fsdp_comms import GLOO_EXCHANGES, BroadcastAllGather, GlooReduceScatter


def compare_with_torch_collectives() -> dict[str, float]:
    """Max |difference| between ours and torch's, per collective and op, on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    out = {}
    shard = torch.randn(37, generator=gen)
    want = torch.empty(37 * world)
    dist.all_gather_into_tensor(want, shard, group=group)
    got = torch.full((37 * world,), float("nan"))
    work = BroadcastAllGather()(got, shard, group)
    assert isinstance(work, dist.Work)  # FSDP2 waits on a Work before it reads the output
    work.wait()
    out["all_gather"] = (got - want).abs().max().item()
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        full = torch.randn(world * 41, generator=gen)
        want = torch.empty(41)
        dist.reduce_scatter_tensor(want, full.clone(), op=op, group=group)
        for exchange in GLOO_EXCHANGES:
            got = torch.full((41,), float("nan"))
            GlooReduceScatter(exchange=exchange)(got, full.clone(), group, op)
            out[f"reduce_scatter_{name}_{exchange}"] = (got - want).abs().max().item()
    return out


def overlapped_reduce_gradients() -> dict:
    """FSDPPlugin with and without the overlapped gradient reduce: the gradients right after
    `backward` (before any optimizer call), also when a second backward accumulates into them
    with no zero_grad in between, and how many reduces were deferred."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import FSDPPlugin
    from phalanx.booster.plugins import fsdp_comms
    from phalanx.testing import tiny_llama

    rank, world = dist.get_rank(), dist.get_world_size()
    deferred = {"n": 0, "most_pending": 0}
    add = fsdp_comms.PendingReduces.add

    def counting_add(self, *args):
        deferred["n"] += 1
        out = add(self, *args)
        deferred["most_pending"] = max(deferred["most_pending"], len(self._items))
        return out

    fsdp_comms.PendingReduces.add = counting_add
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 128, (2 * world, 16), generator=g).chunk(world)[rank] for _ in range(2)]
    grads = {}
    for overlap in (False, True):
        model = tiny_llama(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, *_ = Booster(plugin=FSDPPlugin(overlap_reduce=overlap)).boost(model, opt)
        before = deferred["n"]
        model(input_ids=batches[0], labels=batches[0]).loss.backward()
        one = {n: p.grad.full_tensor().clone() for n, p in model.module.named_parameters()}
        model(input_ids=batches[1], labels=batches[1]).loss.backward()  # accumulates: no zero_grad
        two = {n: p.grad.full_tensor().clone() for n, p in model.module.named_parameters()}
        grads[overlap] = (one, two, deferred["n"] - before)
    fsdp_comms.PendingReduces.add = add

    def diff(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    (one0, two0, _), (one1, two1, n) = grads[False], grads[True]
    return {"deferred": n, "most_pending": deferred["most_pending"], "first": diff(one0, one1), "accumulated": diff(two0, two1),
            "nonzero": max(t.abs().max().item() for t in one1.values())}


def forward_prefetch_gathers() -> dict:
    """FSDPPlugin with and without `forward_prefetch`: how many all-gathers have started when the
    first block's forward runs (with the prefetch, the second block's has too), and the loss and
    gradients of one step (the prefetch changes when parameters arrive, not the arithmetic)."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import FSDPPlugin, fsdp_comms
    from phalanx.booster.plugins.fsdp import transformer_blocks
    from phalanx.testing import tiny_llama

    rank, world = dist.get_rank(), dist.get_world_size()
    started = {"n": 0}
    call = fsdp_comms.BroadcastAllGather.__call__

    def counting_call(self, *args, **kwargs):
        started["n"] += 1
        return call(self, *args, **kwargs)

    fsdp_comms.BroadcastAllGather.__call__ = counting_call
    batch = torch.randint(0, 128, (2 * world, 16), generator=torch.Generator().manual_seed(3)).chunk(world)[rank]
    out = {}
    for prefetch in (False, True):
        model = tiny_llama(seed=0)
        blocks = transformer_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, *_ = Booster(plugin=FSDPPlugin(forward_prefetch=prefetch)).boost(model, opt)
        seen = []
        blocks[0].register_forward_pre_hook(lambda *_: seen.append(started["n"]))  # after FSDP2's own hook
        started["n"] = 0
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        out[prefetch] = {"gathers_at_first_block": seen[0], "loss": loss.item(),
                         "grads": {n: p.grad.full_tensor().clone() for n, p in model.module.named_parameters()}}
    fsdp_comms.BroadcastAllGather.__call__ = call
    grads_diff = max((out[True]["grads"][k] - out[False]["grads"][k]).abs().max().item() for k in out[True]["grads"])
    return {"gathers": (out[False]["gathers_at_first_block"], out[True]["gathers_at_first_block"]),
            "loss_diff": abs(out[True]["loss"] - out[False]["loss"]), "grads_diff": grads_diff}


def compute_dtype_exchange() -> dict:
    """bf16 FSDPPlugin on gloo: the dtype of every reduce input (the compute dtype normally, fp32
    for the reduce after a backward without gradient sync, whose gradients FSDP2 accumulated in
    fp32), and the gradients after a plain backward and after a no_sync + synced pair, against
    FSDP2's own fp32 reduce-scatter (`grad_collective="reduce_scatter"`)."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import FSDPPlugin, fsdp_comms
    from phalanx.testing import tiny_llama

    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list[tuple[str, str]] = []
    call = fsdp_comms.GlooReduceScatter.__call__

    def recording_call(self, output_tensor, input_tensor, group, op, async_op=False):
        seen.append((str(input_tensor.dtype).removeprefix("torch."), str(output_tensor.dtype).removeprefix("torch.")))
        return call(self, output_tensor, input_tensor, group, op, async_op)

    fsdp_comms.GlooReduceScatter.__call__ = recording_call
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, 128, (2 * world, 16), generator=g).chunk(world)[rank] for _ in range(3)]
    out: dict = {}
    for collective in ("auto", "reduce_scatter"):
        model = tiny_llama(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        booster = Booster(plugin=FSDPPlugin(precision="bf16", grad_collective=collective))
        model, opt, *_ = booster.boost(model, opt)
        del seen[:]
        booster.backward(model(input_ids=batches[0], labels=batches[0]).loss, opt)
        plain = {n: p.grad.full_tensor().clone() for n, p in model.module.named_parameters()}
        plain_dtypes = list(seen)
        opt.zero_grad()
        del seen[:]
        with booster.no_sync(model, opt):
            booster.backward(model(input_ids=batches[1], labels=batches[1]).loss, opt)
        booster.backward(model(input_ids=batches[2], labels=batches[2]).loss, opt)
        accumulated = {n: p.grad.full_tensor().clone() for n, p in model.module.named_parameters()}
        out[collective] = {"plain": plain, "accumulated": accumulated, "plain_dtypes": plain_dtypes,
                           "accumulated_dtypes": list(seen)}
    fsdp_comms.GlooReduceScatter.__call__ = call

    def diff(a, b):
        return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a)

    ours, torch_own = out["auto"], out["reduce_scatter"]
    return {"plain_dtypes": ours["plain_dtypes"], "accumulated_dtypes": ours["accumulated_dtypes"],
            "plain_diff": diff(ours["plain"], torch_own["plain"]),
            "accumulated_diff": diff(ours["accumulated"], torch_own["accumulated"]),
            "grad_dtype": str(next(iter(ours["plain"].values())).dtype).removeprefix("torch.")}
