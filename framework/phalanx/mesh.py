"""Parallel layout: a `ParallelConfig` (dp, tp, pp, sp, zero stage, microbatches) becomes a
`DeviceMesh` whose dimensions are named ``("pp", "dp", "sp", "tp")``, outermost first.

The order puts tensor parallelism innermost (ranks that talk most sit closest: same node), then
sequence, data and pipeline parallelism, the order torchtitan and Megatron use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "sp", "tp")


class LayoutError(ValueError):
    """The parallel layout does not fit the world size or the model."""


@dataclass
class ParallelConfig:
    """How ranks are split. ``dp=-1`` means: whatever is left of the world size."""

    dp: int = -1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    zero_stage: int = 0
    microbatches: int = 1

    def validate(self) -> None:
        for name in ("tp", "pp", "sp", "microbatches"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name}={getattr(self, name)} must be at least 1")
        if self.dp == 0 or self.dp < -1:
            raise LayoutError(f"parallel.dp={self.dp} must be -1 (infer) or at least 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"parallel.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Fill in dp and check that dp × pp × sp × tp equals the world size."""
        self.validate()
        model_parallel = self.tp * self.pp * self.sp
        dp = self.dp
        if dp == -1:
            if world_size % model_parallel:
                below = model_parallel * (world_size // model_parallel)
                above = below + model_parallel
                fits = f"{below} or {above}" if below else f"{above}"
                raise LayoutError(
                    f"world size {world_size} is not divisible by tp × pp × sp = {self.tp} × {self.pp} × {self.sp} "
                    f"= {model_parallel}; start {fits} processes, or change the layout"
                )
            dp = world_size // model_parallel
        product = dp * model_parallel
        if product != world_size:
            raise LayoutError(
                f"parallel layout dp × pp × sp × tp = {dp} × {self.pp} × {self.sp} × {self.tp} = {product} "
                f"but the world size is {world_size}; make the product equal the number of processes "
                f"(or set dp=-1 to infer it)"
            )
        return ParallelConfig(dp=dp, tp=self.tp, pp=self.pp, sp=self.sp,
                              zero_stage=self.zero_stage, microbatches=self.microbatches)

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "sp": self.sp, "tp": self.tp}


def build_mesh(config: ParallelConfig | None = None, device_type: str | None = None) -> DeviceMesh:
    """A DeviceMesh over all ranks with dims ("pp", "dp", "sp", "tp"). Needs `launch()` first."""
    if not dist.is_initialized():
        raise RuntimeError("call phalanx.launch() before building a device mesh")
    world_size = dist.get_world_size()
    config = (config or ParallelConfig()).resolve(world_size)
    if device_type is None:
        from phalanx.launch import context
        device_type = context().device.type
    shape = tuple(config.sizes[d] for d in MESH_DIMS)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(device_type: str | None = None) -> DeviceMesh:
    """A 1-D mesh named "dp" over every rank (what DDP, FSDP and ZeRO plugins use)."""
    if not dist.is_initialized():
        raise RuntimeError("call phalanx.launch() before building a device mesh")
    if device_type is None:
        from phalanx.launch import context
        device_type = context().device.type
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))
