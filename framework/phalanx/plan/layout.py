"""Parallel layouts the planner considers, and the list of them for a world size."""
from __future__ import annotations

import dataclasses
from typing import Iterator

from phalanx.plan.model import ModelSpec

PLUGINS = ("ddp", "zero", "fsdp", "gemini", "hybrid")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run training. `plugin` is the Booster plugin; zero_stage applies to `zero`
    (1/2) and `hybrid` (0/1/2); tp/pp/sp to `hybrid` (sp_mode "split_gather" uses the tp ranks,
    "ulysses" its own sp ranks); offload_optim: optimizer state (fp32 masters, moments, fp32
    gradients) in host memory (ZeRO cpu_offload, Gemini offload_optim_frac=1); offload_param:
    Gemini keeps the parameter shards on the host too (offload_param_frac=1)."""
    plugin: str
    world: int
    zero_stage: int = 0
    tp: int = 1
    pp: int = 1
    sp: int = 1
    sp_mode: str | None = None
    pp_schedule: str = "1f1b"
    checkpointing: bool = False
    offload_optim: bool = False
    offload_param: bool = False

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def shard_group(self) -> int:
        """Ranks the optimizer state is sharded over (ZeRO: dp × sp of each tp/pp rank)."""
        return self.dp * self.sp

    def name(self) -> str:
        parts = []
        if self.plugin == "zero":
            parts.append(f"zero{self.zero_stage}")
        elif self.plugin == "hybrid":
            dims = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("sp", self.sp)) if v > 1]
            parts.append("hybrid " + "+".join(dims or ["dp"]))
            if self.sp_mode == "split_gather":
                parts.append("sp=split_gather")
            elif self.sp_mode:
                parts.append(self.sp_mode)
            if self.pp > 1:
                parts.append(self.pp_schedule)
            if self.zero_stage:
                parts.append(f"zero{self.zero_stage}")
        else:
            parts.append(self.plugin)
        if self.offload_optim:
            parts.append("offload optim")
        if self.offload_param:
            parts.append("offload params")
        if self.checkpointing:
            parts.append("ckpt")
        return " ".join(parts)

    def plugin_options(self) -> dict:
        """make_plugin(name, **options) arguments for this layout."""
        if self.plugin == "zero":
            return {"name": f"zero{self.zero_stage}", "cpu_offload": self.offload_optim}
        if self.plugin == "gemini":
            return {"name": "gemini", "placement_policy": "static", "offload_optim_frac": float(self.offload_optim),
                    "offload_param_frac": float(self.offload_param)}
        if self.plugin == "hybrid":
            out = {"name": "hybrid", "tp_size": self.tp, "sp_size": self.sp, "pp_size": self.pp,
                   "zero_stage": self.zero_stage, "gradient_checkpointing": self.checkpointing,
                   "cpu_offload": self.offload_optim}
            if self.sp_mode:
                out["sequence_parallelism"] = self.sp_mode
            if self.pp > 1:
                out["pp_schedule"] = self.pp_schedule
            return out
        return {"name": self.plugin}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_problem(layout: Layout, spec: ModelSpec, seq: int) -> str | None:
    """Why the layout cannot be built for this model at all (heads, layers, sequence), or None."""
    t, p, s = layout.tp, layout.pp, layout.sp
    if layout.world % (t * p * s):
        return f"tp×pp×sp = {t * p * s} does not divide the world size {layout.world}"
    if spec.num_heads % t:
        return f"tp={t} does not divide the {spec.num_heads} attention heads"
    if spec.num_kv_heads % t and t % spec.num_kv_heads:
        return f"tp={t} and the {spec.num_kv_heads} key/value heads do not divide one another"
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
