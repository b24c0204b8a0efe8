"""HybridParallelPlugin's checkpoint hooks: the full model in Hugging Face layout (gathered over
tp, and over pp from each stage's rank) and optimizer fragments keyed by full-parameter ranges,
so any plugin and layout loads them (`phalanx.shard.state`).

The full model streams (`iter_full_model_state`), one tensor at a time, in an order every rank
computes alike (the model's parameter order, `_Entry.order`). For each tensor, the ranks of the
pipeline stage that holds it gather its fp32 master over the data × sequence ranks (ZeRO) and its
tensor-parallel pieces: that tensor only. A tensor of another stage is sent by that stage's
(dp0, sp0, tp0) rank to the writer (global rank 0) with a point-to-point send of the tensor; the
writer knows its name, full shape and dtype from a manifest that rank sent once per save (JSON
text in a uint8 tensor). A tied embedding is written once, from the first stage. No pickle on the
way; the writer holds one tensor at a time (plus what `save_hf_model` buffers for its file).

An asynchronous checkpoint keeps a copy of the model until its background write; that copy is
spread over every rank instead (`spread_model_copy`): each tensor is kept by one rank, chosen alike
on every rank (`phalanx.checkpoint.hf.SpreadOwners`), about 1/N of the model each, and each rank
writes its own file of the sharded export.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster.plugins.base import unwrap_model
from phalanx.booster.plugins.hybrid.boost import hybrid_state
from phalanx.booster.state import BoostedState
from phalanx.checkpoint.hf import SpreadModelCopy, SpreadOwners, names_not_saved
from phalanx.checkpoint.optimizer import (FragmentReader, OptimizerFragments, fragments_from_full_state,
                                          load_full_state_into)
from phalanx.json_collectives import all_gather_json, recv_json, send_json
from phalanx.launch import collective
from phalanx.pipeline import tie_aliases
from phalanx.pipeline.params import with_tied_aliases
from phalanx.shard.optim import HybridZeroOptimizer
from phalanx.shard.state import LocalFragmentReader, full_tensor, local_state_dict, to_full_fragments
from phalanx.zero.checkpoint import load_zero_fragments, zero_fragments

WRITER = 0  # the global rank that writes the export (`phalanx.booster.booster.write_streamed_model`)


@dataclass(frozen=True)
class _Entry:
    """One tensor of the full state dict, as every rank that takes part in its save knows it."""

    name: str                       # a tied parameter's first name
    shape: tuple[int, ...]          # full (unsharded) shape
    dtype: torch.dtype              # of the saved value (a parameter's fp32 master when there is one)
    order: tuple[int, int, int]     # (position in the model's parameters, pipeline rank, position there)

    def to_json(self) -> list:
        return [self.name, list(self.shape), str(self.dtype).removeprefix("torch."), list(self.order)]

    @classmethod
    def from_json(cls, item: list) -> "_Entry":
        name, shape, dtype, order = item
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"save manifest: {name} has unknown dtype {dtype!r}")
        return cls(name, tuple(shape), getattr(torch, dtype), tuple(order))


class _Masters:
    """The fp32 master value of a parameter, when the optimizer keeps one: under ZeRO gathered
    over the data × sequence group for that parameter only (a collective), else the stage-0
    optimizer's master copy."""

    def __init__(self, optimizer, hf: nn.Module, device: torch.device):
        self.device = device
        self.slots: dict[str, tuple] = {}
        self.copies: dict[str, torch.Tensor] = {}
        if optimizer is None:
            return
        params = dict(hf.named_parameters(remove_duplicate=False))
        if isinstance(optimizer, HybridZeroOptimizer):
            where = optimizer.master_slots()
            self.slots = {n: where[id(p)] for n, p in params.items() if id(p) in where}
        else:
            self.copies = {n: optimizer.master_of[id(p)].detach() for n, p in params.items()
                           if id(p) in optimizer.master_of}

    def dtype(self, name: str, tensor: torch.Tensor) -> torch.dtype:
        if name in self.slots:
            return torch.float32
        return self.copies[name].dtype if name in self.copies else tensor.dtype

    def value(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.slots:
            group, slot = self.slots[name]
            return group.gather_master_slot(slot).view(tensor.shape).to(self.device)
        return self.copies.get(name, tensor)


def _fused_experts(hf: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A mixture-of-experts checkpoint written with one tensor per expert (transformers'
    `save_pretrained`) in the fused layout of the model's modules (`phalanx.models.moe`)."""
    from phalanx.models.moe import fuse_checkpoint_experts
    from phalanx.models.registry import family_of

    try:
        names = family_of(hf.config).names.experts
    except (AttributeError, ValueError):
        return state_dict
    return state_dict if names is None else fuse_checkpoint_experts(state_dict, names, hf.state_dict().keys())


class HybridCheckpointIO:
    """The checkpoint hooks of HybridParallelPlugin (plugin.py), whose ranks and groups they read."""

    # ------------------------------------------------------------------ the full model, streamed
    def iter_full_model_state(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, full CPU tensor)`, one at a time (see the module docstring). A collective: every
        rank walks it to the end. The writer (global rank 0) gets every tensor of the model; the
        other ranks get those of their own stages."""
        boosted = hybrid_state(model)
        hf = unwrap_model(model)
        masters = _Masters(boosted.optimizer, hf, self.device)
        local = self._local_entries(boosted, hf, masters)
        is_writer = dist.get_rank() == WRITER
        stage_head = self.pp_rank > 0 and not (self.dp_rank or self.sp_rank or self.tp_rank)
        remote: list[tuple[_Entry, int]] = []  # the writer: tensors other stages send, and from where
        if self.pp_size > 1:
            with collective("pp.save_manifest"):
                if is_writer:
                    remote = self._receive_manifests()
                elif stage_head:
                    send_json([e.to_json() for e, _, _, send in local if send], WRITER, self.device)
        work = [(e, (name, tensor, send)) for e, name, tensor, send in local] + [(e, src) for e, src in remote]
        for entry, source in sorted(work, key=lambda item: item[0].order):
            if isinstance(source, int):  # the writer, a tensor of another stage
                value = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                with collective("pp.recv_state"):
                    dist.recv(value, source)
                value = value.cpu()
            else:
                name, tensor, send = source
                value = self._full_value(boosted, masters, name, tensor)
                if send and stage_head:
                    with collective("pp.send_state"):
                        dist.send(value.to(self.device).contiguous(), WRITER)
            yield entry.name, value
            del value

    def _full_value(self, boosted: BoostedState, masters: _Masters, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full CPU value of one tensor: its master, gathered over the EP group (an expert
        tensor under ep_size > 1) and over tp. A collective over the groups that hold pieces."""
        value = masters.value(name, tensor)
        if self.ep_plan is not None:
            value = self.ep_plan.gather_full(name, value.to(self.device))
        return full_tensor(name, value, boosted.plan)

    def _local_entries(self, boosted: BoostedState, hf: nn.Module, masters: _Masters
                       ) -> list[tuple[_Entry, str, torch.Tensor, bool]]:
        """This rank's tensors (its stages'), each under its first name once: its entry, its name
        and value here (the last stage holds a tied embedding under its second name), and whether
        its stage sends it to the writer (not the last stage's copy of a tied embedding: the first
        stage's is written)."""
        aliases = {**tie_aliases(hf), **boosted.tied_aliases}
        position = {name: i for i, name in enumerate(boosted.plan.params)}
        holds_first = boosted.pipeline is None or any(s.is_first for s in boosted.pipeline.stages)
        out, seen, last = [], set(), -1
        for i, (name, tensor) in enumerate(hf.state_dict().items()):
            first = aliases.get(name, name)
            if first in seen:
                continue
            seen.add(first)
            last = position.get(first, last)  # a buffer goes after the parameter before it
            entry = _Entry(first, tuple(boosted.plan.full_shape(name, tensor)), masters.dtype(name, tensor),
                           (last, self.pp_rank, i))
            out.append((entry, name, tensor, holds_first or first not in boosted.tied))
        return out

    def _receive_manifests(self) -> list[tuple[_Entry, int]]:
        """The writer: every other stage's list of the tensors it will send, with its global rank."""
        remote = []
        for r in range(1, self.pp_size):
            src = dist.get_global_rank(self.pp_group, r)
            remote += [(_Entry.from_json(item), src) for item in recv_json(src, self.device)]
        return remote

    # ------------------------------------------------------------------ an asynchronous save's copy
    # `Plugin.spreads_model_copy`: the stream reaches the writer only (`full_state_on_every_rank`
    # stays False), so the spread copy moves each tensor to its owner itself.
    spreads_model_copy = True

    def spread_model_copy(self, model: nn.Module) -> SpreadModelCopy:
        """The copy of the full model that an asynchronous checkpoint keeps until its background
        write, spread over every rank (about 1/N each, never the whole model on one rank), so that
        each rank writes its own file of the sharded export (`hf.write_spread_model`). A collective.

        Every rank learns every tensor's entry (with pp, each stage's (dp0, sp0, tp0) rank adds its
        stage's list to one JSON all-gather), then walks them in the stream's order, choosing each
        one's owner with `SpreadOwners` (the same choice on every rank, nothing more to exchange;
        the ranks of the stage holding the tensor are preferred). The stage's ranks gather the
        tensor as the stream does; an owner among them keeps its copy, an owner in another stage
        receives it point to point from the stage's rank with its own (dp, sp, tp) coordinates."""
        boosted = hybrid_state(model)
        hf = unwrap_model(model)
        masters = _Masters(boosted.optimizer, hf, self.device)
        skipped = names_not_saved(hf)  # a tied parameter's later names (never an entry's), ignored keys
        mine = [(e, name, tensor) for e, name, tensor, send in self._local_entries(boosted, hf, masters)
                if send and e.name not in skipped]
        local = {e.name: (name, tensor) for e, name, tensor in mine}
        entries = self._spread_entries([e for e, _, _ in mine])
        grid = self.mesh.mesh  # global ranks by (pp, dp, sp, tp)
        stages = [grid[p].flatten().tolist() for p in range(self.pp_size)]
        coords = {int(grid[idx]): idx for idx in itertools.product(*map(range, grid.shape))}
        rank, world = dist.get_rank(), dist.get_world_size()
        total = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
        owners = SpreadOwners(world, cap=-(-total // world))
        kept: dict[str, torch.Tensor] = {}
        for entry in entries:
            stage = entry.order[1]
            owner = owners.assign(entry.name, entry.shape, entry.dtype, holders=stages[stage])
            sender = int(grid[(stage, *coords[owner][1:])])  # when the owner is in another stage
            if stage == self.pp_rank:
                name, tensor = local[entry.name]
                value = self._full_value(boosted, masters, name, tensor)  # a fresh CPU tensor
                if owner == rank:
                    kept[entry.name] = value.contiguous()
                elif rank == sender and owner not in stages[stage]:
                    with collective("pp.spread_send"):
                        dist.send(value.to(self.device).contiguous(), owner)
                del value
            elif owner == rank:
                value = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                with collective("pp.spread_recv"):
                    dist.recv(value, sender)
                kept[entry.name] = value.cpu()
        return owners.copy(kept)

    def _spread_entries(self, mine: list[_Entry]) -> list[_Entry]:
        """Every tensor the export holds, in the stream's order, on every rank: without pp every
        rank has them all; with pp each stage's (dp0, sp0, tp0) rank contributes its stage's."""
        if self.pp_size > 1:
            head = not (self.dp_rank or self.sp_rank or self.tp_rank)
            with collective("pp.spread_manifest"):
                parts = all_gather_json([e.to_json() for e in mine] if head else None, device=self.device)
            mine = [_Entry.from_json(item) for part in parts if part for item in part]
        return sorted(mine, key=lambda e: e.order)

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`iter_full_model_state` as a dict (complete on the writer). Without pp, a tied
        parameter also appears under its second name, as in the model's own state dict."""
        state = dict(self.iter_full_model_state(model))
        if self.pp_size == 1:
            state = with_tied_aliases(tie_aliases(unwrap_model(model)), state)
        return state

    def check_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        from phalanx.checkpoint.hf import check_state_dict_matches
        boosted = hybrid_state(model)
        hf = unwrap_model(model)
        state_dict = with_tied_aliases(boosted.tied_aliases, _fused_experts(hf, state_dict))
        shapes = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
        shapes.update({n: p.full_shape for n, p in boosted.plan.params.items()})
        check_state_dict_matches(hf, state_dict, shapes=shapes)

    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        hf = unwrap_model(model)
        boosted = hybrid_state(model)
        state_dict = with_tied_aliases(boosted.tied_aliases, _fused_experts(hf, state_dict))
        if self.pp_size > 1:  # this rank's stages only
            mine = hf.state_dict().keys()
            state_dict = {k: v for k, v in state_dict.items() if k in mine}
        local = local_state_dict(boosted.plan, state_dict)
        if self.ep_plan is not None:  # this rank's experts
            local = {n: self.ep_plan.local_rows(n, t) for n, t in local.items()}
        hf.load_state_dict(local, strict=False)
        optimizer = boosted.optimizer
        if isinstance(optimizer, HybridZeroOptimizer):
            optimizer.load_master_weights({id(p): local[n] for n, p in hf.named_parameters(remove_duplicate=False)
                                           if n in local})
        elif optimizer is not None:
            optimizer.load_masters(hf.named_parameters(), local)

    def optimizer_fragments(self, optimizer) -> OptimizerFragments:
        boosted = hybrid_state(optimizer)
        if self.ep_plan is not None:
            return self._expert_fragments(optimizer, boosted)
        if isinstance(optimizer, HybridZeroOptimizer):
            frags = to_full_fragments(zero_fragments(optimizer), boosted.plan, device=self.device)
        else:
            write = dist.get_rank(self.dp_sp_group) == 0
            local = fragments_from_full_state(optimizer.optim, optimizer.names) if write else OptimizerFragments()
            frags = to_full_fragments(local, boosted.plan, device=self.device, write=write)
        if boosted.tied and not any(s.is_first for s in boosted.pipeline.stages):
            # the last stage's copy of a tied embedding: the first stage writes its state
            frags.fragments = [f for f in frags.fragments if f.param not in boosted.tied]
        return frags

    def _expert_fragments(self, optimizer, boosted: BoostedState) -> OptimizerFragments:
        """ep_size > 1: expert fragments shifted to full coordinates (`phalanx.shard.expert_state`),
        then the tensor-parallel pieces gathered as without experts."""
        from phalanx.shard.expert_state import expert_full_state_fragments, expert_zero_fragments
        if isinstance(optimizer, HybridZeroOptimizer):
            local = expert_zero_fragments(optimizer, self.ep_plan, self.device)
        else:
            # dense state once per data x sequence group (the sequence shards hold the same state)
            local = expert_full_state_fragments(optimizer, self.ep_plan, self.dp_sp_group, self.device)
        frags = to_full_fragments(local, boosted.plan, device=self.device)
        if boosted.tied and not any(s.is_first for s in boosted.pipeline.stages):
            frags.fragments = [f for f in frags.fragments if f.param not in boosted.tied]
        return frags

    def load_optimizer_fragments(self, optimizer, reader: FragmentReader) -> None:
        local = LocalFragmentReader(reader, hybrid_state(optimizer).plan)
        if self.ep_plan is not None:
            from phalanx.shard.expert_state import ExpertRowsReader
            local = ExpertRowsReader(reader, hybrid_state(optimizer).plan, self.ep_plan)
            if isinstance(optimizer, HybridZeroOptimizer):  # ExpertZeroOptimizer: the experts' twin too
                load_zero_fragments(optimizer.experts, local)
        if isinstance(optimizer, HybridZeroOptimizer):
            load_zero_fragments(optimizer, local)
        else:
            load_full_state_into(optimizer.optim, optimizer.names, local)
