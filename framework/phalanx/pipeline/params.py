"""Parameters of a model trimmed to this rank's pipeline stages: the optimizer keeps only them,
and tied embeddings held by two pipeline ranks are found by their names."""
from __future__ import annotations

import torch
from torch import nn

from phalanx.param_binding import FOREIGN_PARAM, check_unstepped


def _by_name(model: nn.Module, aliases: dict[str, str]) -> dict[str, nn.Parameter]:
    """This rank's parameters under every name, including the first name of a tied parameter that
    lives here under its second (the last stage's LM head)."""
    out: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = p
        out.setdefault(aliases.get(name, name), p)
    return out


def rebind_to_stages(optimizer: torch.optim.Optimizer, model: nn.Module, names_before: dict[int, str],
                     aliases: dict[str, str]) -> dict[int, str]:
    """Point the optimizer at this rank's (split, trimmed) parameters by name, dropping those other
    pipeline ranks hold; returns id(param) -> the parameter's first (canonical) name, so optimizer
    state of a tied embedding has one name on every stage and layout."""
    check_unstepped(optimizer)
    by_name = _by_name(model, aliases)
    for group in optimizer.param_groups:
        kept, seen = [], set()
        for p in group["params"]:
            name = names_before.get(id(p))
            if name is None:
                raise ValueError(FOREIGN_PARAM)
            q = by_name.get(name)
            if q is not None and id(q) not in seen:
                seen.add(id(q))
                kept.append(q)
        group["params"] = kept
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names[id(p)] = aliases.get(name, name)
    return names


def tied_across_stages(model: nn.Module, aliases: dict[str, str], stages) -> dict[str, nn.Parameter]:
    """Tied parameters this rank holds while the other end of the tie is on another pipeline rank
    (the first stage's embedding / the last stage's head), by first name and ordered by it so both
    ranks list them alike. Empty when this rank holds both ends (ZB-V) or neither."""
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    if holds_first == holds_last:
        return {}
    tied_names = set(aliases) | set(aliases.values())
    found = {aliases.get(n, n): p for n, p in model.named_parameters() if n in tied_names}
    return {n: found[n] for n in sorted(found)}


def with_tied_aliases(aliases: dict[str, str] | None, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict that also holds each tied parameter under its second name: under pp the
    last stage holds the tied LM head by that name, checkpoints store it under the first."""
    if not aliases:
        return state
    extra = {alias: state[first] for alias, first in aliases.items() if first in state and alias not in state}
    return {**state, **extra} if extra else state
