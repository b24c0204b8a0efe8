"""HybridParallelPlugin's options, layout checks and process groups; boosting, the pipeline step
and the checkpoint hooks come from the sibling modules (see the package docstring)."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch.distributed as dist
from torch import nn

from phalanx.amp.precision import Precision
from phalanx.booster.plugins.base import Plugin
from phalanx.booster.plugins.hybrid.boost import HybridBoosting
from phalanx.booster.plugins.hybrid.checkpoint import HybridCheckpointIO
from phalanx.booster.plugins.hybrid.pipeline import HybridPipelineStep
from phalanx.booster.state import boosted_optimizer
from phalanx.layout import Layout
from phalanx.mesh import LayoutError, ParallelConfig, build_mesh
from phalanx.pipeline import check_microbatches, virtual_stages_for
from phalanx.sequence import check_sequence_layout


class HybridParallelPlugin(HybridBoosting, HybridPipelineStep, HybridCheckpointIO, Plugin):
    """pp × dp × sp × tp with ZeRO-1/2.

    tp_size: tensor-parallel ranks (split heads, MLP, vocabulary). sp_size: sequence-parallel
    ranks for sequence_parallelism="ulysses" or "ring"; "split_gather" splits the sequence over the
    tp ranks instead (sp_size=1). The data-parallel size is what is left of the world size.
    zero_stage: 0 (all-reduce), 1 or 2 (ZeRO over data × sequence ranks). precision: fp32, bf16,
    fp16 (fp32 masters, loss scaling for fp16). max_norm: clip the norm over all shards.
    gradient_checkpointing: recompute each decoder layer in backward. policy: a
    `phalanx.shard.Policy` for a model family without a built-in one. reduce_bucket_mb,
    overlap_communication, cpu_offload: passed to the ZeRO optimizer (docs/zero.md).
    pp_size: pipeline ranks (docs/pipeline.md); the model is cut into stages by its policy and
    trained with `booster.execute_pipeline` under pp_schedule ("gpipe", "1f1b", "interleaved",
    "zero_bubble") with num_microbatches per batch; virtual_stages: stages per rank for
    "interleaved" (default 2); layers_per_stage: decoder layers of each stage (default: even).
    ep_size: expert-parallel ranks for a mixture-of-experts model (docs/moe.md): the routed experts
    are split over groups of ep_size data(× sequence)-parallel ranks, tokens travel by all-to-all;
    ep_size must divide dp × sp (Ulysses or ring; not split-gather). router_z_loss: ST-MoE's
    z-loss coefficient added to the loss (with the load-balancing loss when the config asks for
    `output_router_logits`).
    """

    name = "hybrid"
    # The sharded model's forward computes the causal-LM loss (vocabulary-parallel, sequence-aware)
    # from `labels`; phalanx.train uses it instead of its fused-head wrapper.
    model_computes_causal_lm_loss = True

    def __init__(self, tp_size: int = 1, sp_size: int = 1, pp_size: int = 1, zero_stage: int = 0,
                 precision: str | Precision = "fp32", sequence_parallelism: str | None = None, max_norm: float | None = None,
                 gradient_checkpointing: bool = False, policy=None, reduce_bucket_mb: float = 25.0,
                 overlap_communication: bool = True, cpu_offload: bool = False, num_microbatches: int = 1,
                 pp_schedule: str = "1f1b", virtual_stages: int | None = None,
                 layers_per_stage: list[int] | None = None, ep_size: int = 1, router_z_loss: float = 0.0):
        super().__init__(precision, max_norm)
        if zero_stage not in (0, 1, 2):
            raise LayoutError(f"zero_stage={zero_stage} must be 0, 1 or 2 (stage 3 shards parameters: FSDPPlugin)")
        self.parallel = ParallelConfig(dp=-1, tp=tp_size, pp=pp_size, sp=sp_size, zero_stage=zero_stage,
                                       microbatches=num_microbatches)
        self.parallel.validate()
        self.tp_size, self.sp_size, self.pp_size, self.zero_stage = tp_size, sp_size, pp_size, zero_stage
        self.pp_schedule, self.num_microbatches, self.layers_per_stage = pp_schedule, num_microbatches, layers_per_stage
        self.virtual_stages = 1
        if pp_size > 1:
            self.virtual_stages = virtual_stages_for(pp_schedule, virtual_stages)
            check_microbatches(pp_schedule, pp_size, num_microbatches)
            if sequence_parallelism in ("ulysses", "ring"):
                raise LayoutError(f"sequence_parallelism={sequence_parallelism!r} is not combined with pipeline "
                                  f"parallelism (pp_size={pp_size}); use 'split_gather' (on the tp ranks) or pp_size=1")
        self.sequence_parallelism = sequence_parallelism
        self.gradient_checkpointing = gradient_checkpointing
        self.policy = policy
        self.zero_options = dict(reduce_bucket_mb=reduce_bucket_mb, overlap_communication=overlap_communication,
                                 cpu_offload=cpu_offload)
        check_sequence_layout(sequence_parallelism, sp=sp_size, tp=tp_size)
        self.ep_size, self.router_z_loss = ep_size, router_z_loss
        self.ep_plan = None  # the ExpertParallelPlan of the boosted model (boost.py)
        if ep_size < 1:
            raise LayoutError(f"ep_size={ep_size} must be at least 1")
        if ep_size > 1 and sequence_parallelism == "split_gather":
            raise LayoutError(f"ep_size={ep_size} is not combined with split-gather sequence parallelism (it cuts the "
                              f"sequence over the tp ranks, which run the expert block on the same tokens): use "
                              f"sequence_parallelism='ulysses' with sp_size > 1, or no sequence parallelism")

    def describe(self) -> str:
        mode = f", sp_mode={self.sequence_parallelism}" if self.sequence_parallelism else ""
        pp = (f"pp={self.pp_size} ({self.pp_schedule}, {self.num_microbatches} microbatches), "
              if self.pp_size > 1 else "")
        ep = f", ep={self.ep_size}" if self.ep_size > 1 else ""
        return (f"hybrid(precision={self.precision.name}, {pp}dp={self.dp_size}{ep}, sp={self.sp_size}, "
                f"tp={self.tp_size}, zero={self.zero_stage}{mode})")

    def plan_layout(self, world: int) -> tuple[Layout, dict]:
        layout = Layout("hybrid", world, zero_stage=self.zero_stage, tp=self.tp_size, pp=self.pp_size,
                        sp=self.sp_size, sp_mode=self.sequence_parallelism, pp_schedule=self.pp_schedule,
                        checkpointing=bool(self.gradient_checkpointing),
                        offload_optim=bool(self.zero_options.get("cpu_offload", False)))
        return layout, {"dtype": self.precision, "bucket_mb": self.zero_options.get("reduce_bucket_mb", 25.0),
                        "microbatches": self.num_microbatches or 1}

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        super().setup()
        self.parallel = self.parallel.resolve(dist.get_world_size())
        self.mesh = build_mesh(self.parallel, self.device.type)
        self.tp_group = self.mesh.get_group("tp")
        self.sp_group = self.mesh.get_group("sp")
        self.dp_group = self.mesh.get_group("dp")
        self.dp_size = self.parallel.dp
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.dp_sp_group = self._flat_group(("dp", "sp"))
        self.pp_group = self.mesh.get_group("pp")
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.sp_rank = self.mesh.get_local_rank("sp")
        # the first and last pipeline ranks of each (dp, sp, tp) coordinate: tied embeddings' group
        self.tie_group = self._flat_group(("pp",), ends_only=True) if self.pp_size > 1 else None
        self.expert_groups = None
        if self.ep_size > 1:
            from phalanx.shard.expert_parallel import expert_groups_over
            # the experts split over the ranks that see different tokens: dp x sp (each sequence-parallel
            # rank routes its own shard of the sequence); sp = 1: the data-parallel ranks
            data = self.dp_size * self.sp_size
            if data % self.ep_size:
                sp = f" x sp {self.sp_size}" if self.sp_size > 1 else ""
                what = "data x sequence-parallel size" if self.sp_size > 1 else "data-parallel size"
                raise LayoutError(f"ep_size={self.ep_size} must divide the {what} {data} "
                                  f"(world {dist.get_world_size()} / (tp {self.tp_size} x pp {self.pp_size}){sp}): "
                                  f"choose ep_size in {[d for d in range(1, data + 1) if data % d == 0]}")
            blocks = self.mesh.mesh.permute(0, 3, 1, 2).reshape(-1, data).tolist()  # every dp x sp group, dp-major
            self.expert_groups = expert_groups_over(blocks, self.ep_size)

    def _flat_group(self, dims: tuple[str, ...], ends_only: bool = False):
        """One process group over the ranks that differ only in `dims` (every rank creates every
        such group, in the same order, as torch.distributed requires); `ends_only`: only the first
        and last of those ranks (None for the ranks in between)."""
        names = ("pp", "dp", "sp", "tp")
        grid = self.mesh.mesh
        keep = [i for i, d in enumerate(names) if d not in dims]
        flat = [i for i, d in enumerate(names) if d in dims]
        blocks = grid.permute(*keep, *flat).reshape(-1, math.prod(grid.shape[i] for i in flat))
        mine = None
        for ranks in blocks.tolist():
            ranks = [ranks[0], ranks[-1]] if ends_only else ranks
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None, optimizer) -> Iterator[None]:
        optimizer = optimizer or boosted_optimizer(model)
        if optimizer is None or not hasattr(optimizer, "no_sync"):
            yield  # stage 0 reduces at step: accumulation needs nothing
            return
        with optimizer.no_sync():
            yield

    def step_metrics(self) -> dict:
        """What the training loop adds to a step's metrics record: with expert parallelism, the
        tokens each expert received in the last forward, per expert block of this rank's stages
        (summed over the data × sequence-parallel ranks: the global batch's load; `expert_tokens`, a
        list per block) and the most loaded expert's share over an even share (`expert_load_max`,
        1.0 is perfectly balanced). A collective over that group: every rank calls it."""
        if self.ep_plan is None:
            return {}
        counts = [c.tolist() for c in self.ep_plan.token_counts().values()]
        return {"expert_tokens": counts,
                "expert_load_max": max(max(c) * len(c) / max(sum(c), 1) for c in counts)}

    def clip_grad_norm(self, optimizer, max_norm: float) -> float:
        return optimizer.clip_grad_norm(max_norm)
