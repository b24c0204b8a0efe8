"""The parallel layout of a run as the planner and the Booster plugins name it (`Layout`).

It lives below both: `phalanx.plan` estimates a Layout, and each plugin says its own
(`Plugin.plan_layout`) without importing the planner. Imports nothing from phalanx."""
from __future__ import annotations

import dataclasses


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

