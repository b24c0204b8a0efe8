"""`plan(...)`: estimate every candidate layout, decide which fit, rank them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from phalanx.amp.precision import Precision
from phalanx.plan.layout import Layout, candidate_layouts, structural_problem
from phalanx.plan.memory import MemoryEstimate, estimate_memory
from phalanx.plan.model import ModelSpec, load_spec
from phalanx.plan.timing import StepTime, estimate_time
from phalanx.plan.units import gib, parse_bytes, parse_flops, parse_rate
from phalanx.plan.workload import Hardware, Workload


@dataclasses.dataclass
class LayoutEstimate:
    """One layout's estimate. `fits` is False with `reason` saying why (memory with the parts
    that take it, or a layout that cannot be built)."""
    layout: Layout
    microbatches: int
    memory: MemoryEstimate | None
    time: StepTime | None
    fits: bool
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.layout.name()

    @property
    def device_bytes(self) -> float:
        return self.memory.device_total if self.memory else float("inf")


def _parts(parts: dict[str, float], limit: int = 4) -> str:
    top = sorted(((v, k) for k, v in parts.items() if v > 0), reverse=True)[:limit]
    return ", ".join(f"{k} {gib(v)}" for v, k in top)


def _memory_problem(mem: MemoryEstimate, hw: Hardware) -> str | None:
    need = mem.device_total + hw.reserve
    if need > hw.device_memory:
        return (f"needs {gib(need)} of {gib(hw.device_memory)} device memory: {_parts(mem.device)}"
                f" + reserve {gib(hw.reserve)}")
    if hw.host_memory is not None and mem.host_total > hw.host_memory:
        return f"needs {gib(mem.host_total)} of {gib(hw.host_memory)} host memory: {_parts(mem.host)}"
    return None


def _schedule_problem(layout: Layout, m: int) -> str | None:
    if layout.pp > 1 and layout.pp_schedule != "gpipe" and m < layout.pp:
        return (f"{layout.pp_schedule} needs at least pp={layout.pp} microbatches per step, the batch gives {m}: "
                f"raise --global-batch to {layout.pp} × dp × micro batch")
    return None


def estimate_layout(spec: ModelSpec, layout: Layout, work: Workload, hw: Hardware) -> LayoutEstimate:
    """Estimate one layout (also for layouts the candidate list does not hold)."""
    problem = structural_problem(layout, spec, work.seq)
    if problem:
        return LayoutEstimate(layout, 0, None, None, False, problem)
    try:
        m = work.steps_per_batch(layout.dp)
    except ValueError as exc:
        return LayoutEstimate(layout, 0, None, None, False, str(exc))
    mem = estimate_memory(spec, layout, work, m)
    time = estimate_time(spec, layout, work, hw, m)
    problem = _schedule_problem(layout, m) or _memory_problem(mem, hw)
    return LayoutEstimate(layout, m, mem, time, problem is None, problem)


# Between layouts whose estimated step times agree to 3 significant figures, prefer the one with
# fewer moving parts (what the estimate leaves out, such as hook overheads, grows with them).
_COMPLEXITY = {"ddp": 0, "zero": 1, "fsdp": 2, "hybrid": 3, "gemini": 4}


def rank(estimates: list[LayoutEstimate]) -> list[LayoutEstimate]:
    """Fitting layouts first, the most tokens per second first (without a fixed --global-batch a
    layout with more data-parallel ranks also does more work per step, so step time alone would
    rank it unfairly); then the rest, closest to fitting first."""
    def key(e: LayoutEstimate):
        if e.fits:
            l = e.layout
            moving_parts = (_COMPLEXITY[l.plugin] + l.offload_optim + l.offload_param + l.checkpointing
                            + (getattr(l, "ep", 1) > 1))
            return (0, -float(f"{e.time.tokens_per_s:.3g}"), moving_parts, e.device_bytes)
        return (1 if e.memory else 2, e.device_bytes, e.name)
    return sorted(estimates, key=key)


def plan(model: str | Path | dict | ModelSpec, world_size: int, device_memory: str | int, *,
         host_memory: str | int | None = None, seq: int = 2048, micro_batch: int = 1,
         global_batch: int | None = None, dtype: str | Precision = "bf16", peak_tflops: str | float = 989,
         efficiency: float = 0.45, bandwidth: str | float = "100GB/s", host_bandwidth: str | float = "25GB/s",
         reserve: str | int = "2GiB", loss: str = "fused", max_tp: int = 8, lora=None) -> list[LayoutEstimate]:
    """Every candidate layout for `world_size` ranks, estimated and ranked (see rank()).

    model: a preset name, an HF directory or config.json, a config dict or a ModelSpec;
    device_memory / host_memory: per rank ("80GiB"); peak_tflops: one device's dense peak in the
    compute dtype (a number is TFLOP/s); bandwidth: per-rank collective bandwidth ("200GB/s");
    lora: adapters instead of full fine-tuning ({rank, target_modules}, a `phalanx.plan.lora.LoRA`
    or a recipe's `lora:` section)."""
    spec, work, hw = _inputs(model, world_size, device_memory, host_memory=host_memory, seq=seq,
                             micro_batch=micro_batch, global_batch=global_batch, dtype=dtype,
                             peak_tflops=peak_tflops, efficiency=efficiency, bandwidth=bandwidth,
                             host_bandwidth=host_bandwidth, reserve=reserve, loss=loss, lora=lora)
    return _plan(spec, world_size, work, hw, max_tp)


def _inputs(model, world_size, device_memory, *, host_memory, seq, micro_batch, global_batch, dtype, peak_tflops,
            efficiency, bandwidth, host_bandwidth, reserve, loss, lora) -> tuple[ModelSpec, Workload, Hardware]:
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    spec = load_spec(model)
    work = Workload(seq=seq, micro_batch=micro_batch, global_batch=global_batch, dtype=dtype, loss=loss, lora=lora)
    hw = Hardware(device_memory=parse_bytes(device_memory, "device_memory"),
                  host_memory=None if host_memory is None else parse_bytes(host_memory, "host_memory"),
                  peak_flops=parse_flops(peak_tflops), efficiency=efficiency,
                  bandwidth=parse_rate(bandwidth), host_bandwidth=parse_rate(host_bandwidth, "host_bandwidth"),
                  reserve=parse_bytes(reserve, "reserve"))
    return spec, work, hw


def _plan(spec: ModelSpec, world: int, work: Workload, hw: Hardware, max_tp: int = 8) -> list[LayoutEstimate]:
    return rank([estimate_layout(spec, layout, work, hw) for layout in candidate_layouts(world, spec, work.seq, max_tp=max_tp)])


def suggest_fix(estimates: list[LayoutEstimate], model, world_size: int, device_memory: str | int, *,
                max_world: int | None = None, **options) -> str:
    """When no layout fits: what would. The smallest world size (doubling, up to 16× or
    `max_world`) at which a layout fits with the same devices and the same batch per rank (a fixed
    global batch grows with the world), the device memory the layout that misses by device memory
    alone by the least needs on today's world, and LoRA for a full fine-tuning; `options` as
    plan()'s. "" when nothing helps."""
    spec, work, hw = _inputs(model, world_size, device_memory, **{**_PLAN_DEFAULTS, **options})
    fixes = []
    closest = min((e for e in estimates if e.memory is not None and "device memory" in (e.reason or "")),
                  key=lambda e: e.device_bytes, default=None)
    if closest is not None:  # the layout that misses by device memory alone, by the least
        need = closest.memory.device_total + hw.reserve
        fixes.append(f"devices of at least {gib(need)} ({closest.name} on {world_size} "
                     f"rank{'s' if world_size != 1 else ''})")
    world = world_size * 2
    while world <= (max_world or 16 * world_size):
        global_batch = work.global_batch
        try:
            scaled = (dataclasses.replace(work, global_batch=global_batch * world // world_size)
                      if global_batch else work)
            best = next((e for e in _plan(spec, world, scaled, hw) if e.fits), None)
        except ValueError:
            best = None
        if best is not None:
            fixes.insert(0, f"--world-size {world} ({best.name}, {gib(best.memory.device_total)} per rank"
                            + (f", global batch {scaled.global_batch}" if global_batch else "") + ")")
            break
        world *= 2
    if work.lora is None:
        fixes.append("LoRA (--lora-rank) instead of full fine-tuning")
    return "Fix: " + "; or ".join(fixes) if fixes else ""


_PLAN_DEFAULTS = dict(host_memory=None, seq=2048, micro_batch=1, global_batch=None, dtype="bf16", peak_tflops=989,
                      efficiency=0.45, bandwidth="100GB/s", host_bandwidth="25GB/s", reserve="2GiB", loss="fused",
                      lora=None)
