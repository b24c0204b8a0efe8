"""What test_zero_offload.py runs on 2 spawned ranks: tiny-Llama training with ZeroPlugin, with
and without CPU offload, recording per step the bytes the host store moved, where each buffer
lives and how much host-pool memory the kernel counts; the assertions live in the test.

Runs reuse zero_workers' model, batches and optimizer (two param groups, a LinearLR schedule).
"""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import zero_workers as zw
from phalanx.hostmem import memory_kind
from phalanx.observe.memory import resident_bytes

# name: (stage, precision, cpu_offload, train options)
CONFIGS = {
    "s2_fp32_offload": (2, "fp32", True, {}),
    "s2_fp32": (2, "fp32", False, {}),
    "s1_bf16_offload": (1, "bf16", True, {}),
    "s1_bf16": (1, "bf16", False, {}),
    "s2_fp16_offload": (2, "fp16", True, {}),
    "s2_fp16": (2, "fp16", False, {}),
    # two micro-batches, each reduced (no no_sync): two device->host copies of the gradient per step
    "s2_fp32_offload_accum": (2, "fp32", True, {"accum": 2, "no_sync": False}),
    "s2_fp32_accum": (2, "fp32", False, {"accum": 2, "no_sync": False}),
}


def place(t: torch.Tensor) -> str:
    """"device" or "host", asked of the memory itself: CUDA vs CPU on a GPU machine; on a CPU-only
    one, the kind of mapping /proc/self/maps reports (the host pool is shared pages)."""
    from phalanx_kernels.accelerator import available, is_accelerator

    if is_accelerator(t):
        return "device"
    if available():
        return "host"
    return "host" if memory_kind(t) == "shared" else "device"


def _traffic(opt) -> tuple[int, int]:
    t = opt.offload.traffic if opt.offload is not None else None
    return (t.to_host, t.to_device) if t is not None else (0, 0)


def run_config(name: str) -> dict:
    stage, precision, offload, train = CONFIGS[name]
    gc.collect()  # the previous run's host pool goes now, not during this one
    shmem_before = resident_bytes()["shmem"]
    run = zw.Run(zw.zero(stage, precision, cpu_offload=offload))
    opt = run.optimizer
    traffic = []
    last = zw.STEPS - 1
    for step in range(last):
        before = _traffic(opt)
        run.step(step, **train)
        traffic.append([a - b for a, b in zip(_traffic(opt), before, strict=True)])
    # The last step by hand, to look at the gradient shards between the reduction and the update.
    before = _traffic(opt)
    local = run.backward(last, **train)
    opt.reducer.finish()
    places = {"master": [place(m) for m in opt.master_params()],
              "master_grad": [place(m.grad) for m in opt.master_params()],
              "model_params": sorted({place(p) for p in run.model.unwrapped.parameters()})}
    opt.step()
    run.scheduler.step()
    opt.zero_grad()
    run.losses.append(zw._global_mean(local))
    traffic.append([a - b for a, b in zip(_traffic(opt), before, strict=True)])
    places["optimizer_state"] = sorted({place(v) for s in opt.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor) and v.dim() > 0})
    # the model's parameters hold this rank's updated master shard (cast to the model dtype)
    received = all(torch.equal(g.flat[slice(*g.shard_range)], g.master.detach().to(g.flat.device, g.dtype))
                   for g in opt.flat_groups if g is not None)
    out = run.result()
    out.update({"traffic": traffic, "places": places, "received_update": received,
                "shmem_growth": resident_bytes()["shmem"] - shmem_before,
                "shard_numels": [m.numel() for m in opt.master_params()], "rank": dist.get_rank()})
    del run, opt
    return out


def suite(configs: list[str]) -> dict:
    return {name: run_config(name) for name in configs}
