"""Optimizer state of an expert-parallel model in the shared fragment format (ranges of each
flattened *full* parameter, `phalanx.checkpoint.optimizer`), so an EP checkpoint loads into any
layout and any layout's into EP.

A rank's expert tensor holds rows [j·E/ep, (j+1)·E/ep) of the full one: its flattened elements are
one contiguous range of the full flattening, starting at `ExpertParallelPlan.row_offset`. Saving
shifts the expert fragments by it; loading reads through `ExpertRowsReader`, which shifts back.
Which rank writes: under ZeRO every rank writes what it owns (each element of the experts has one
owner in its expert data-parallel group, and the EP ranks hold different experts); without ZeRO
the first rank of the data-parallel group writes the dense state and the first rank of each
expert data-parallel group its experts'.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.optimizer import Fragment, OptimizerFragments, fragments_from_full_state
from phalanx.shard.state import LocalFragmentReader
from phalanx.zero.checkpoint import zero_fragments


def _shifted(frags: OptimizerFragments, plan, keep_dense: bool, keep_experts: bool) -> OptimizerFragments:
    experts = plan.expert_param_names()
    out = OptimizerFragments(scalars=dict(frags.scalars), param_groups=frags.param_groups, extra=frags.extra)
    for name, shape in frags.shapes.items():
        out.shapes[name] = list(plan.full_shape(name, tuple(shape)))
    for f in frags.fragments:
        if f.param in experts and keep_experts:
            shift = plan.row_offset(f.param)
            out.fragments.append(Fragment(f.param, f.key, f.start + shift, f.end + shift, f.data))
        elif f.param not in experts and keep_dense:
            out.fragments.append(f)
    return out


def expert_zero_fragments(optimizer, plan) -> OptimizerFragments:
    """`ExpertZeroOptimizer`: the dense ZeRO optimizer's fragments and the experts' (shifted to
    full coordinates), in one set whose param groups list both (the groups are aligned)."""
    dense, experts = zero_fragments(optimizer), zero_fragments(optimizer.experts)
    merged = OptimizerFragments(fragments=dense.fragments + experts.fragments,
                                scalars={**dense.scalars, **experts.scalars}, shapes={**dense.shapes, **experts.shapes},
                                extra=dense.extra)
    merged.param_groups = [{**d, "params": d["params"] + e["params"]}
                           for d, e in zip(dense.param_groups, experts.param_groups, strict=True)]
    return _shifted(merged, plan, True, True)


def expert_full_state_fragments(optimizer, plan, dp_group) -> OptimizerFragments:
    """`ExpertHybridOptimizer` (zero_stage 0): whole local pieces; dense state from the first
    data-parallel rank, each expert's from the first of its replicas."""
    frags = fragments_from_full_state(optimizer.optim, optimizer.names)
    return _shifted(frags, plan, dist.get_rank(dp_group) == 0, dist.get_rank(plan.groups.dp_group) == 0)


class ExpertRowsReader(LocalFragmentReader):
    """`LocalFragmentReader` (this tensor-parallel rank's coordinates) whose expert tensors are read
    in this EP rank's coordinates too: shifted by their row offset."""

    def __init__(self, reader: Any, tp_plan, ep_plan):
        super().__init__(reader, tp_plan)
        self.ep_plan, self.experts = ep_plan, ep_plan.expert_param_names()

    def read(self, param: str, key: str, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shift = self.ep_plan.row_offset(param) if param in self.experts else 0
        return super().read(param, key, start + shift, end + shift, dtype)
