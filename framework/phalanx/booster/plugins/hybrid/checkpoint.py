"""HybridParallelPlugin's checkpoint hooks: the full model in Hugging Face layout (gathered over
tp, and over pp from each stage's rank) and optimizer fragments keyed by full-parameter ranges,
so any plugin and layout loads them (`phalanx.shard.state`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster.plugins.base import unwrap_model
from phalanx.booster.plugins.hybrid.boost import hybrid_state
from phalanx.booster.state import BoostedState
from phalanx.checkpoint.optimizer import (FragmentReader, OptimizerFragments, fragments_from_full_state,
                                          load_full_state_into)
from phalanx.launch import collective
from phalanx.pipeline.params import with_tied_aliases
from phalanx.shard.optim import HybridZeroOptimizer
from phalanx.shard.state import LocalFragmentReader, full_state_dict, local_state_dict, to_full_fragments
from phalanx.zero.checkpoint import load_zero_fragments, zero_fragments


class HybridCheckpointIO:
    """The checkpoint hooks of HybridParallelPlugin (plugin.py), whose ranks and groups they read."""

    def _masters(self, state: BoostedState, model: nn.Module) -> dict[str, torch.Tensor]:
        """fp32 master values of this rank's pieces, by parameter name (all aliases)."""
        optimizer = state.optimizer
        hf = unwrap_model(model)
        if optimizer is None:
            return {}
        if isinstance(optimizer, HybridZeroOptimizer):
            by_id = optimizer.full_master_weights()
        else:
            by_id = {pid: m.detach() for pid, m in optimizer.master_of.items()}
        return {n: by_id[id(p)] for n, p in hf.named_parameters(remove_duplicate=False) if id(p) in by_id}

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        boosted = hybrid_state(model)
        state = full_state_dict(unwrap_model(model), boosted.plan, self._masters(boosted, model))
        if self.pp_size == 1:
            return state
        aliases = boosted.tied_aliases
        state = {aliases.get(n, n): t for n, t in state.items()}
        if self.dp_rank or self.sp_rank or self.tp_rank:
            return state
        parts = [None] * self.pp_size if self.pp_rank == 0 else None
        with collective("pp.gather_state"):
            dist.gather_object(state, parts, dst=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()} if parts else state

    def check_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        from phalanx.checkpoint.hf import check_state_dict_matches
        boosted = hybrid_state(model)
        state_dict = with_tied_aliases(boosted.tied_aliases, state_dict)
        hf = unwrap_model(model)
        shapes = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
        shapes.update({n: p.full_shape for n, p in boosted.plan.params.items()})
        check_state_dict_matches(hf, state_dict, shapes=shapes)

    def load_full_model_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        hf = unwrap_model(model)
        boosted = hybrid_state(model)
        state_dict = with_tied_aliases(boosted.tied_aliases, state_dict)
        if self.pp_size > 1:  # this rank's stages only
            mine = hf.state_dict().keys()
            state_dict = {k: v for k, v in state_dict.items() if k in mine}
        local = local_state_dict(boosted.plan, state_dict)
        hf.load_state_dict(local, strict=False)
        optimizer = boosted.optimizer
        if isinstance(optimizer, HybridZeroOptimizer):
            optimizer.load_master_weights({id(p): local[n] for n, p in hf.named_parameters(remove_duplicate=False)
                                           if n in local})
        elif optimizer is not None:
            optimizer.load_masters(hf.named_parameters(), local)

    def optimizer_fragments(self, optimizer) -> OptimizerFragments:
        boosted = hybrid_state(optimizer)
        if isinstance(optimizer, HybridZeroOptimizer):
            frags = to_full_fragments(zero_fragments(optimizer), boosted.plan)
        else:
            write = dist.get_rank(self.dp_sp_group) == 0
            local = fragments_from_full_state(optimizer.optim, optimizer.names) if write else OptimizerFragments()
            frags = to_full_fragments(local, boosted.plan, write=write)
        if boosted.tied and not any(s.is_first for s in boosted.pipeline.stages):
            # the last stage's copy of a tied embedding: the first stage writes its state
            frags.fragments = [f for f in frags.fragments if f.param not in boosted.tied]
        return frags

    def load_optimizer_fragments(self, optimizer, reader: FragmentReader) -> None:
        local = LocalFragmentReader(reader, hybrid_state(optimizer).plan)
        if isinstance(optimizer, HybridZeroOptimizer):
            load_zero_fragments(optimizer, local)
        else:
            load_full_state_into(optimizer.optim, optimizer.names, local)
