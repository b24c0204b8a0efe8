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

A LoRA expert adapter's B ([out, r·E], its experts the innermost dimension) is the exception: a
rank's part is not one range of the full flattening. Its state is assembled whole on every rank
(under ZeRO summed over the expert data-parallel group, where each element has one owner), joined
over the EP group (`ExpertParallelPlan.gather_full`) and written as one full fragment by the first
rank of both groups; loading reads the full tensor and keeps this rank's experts. B is small (the
adapter's rank times the experts times a width), so this costs little.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.optimizer import Fragment, OptimizerFragments, fragments_from_full_state
from phalanx.json_collectives import all_gather_json
from phalanx.launch import collective
from phalanx.shard.state import LocalFragmentReader
from phalanx.zero.checkpoint import zero_fragments


def _joined(plan) -> list[str]:
    """The expert tensors whose state is joined over the EP group rather than shifted (module docstring)."""
    if plan.groups.ep_group is None:
        return []
    return sorted(n for n, rows in plan.adapters.items() if rows.kind == "B")


def _joined_fragments(frags: OptimizerFragments, plan, zero: bool, device) -> list[Fragment]:
    """The full-coordinate fragments of the `_joined` tensors, on the first rank of the EP group and
    of the expert data-parallel group (a collective over the world, then over both groups)."""
    names = _joined(plan)
    if not names:
        return []
    mine = sorted({f.key for f in frags.fragments if f.param in names})
    with collective("ep.optimizer_state_keys"):  # a rank that owns no element of them must still take part
        keys = sorted({k for part in all_gather_json(mine, device=device) for k in part})
    edp = plan.groups.dp_group
    writes = dist.get_rank(plan.groups.ep_group) == 0 and (edp is None or dist.get_rank(edp) == 0)
    out = []
    for name in names:
        shape = plan.adapters[name].local_shape
        for key in keys:
            local = torch.zeros(math.prod(shape), dtype=torch.float32, device=device)
            for f in frags.fragments:
                if f.param == name and f.key == key:
                    local[f.start:f.end] = f.data.to(device, torch.float32)
            if zero and edp is not None and dist.get_world_size(edp) > 1:
                with collective("ep.assemble_adapter_state"):
                    dist.all_reduce(local, group=edp)
            with collective("ep.join_adapter_state"):
                full = plan.gather_full(name, local.view(shape)).reshape(-1).cpu()
            if writes:
                out.append(Fragment(name, key, 0, full.numel(), full))
    return out


def _shifted(frags: OptimizerFragments, plan, keep_dense: bool, keep_experts: bool, zero: bool,
             device) -> OptimizerFragments:
    experts = plan.expert_param_names()
    joined = set(_joined(plan))
    out = OptimizerFragments(scalars=dict(frags.scalars), param_groups=frags.param_groups, extra=frags.extra)
    for name, shape in frags.shapes.items():
        out.shapes[name] = list(plan.full_shape(name, tuple(shape)))
    out.fragments += _joined_fragments(frags, plan, zero, device)
    for f in frags.fragments:
        if f.param in joined:
            continue
        if f.param in experts and keep_experts:
            shift = plan.row_offset(f.param)
            out.fragments.append(Fragment(f.param, f.key, f.start + shift, f.end + shift, f.data))
        elif f.param not in experts and keep_dense:
            out.fragments.append(f)
    return out


def expert_zero_fragments(optimizer, plan, device) -> OptimizerFragments:
    """`ExpertZeroOptimizer`: the dense ZeRO optimizer's fragments and the experts' (shifted to
    full coordinates), in one set whose param groups list both (the groups are aligned)."""
    dense, experts = zero_fragments(optimizer), zero_fragments(optimizer.experts)
    merged = OptimizerFragments(fragments=dense.fragments + experts.fragments,
                                scalars={**dense.scalars, **experts.scalars}, shapes={**dense.shapes, **experts.shapes},
                                extra=dense.extra)
    merged.param_groups = [{**d, "params": d["params"] + e["params"]}
                           for d, e in zip(dense.param_groups, experts.param_groups, strict=True)]
    return _shifted(merged, plan, True, True, zero=True, device=device)


def expert_full_state_fragments(optimizer, plan, dp_group, device) -> OptimizerFragments:
    """`ExpertHybridOptimizer` (zero_stage 0): whole local pieces; dense state from the first
    data-parallel rank, each expert's from the first of its replicas."""
    frags = fragments_from_full_state(optimizer.optim, optimizer.names)
    return _shifted(frags, plan, dist.get_rank(dp_group) == 0, dist.get_rank(plan.groups.dp_group) == 0, zero=False,
                    device=device)


class ExpertRowsReader(LocalFragmentReader):
    """`LocalFragmentReader` (this tensor-parallel rank's coordinates) whose expert tensors are read
    in this EP rank's coordinates too: shifted by their row offset (a LoRA expert B: read whole,
    then cut to this rank's experts)."""

    def __init__(self, reader: Any, tp_plan, ep_plan):
        super().__init__(reader, tp_plan)
        self.ep_plan, self.experts = ep_plan, ep_plan.expert_param_names()
        self.joined = set(_joined(ep_plan))

    def read(self, param: str, key: str, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if param in self.joined:  # the full tensor, then this rank's experts of it
            rows = self.ep_plan.adapters[param]
            shape = self.ep_plan.full_shape(param, rows.local_shape)
            full = super().read(param, key, 0, math.prod(shape), dtype).view(shape)
            return self.ep_plan.local_rows(param, full).reshape(-1)[start:end]
        shift = self.ep_plan.row_offset(param) if param in self.experts else 0
        return super().read(param, key, start + shift, end + shift, dtype)
