"""Parallel layouts the planner considers, and the list of them for a world size."""
from __future__ import annotations

from typing import Iterator

from phalanx.layout import Layout  # the value lives below booster and plan (re-exported here)
from phalanx.models import ModelSpec, head_problem

PLUGINS = ("ddp", "zero", "fsdp", "gemini", "hybrid")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_problem(layout: Layout, spec: ModelSpec, seq: int) -> str | None:
    """Why the layout cannot be built for this model at all (heads, layers, sequence), or None."""
    t, p, s = layout.tp, layout.pp, layout.sp
    if layout.world % (t * p * s):
        return f"tp×pp×sp = {t * p * s} does not divide the world size {layout.world}"
    heads = head_problem(spec.heads, t)
    if heads:
        return heads
    if p > spec.num_layers:
        return f"pp={p} stages but the model has {spec.num_layers} layers"
    if layout.sp_mode == "ulysses":
        if seq % s:
            return f"sequence {seq} does not divide by sp={s}"
        if (spec.num_heads // t) % s:
            return f"Ulysses needs the {spec.num_heads // t} heads per tp rank divisible by sp={s}"
    if layout.sp_mode == "split_gather" and seq % t:
        return f"sequence {seq} does not divide by tp={t} (split-gather)"
    return None


def candidate_layouts(world: int, spec: ModelSpec, seq: int, *, max_tp: int = 8) -> Iterator[Layout]:
    """Every layout worth estimating for `world` ranks: the plain plugins, and hybrid with each
    tp (≤ max_tp, dividing the heads) × pp × Ulysses sp, with and without activation checkpointing."""
    for ckpt in (False, True):
        yield Layout("ddp", world, checkpointing=ckpt)
        for stage in (1, 2):
            for off in (False, True):
                yield Layout("zero", world, zero_stage=stage, offload_optim=off, checkpointing=ckpt)
        yield Layout("fsdp", world, checkpointing=ckpt)
        for off_o, off_p in ((False, False), (True, False), (True, True)):
            yield Layout("gemini", world, offload_optim=off_o, offload_param=off_p, checkpointing=ckpt)
        for t in _divisors(world):
            if t > max_tp:
                continue
            for p in _divisors(world // t):
                for s in _divisors(world // (t * p)):
                    if t == p == s == 1:
                        continue  # plain data parallel: the zero/ddp rows above
                    if s > 1 and p > 1:
                        continue  # Ulysses/ring do not compose with pp
                    modes = ["ulysses"] if s > 1 else ([None, "split_gather"] if t > 1 else [None])
                    for mode in modes:
                        for stage in (1, 2) if p == 1 else (1,):
                            yield Layout("hybrid", world, zero_stage=stage, tp=t, pp=p, sp=s, sp_mode=mode,
                                         checkpointing=ckpt)
