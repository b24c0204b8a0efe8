"""ZeRO optimizer state as layout-independent fragments (see `phalanx.checkpoint.optimizer`).

Saving: each rank writes, for every parameter it owns part of, the owned range of the flattened
parameter for each elementwise state (`exp_avg`, …): a parameter that straddles ranks yields
one fragment per rank. Scalar state (Adam's `step`) is per param group here — one flat shard per
group — and is written for every parameter of the group, as a whole-parameter optimizer would.

Loading: each rank reads exactly the ranges it owns *now* with `FragmentReader.read`, whatever
layout wrote them: ZeRO with another world size, DDP (whole parameters from rank 0), FSDP.
"""
from __future__ import annotations

import torch

from phalanx.checkpoint.atomic import CheckpointError
from phalanx.checkpoint.optimizer import (Fragment, FragmentReader, OptimizerFragments,
                                          apply_param_group_hyperparams)
from phalanx.amp.fused_step import step_device_for
from phalanx.zero.optimizer import ZeroOptimizer


def _is_elementwise_state(value, shard_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == shard_numel


def _is_scalar_state(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def zero_fragments(zopt: ZeroOptimizer) -> OptimizerFragments:
    """This rank's fragments of the optimizer state, plus hyper-parameters (the Booster adds the
    loss scaler's state)."""
    out = OptimizerFragments()
    for group, flat in zip(zopt.optim.param_groups, zopt.flat_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        params = flat.params if flat is not None else []
        hyper["params"] = [zopt.names[id(p)] for p in params]
        out.param_groups.append(hyper)
        if flat is None:
            continue
        state = zopt.optim.state.get(flat.master, {})
        scalars = {k: float(v) for k, v in state.items() if _is_scalar_state(v)}
        for p in flat.params:
            name = zopt.names[id(p)]
            out.shapes[name] = list(p.shape)
            if scalars:
                out.scalars[name] = dict(scalars)
        for slot, a, b in flat.layout.owned_slots(zopt.rank):
            name = zopt.names[id(flat.params[slot.index])]
            start = flat.layout.to_shard(zopt.rank, slot.offset + a)
            for key, value in state.items():
                if _is_elementwise_state(value, flat.layout.shard_numel):
                    data = value.detach()[start:start + (b - a)].float().cpu()
                    out.fragments.append(Fragment(name, key, a, b, data))
    return out


def load_zero_fragments(zopt: ZeroOptimizer, reader: FragmentReader) -> None:
    """Rebuild this rank's shard of the optimizer state from a checkpoint of any layout."""
    apply_param_group_hyperparams(zopt.optim, reader.param_groups)
    for group, flat in zip(zopt.optim.param_groups, zopt.flat_groups):
        if flat is None:
            continue
        names = [zopt.names[id(p)] for p in flat.params]
        for name in names:
            if not reader.has(name):
                raise CheckpointError(f"optimizer checkpoint has no state for {name!r}: it was saved for another "
                                      "model or another param-group layout")
        keys = sorted({k for n in names for k in reader.state_keys(n)})
        state: dict[str, torch.Tensor] = {}
        for key in keys:
            shard = torch.zeros(flat.layout.shard_numel, dtype=torch.float32, device=flat.host)
            for slot, a, b in flat.layout.owned_slots(zopt.rank):
                name = names[slot.index]
                if key not in reader.state_keys(name):
                    continue  # e.g. DDP never stepped this parameter: its state starts at zero
                start = flat.layout.to_shard(zopt.rank, slot.offset + a)
                shard[start:start + (b - a)] = reader.read(name, key, a, b).to(flat.host)
            state[key] = shard
        # One flat shard per group has one value of each scalar (Adam's step); whole-parameter
        # layouts may hold different values when some parameters were skipped: take the largest.
        scalars: dict[str, float] = {}
        for name in names:
            for key, value in reader.scalars(name).items():
                scalars[key] = max(value, scalars.get(key, value))
        scalar_device = step_device_for(zopt.optim, group, flat.host)
        for key, value in scalars.items():
            state[key] = torch.tensor(value, dtype=torch.float32, device=scalar_device)
        zopt.optim.state.pop(flat.master, None)
        if state:
            zopt.optim.state[flat.master] = state
