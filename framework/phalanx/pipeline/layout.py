"""Which decoder layers each pipeline stage holds, which stages each rank holds, and whether a
schedule can run the layout. Pure arithmetic: everything here is checked in the plugin's
constructor (or at `boost`, once the number of layers is known), before any work.

Schedules (`SCHEDULES`):

| name | torch schedule | stages per rank | placement |
|---|---|---|---|
| gpipe | ScheduleGPipe | 1 | stage r on rank r |
| 1f1b | Schedule1F1B | 1 | stage r on rank r |
| interleaved | ScheduleInterleaved1F1B | `virtual_stages` (default 2) | loop: rank r holds r, r+p, r+2p, … |
| zero_bubble | ScheduleZBVZeroBubble | 2 | "V": rank r holds r and 2p−1−r |
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.mesh import LayoutError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


@dataclass(frozen=True)
class StageLayout:
    """The stage split of one model over `pp` ranks: `layers[s]` is the range of decoder layers of
    stage s; `stages_of(rank)` the stages a pipeline rank holds, in execution order."""

    schedule: str
    pp: int
    virtual: int
    layers: tuple[range, ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        if self.schedule == "zero_bubble":
            return [rank, 2 * self.pp - 1 - rank]
        return [rank + k * self.pp for k in range(self.virtual)]

    def rank_of(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stages_of(r))


def virtual_stages_for(schedule: str, virtual_stages: int | None) -> int:
    """Stages per rank: 1 for gpipe/1f1b, 2 for zero_bubble (its V placement), `virtual_stages`
    (default 2) for interleaved."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"pp_schedule={schedule!r} is not a schedule; choose one of {', '.join(SCHEDULES)}")
    if schedule in ("gpipe", "1f1b"):
        if virtual_stages not in (None, 1):
            raise LayoutError(f"pp_schedule={schedule!r} runs one stage per rank, but virtual_stages={virtual_stages}; "
                              "use pp_schedule='interleaved' for several stages per rank")
        return 1
    if schedule == "zero_bubble":
        if virtual_stages not in (None, 2):
            raise LayoutError(f"pp_schedule='zero_bubble' (ZB-V) places exactly 2 stages on each rank, "
                              f"but virtual_stages={virtual_stages}; leave virtual_stages unset")
        return 2
    virtual = 2 if virtual_stages is None else virtual_stages
    if virtual < 2:
        raise LayoutError(f"pp_schedule='interleaved' needs virtual_stages >= 2 (got {virtual}); "
                          "with one stage per rank use '1f1b'")
    return virtual


def check_microbatches(schedule: str, pp: int, microbatches: int) -> None:
    """Refuse microbatch counts a schedule cannot run (the numbers and the fix in the message)."""
    if microbatches < 1:
        raise LayoutError(f"num_microbatches={microbatches} must be at least 1")
    if pp == 1:
        return
    if schedule in ("1f1b", "interleaved", "zero_bubble") and microbatches < pp:
        raise LayoutError(f"pp_schedule={schedule!r} needs at least as many microbatches as pipeline ranks: "
                          f"num_microbatches={microbatches} < pp_size={pp}; set num_microbatches >= {pp} "
                          "(more microbatches also shrink the bubble)")
    if schedule == "interleaved" and microbatches % pp:
        raise LayoutError(f"pp_schedule='interleaved' runs microbatches in rounds of pp_size={pp}: "
                          f"num_microbatches={microbatches} % {pp} = {microbatches % pp}; use a multiple of {pp}")


def split_layers(num_layers: int, schedule: str, pp: int, virtual: int,
                 layers_per_stage: list[int] | tuple[int, ...] | None = None) -> StageLayout:
    """Decoder layers per stage: `layers_per_stage` if given, else an even split (interleaved and
    zero_bubble need an exact one; gpipe/1f1b give the remainder to the middle stages, which hold
    neither the embedding nor the head)."""
    stages = pp * virtual
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != stages:
            raise LayoutError(f"layers_per_stage has {len(counts)} entries but there are pp_size × virtual stages = "
                              f"{pp} × {virtual} = {stages} stages; give one count per stage")
        if min(counts) < 1 or sum(counts) != num_layers:
            raise LayoutError(f"layers_per_stage={counts} must be positive and sum to the model's {num_layers} "
                              f"decoder layers (they sum to {sum(counts)})")
    else:
        if stages > num_layers:
            raise LayoutError(f"pp_size × virtual stages = {pp} × {virtual} = {stages} pipeline stages but the model "
                              f"has only {num_layers} decoder layers; use at most {num_layers} stages "
                              "(a smaller pp_size, or fewer virtual stages)")
        base, extra = divmod(num_layers, stages)
        if extra and virtual > 1:
            raise LayoutError(f"pp_schedule={schedule!r} splits {num_layers} decoder layers over pp_size × virtual "
                              f"stages = {pp} × {virtual} = {stages} stages: {num_layers} % {stages} = {extra}; "
                              "choose a pp_size/virtual_stages that divides the layers or give layers_per_stage")
        counts = [base] * stages
        order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 2 else list(range(stages))
        for s in order[:extra]:
            counts[s] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return StageLayout(schedule, pp, virtual, tuple(ranges))


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """A rank's idle fraction in theory (forward, backward and stages all equally fast, free
    communication): (p−1)/(m+p−1) for GPipe and 1F1B; (p−1)/(v·m+p−1) for interleaved 1F1B with v
    stages per rank; ZB-V fills the bubble with deferred weight gradients, 0 once m ≥ 2p (the
    paper's ideal, F = B = W), else counted like interleaved."""
    p, m = pp, microbatches
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "zero_bubble" and m >= 2 * p:
        return 0.0
    return (p - 1) / (virtual * m + p - 1)
