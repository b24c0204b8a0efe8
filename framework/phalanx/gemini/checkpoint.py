"""Gemini's model weights and optimizer state in the layout-independent checkpoint formats.

Model: the full fp32 masters, gathered chunk by chunk (a collective), sliced per parameter and
keyed by the unwrapped model's names — the Hugging Face export every plugin writes.

Optimizer: each rank writes, for every parameter part its shard owns, that range of the
flattened parameter for `exp_avg` and `exp_avg_sq` (`phalanx.checkpoint.optimizer.Fragment`),
plus the group's step count as the parameter's `step` scalar — what torch's Adam keeps. Chunks
that are replicated, not sharded, are written by rank 0 only. Loading reads back exactly the
ranges this rank owns now, whatever plugin and world size wrote them.
"""
from __future__ import annotations

import torch

from phalanx.checkpoint.atomic import CheckpointError
from phalanx.checkpoint.optimizer import (Fragment, FragmentReader, OptimizerFragments,
                                          apply_param_group_hyperparams)
from phalanx.gemini.optimizer import GeminiOptimizer

STATES = ("exp_avg", "exp_avg_sq")


def full_master_weights(manager) -> dict[int, torch.Tensor]:
    """{id(param): full fp32 value on the CPU}. A collective: every rank calls it."""
    out = {}
    for chunk in manager.chunks:
        full = manager.gather_master(chunk)
        for slot, p in zip(chunk.layout.slots, chunk.params):
            out[id(p)] = full[slot.offset:slot.end].view(p.shape).clone()
    return out


def gemini_fragments(opt: GeminiOptimizer, names: dict[int, str]) -> OptimizerFragments:
    out = OptimizerFragments()
    for gi, group in enumerate(opt.optim.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["params"] = [names[id(p)] for p in group["params"]]
        out.param_groups.append(hyper)
        for p in group["params"]:
            out.shapes[names[id(p)]] = list(p.shape)
            if opt.steps[gi]:
                out.scalars[names[id(p)]] = {"step": float(opt.steps[gi])}
    m = opt.manager
    for chunk in m.chunks:
        if not chunk.sharded and m.dp_rank != 0:
            continue
        owned = [(k, a, b) for k, a, b in chunk.owned()
                 if id(chunk.params[k]) in opt.group_of and opt.steps[opt.group_of[id(chunk.params[k])]]]
        if not owned:
            continue
        with m.optim_state(chunk):  # a disk chunk's state is read from its file
            for k, a, b in owned:
                p = chunk.params[k]
                start = chunk.layout.to_shard(chunk.rank, chunk.layout.slots[k].offset + a)
                for key in STATES:
                    data = getattr(chunk, key)[start:start + (b - a)].detach().float().cpu().clone()
                    out.fragments.append(Fragment(names[id(p)], key, a, b, data))
    return out


def load_gemini_fragments(opt: GeminiOptimizer, names: dict[int, str], reader: FragmentReader) -> None:
    apply_param_group_hyperparams(opt.optim, reader.param_groups)
    for gi, group in enumerate(opt.optim.param_groups):
        steps = [reader.scalars(names[id(p)]).get("step", 0.0) for p in group["params"] if reader.has(names[id(p)])]
        missing = [names[id(p)] for p in group["params"] if not reader.has(names[id(p)])]
        if missing:
            raise CheckpointError(f"optimizer checkpoint has no state for {missing[0]!r}: it was saved for another "
                                  "model or another param-group layout")
        opt.steps[gi] = int(max(steps, default=0.0))
    with torch.no_grad():
        for chunk in opt.manager.chunks:
            with opt.manager.optim_state(chunk, write=True):  # a disk chunk's file is rewritten
                chunk.exp_avg.zero_()
                chunk.exp_avg_sq.zero_()
                for k, a, b in chunk.owned():
                    p = chunk.params[k]
                    if id(p) not in opt.group_of:
                        continue
                    name = names[id(p)]
                    start = chunk.layout.to_shard(chunk.rank, chunk.layout.slots[k].offset + a)
                    for key in STATES:
                        if key in reader.state_keys(name):
                            getattr(chunk, key)[start:start + (b - a)].copy_(reader.read(name, key, a, b))
