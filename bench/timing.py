"""Timing shared by the multi-rank benchmarks (run as `python bench/<name>.py`, so this
module is importable as `timing`)."""
from __future__ import annotations

import os
import platform
import time
from typing import Callable

import torch.distributed as dist


def time_round_robin(steps_of: dict[str, Callable[[], None]], rounds: int, steps: int
                     ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run each variant's step `steps` times per round, variants interleaved over `rounds`
    rounds so load changes on a shared machine hit them all alike. Every step starts and ends
    at a barrier. Returns per-step wall seconds and this rank's CPU seconds per variant."""
    wall: dict[str, list[float]] = {name: [] for name in steps_of}
    cpu: dict[str, list[float]] = {name: [] for name in steps_of}
    for _ in range(rounds):
        for name, step in steps_of.items():
            for _ in range(steps):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                c1 = time.process_time()
                dist.barrier()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
    return wall, cpu


def boost_variant(config, layout: dict | None, batch: int, seq: int):
    """The benches' common set-up: a Llama from `config` (seed 0) boosted with DDPPlugin (layout
    None) or HybridParallelPlugin(**layout), AdamW, clipping at 1.0, and this rank's share of one
    fixed global batch of token ids. Returns (booster, model, optimizer, input_ids)."""
    import torch
    from transformers import LlamaForCausalLM

    from phalanx.booster import Booster
    from phalanx.booster.plugins import DDPPlugin
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    plugin = DDPPlugin(max_norm=1.0) if layout is None else HybridParallelPlugin(max_norm=1.0, **layout)
    booster = Booster(plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, optimizer, *_ = booster.boost(model, optimizer)
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    return booster, model, optimizer, x.chunk(plugin.dp_size)[plugin.dp_rank]


def cpu_kind() -> str:
    """The CPU's model name (printed with every figure: the machines differ between sessions)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
