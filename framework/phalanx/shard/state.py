"""Checkpoints of a tensor-parallel model in layout-independent form.

- `full_state_dict`: the Hugging Face state dict (full shapes, original names; fused GPT-2 QKV
  put back in [q | k | v] order, vocabulary padding removed), gathered over the tensor-parallel
  group; `full_tensor` does it for one tensor (the streamed save gathers one at a time).
  `local_state_dict`: the inverse, this rank's pieces of a full state dict.
- `to_full_fragments`: optimizer-state fragments written in this rank's local coordinates (by
  `phalanx.zero.checkpoint.zero_fragments` or `fragments_from_full_state`) turned into ranges of the
  flattened *full* parameter, the format every plugin reads. The tensor-parallel ranks send their
  pieces of one ZeRO range to the first of them, which maps them to full coordinates
  (`ShardSpec.runs`) and merges adjacent runs: a row-parallel weight (split along dim 1) then
  gives whole rows as one fragment, and only the first and last, partially owned rows as pieces.
- `LocalFragmentReader`: a `FragmentReader` seen in this rank's local coordinates, so the ZeRO
  and plain loaders read a checkpoint of any layout unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.optimizer import Fragment, FragmentReader, OptimizerFragments
from phalanx.launch import collective
from phalanx.shard.tensor_parallel import TPPlan


def _gather_pieces(local: torch.Tensor, plan: TPPlan) -> list[torch.Tensor]:
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(plan.size)]
    with collective("tp.gather_state"):
        dist.all_gather(parts, local, group=plan.group)
    return parts


def gather_full(name: str, local: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """The full tensor `name` on `local`'s device, gathered over the tensor-parallel group (a
    collective over that group) when the plan splits it, else `local` itself."""
    spec = plan.spec(name)
    if spec.is_sharded and plan.size > 1:
        return spec.unshard(_gather_pieces(local, plan), plan.params[name].full_shape)
    return local


def full_tensor(name: str, local: torch.Tensor, plan: TPPlan) -> torch.Tensor:
    """The full tensor `name` (on the CPU, not sharing memory with `local`) from this rank's piece
    `local`: gathered over the tensor-parallel group when the plan splits it (a collective over
    that group: every rank calls it for the same name), else a copy. Holds one tensor's pieces."""
    full = gather_full(name, local, plan)
    if full is local:
        return local.detach().cpu().clone()
    full = full.detach().cpu()
    # a vocabulary cut of the padded gather is a view of it: keep only its own elements
    return full.clone() if full.untyped_storage().nbytes() > full.numel() * full.element_size() else full


def full_state_dict(model: torch.nn.Module, plan: TPPlan, values: dict[str, torch.Tensor] | None = None,
                    ) -> dict[str, torch.Tensor]:
    """Full tensors (on the CPU) for every key of `model.state_dict()`; `values` overrides the
    local value of a parameter (e.g. the fp32 master of a bf16 model, which ZeRO hands over on the
    CPU: it is gathered on the device of the model's own tensor, as NCCL needs). A collective over
    the tensor-parallel group; every rank gets the whole dict."""
    values = values or {}
    return {name: full_tensor(name, values[name].to(tensor.device) if name in values else tensor, plan)
            for name, tensor in model.state_dict().items()}


def local_state_dict(plan: TPPlan, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's piece of every tensor of a full state dict."""
    return {name: plan.spec(name).shard(t, plan.rank, plan.size) for name, t in state.items()}


def to_full_fragments(frags: OptimizerFragments, plan: TPPlan, *, device: torch.device,
                      write: bool = True) -> OptimizerFragments:
    """Collective over the tensor-parallel group, carried on `device` (the run's device: NCCL
    takes only GPU tensors; the fragments themselves stay on the CPU). `write=False` on ranks
    whose fragments another data-parallel rank already writes (they still take part in the
    exchange)."""
    out = OptimizerFragments(scalars=dict(frags.scalars), param_groups=frags.param_groups, extra=frags.extra)
    out.shapes = {name: list(plan.params[name].full_shape) if name in plan.params else shape
                  for name, shape in frags.shapes.items()}
    split = [f for f in frags.fragments if plan.spec(f.param).is_sharded and plan.size > 1]
    whole = [f for f in frags.fragments if not (plan.spec(f.param).is_sharded and plan.size > 1)]
    if plan.rank == 0:
        out.fragments.extend(whole)
    if split:
        flat = torch.cat([f.data.reshape(-1).float() for f in split]).to(device)
        pieces = [torch.empty_like(flat) for _ in range(plan.size)]
        with collective("tp.gather_optimizer_state"):
            dist.all_gather(pieces, flat, group=plan.group)
        if plan.rank == 0:
            out.fragments.extend(_merge_split(split, [p.cpu() for p in pieces], plan))
    if not write or plan.rank != 0:
        out.fragments, out.scalars = [], {}
    return out


def _merge_split(split: list[Fragment], pieces: list[torch.Tensor], plan: TPPlan) -> list[Fragment]:
    result: list[Fragment] = []
    offset = 0
    for f in split:
        n = f.end - f.start
        shard = plan.params[f.param]
        runs: list[tuple[int, torch.Tensor]] = []
        for r in range(plan.size):
            data = pieces[r][offset:offset + n]
            for l_start, f_start, length in shard.spec.runs(shard.full_shape, r, plan.size).pieces(f.start, f.end):
                runs.append((f_start, data[l_start - f.start:l_start - f.start + length]))
        offset += n
        runs.sort(key=lambda x: x[0])
        merged: list[tuple[int, list[torch.Tensor], int]] = []
        for start, data in runs:
            if merged and merged[-1][2] == start:
                merged[-1][1].append(data)
                merged[-1] = (merged[-1][0], merged[-1][1], start + data.numel())
            else:
                merged.append((start, [data], start + data.numel()))
        for start, datas, end in merged:
            result.append(Fragment(f.param, f.key, start, end, torch.cat(datas) if len(datas) > 1 else datas[0]))
    return result


class LocalFragmentReader:
    """`FragmentReader`'s surface in this tensor-parallel rank's local coordinates: `read(name, key,
    start, end)` returns elements [start, end) of the flattened *local piece* (zeros for padding)."""

    def __init__(self, reader: FragmentReader, plan: TPPlan):
        self.reader = reader
        self.plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reader, name)

    @property
    def param_groups(self):
        return self.reader.param_groups

    @property
    def extra(self):
        return self.reader.extra

    def read(self, param: str, key: str, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        spec = self.plan.spec(param)
        if not spec.is_sharded or self.plan.size == 1:
            return self.reader.read(param, key, start, end, dtype)
        shard = self.plan.params[param]
        pieces = spec.runs(shard.full_shape, self.plan.rank, self.plan.size).pieces(start, end)
        out = torch.zeros(end - start, dtype=dtype)
        if not pieces:
            return out
        lo = min(p[1] for p in pieces)
        hi = max(p[1] + p[2] for p in pieces)
        span = self.reader.read(param, key, lo, hi, dtype)
        for l_start, f_start, length in pieces:
            out[l_start - start:l_start - start + length] = span[f_start - lo:f_start - lo + length]
        return out
