"""Pipeline stages of an unmodified Hugging Face causal LM, cut where its shard policy says.

A stage holds a slice of the decoder layers; the first stage also the token embedding, the
position tables and what the base model applies before the first layer (`policy.input_extras`),
the last stage the final norm, what follows it (`policy.output_extras`) and the LM head.

A stage runs the family's own base-model forward (`LlamaModel.forward`, `GPT2Model.forward`, …)
with a *view* swapped in for the call: the base model's layer list becomes the stage's slice,
and on later stages the hidden states come in as `inputs_embeds` while the position tables
return zero and the input extras are identities; on earlier stages the final norm and output
extras are identities. So masks, rotary embeddings and position ids are computed exactly as
transformers computes them, on every stage, with no copy of any forward function.

`split_model` then trims the model in place: modules owned by stages of other ranks are
replaced by `_Absent` placeholders, so this rank's parameters (with their original names) are
only its stages' ones, which is what the optimizer, ZeRO and the checkpoint code see.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
from torch import nn

from phalanx.pipeline.layout import StageLayout
from phalanx.shard.policy import Policy


class _Absent(nn.Module):
    """Stands where another pipeline rank holds the module."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage; run the model with "
                           "booster.execute_pipeline(...)")


class _Zero(nn.Module):
    """A position table on a stage that receives hidden states: they already include positions."""

    def forward(self, *args, **kwargs):
        return torch.zeros(())


def _get(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _set(root: nn.Module, path: str, module: nn.Module | None) -> nn.Module | None:
    parent, _, child = path.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    old = getattr(owner, child)
    setattr(owner, child, module)
    return old


def base_path(policy: Policy) -> str:
    """The base model (the module whose forward runs the layers): the parent of the layer list."""
    return policy.layers.rpartition(".")[0]


def _relative(path: str, base: str) -> str:
    if not path.startswith(base + "."):
        raise ValueError(f"pipeline split: {path} is not inside the base model {base}; the policy's layers, "
                         "final_norm, position_embeddings and extras must live in one base model")
    return path[len(base) + 1:]


class StageModule(nn.Module):
    """One pipeline stage: forward(input_ids) on the first stage, forward(hidden) on the others;
    returns hidden states, or the LM head's logits on the last stage."""

    def __init__(self, model: nn.Module, policy: Policy, layout: StageLayout, index: int):
        super().__init__()
        self.index = index
        self.is_first = index == 0
        self.is_last = index == layout.num_stages - 1
        self.layer_ids = list(layout.layers[index])
        base = base_path(policy)
        object.__setattr__(self, "_base", model.get_submodule(base))  # not registered: other stages' too
        every = policy.decoder_layers(model)
        self.layers = nn.ModuleList([every[i] for i in self.layer_ids])
        self.parts = nn.ModuleDict()  # modules of the first/last stage: their parameters belong here
        self._view: dict[str, nn.Module] = {_relative(policy.layers, base): self.layers}
        first = [(policy.embedding, None), *((p, _Zero) for p in policy.position_embeddings),
                 *((p, nn.Identity) for p in policy.input_extras)]
        last = [(policy.final_norm, nn.Identity), *((p, nn.Identity) for p in policy.output_extras)]
        for paths, owned in ((first, self.is_first), (last, self.is_last)):
            for path, stand_in in paths:
                module = _get(model, path)
                if module is None:
                    continue
                if owned:
                    self.parts[path.replace(".", "__")] = module
                elif stand_in is not None:
                    self._view[_relative(path, base)] = stand_in()
        self.head = model.get_submodule(policy.head) if self.is_last else None
        self.router_losses = None  # a RouterLossCarry when the router losses ride along (set by its attach)
        config = getattr(self._base, "config", None)
        self._config = None
        if config is not None and getattr(config, "layer_types", None):
            # families that pick a layer's mask by its index in config.layer_types see their own slice
            self._config = copy.copy(config)
            self._config.layer_types = [config.layer_types[i] for i in self.layer_ids]

    @contextlib.contextmanager
    def _viewed(self) -> Iterator[None]:
        base = self._base
        saved = {path: _set(base, path, module) for path, module in self._view.items()}
        config = None
        if self._config is not None:
            config, base.config = base.config, self._config
        try:
            yield
        finally:
            for path, module in saved.items():
                _set(base, path, module)
            if config is not None:
                base.config = config

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        """`carried`: the router losses' running totals from the previous stage (`router_losses`,
        phalanx.pipeline.router_losses); with them set, the stage returns (its output, the totals
        after its own routers) — on the first stage too, which starts them."""
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        router = self.router_losses if self.router_losses is not None and self.router_losses.enabled else None
        recording = router.recording(self.index) if router is not None else contextlib.nullcontext([])
        with self._viewed(), recording as logits:
            out = self._base(**inputs, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        result = self.head(hidden) if self.is_last else hidden
        # torch's zero-bubble backward detaches stage outputs in place, which views do not allow
        # (GPT-2's base model returns a reshaped view)
        result = result.clone() if result._is_view() else result
        if router is None:
            return result
        return (result, *router.carry(logits, carried, result.device))


def tie_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name that is a second name of a tied parameter -> its first name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def split_model(model: nn.Module, policy: Policy, layout: StageLayout, pp_rank: int) -> list[StageModule]:
    """The stage modules of pipeline rank `pp_rank` (in its execution order); trims `model` in
    place to those stages' modules (other stages' become `_Absent`)."""
    mine = layout.stages_of(pp_rank)
    stages = [StageModule(model, policy, layout, s) for s in mine]
    kept = {i for s in stages for i in s.layer_ids}
    layers = policy.decoder_layers(model)
    for i in range(len(layers)):
        if i not in kept:
            layers[i] = _Absent()
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    drop = []
    if not holds_first:
        drop += [policy.embedding, *policy.position_embeddings, *policy.input_extras]
    if not holds_last:
        drop += [policy.final_norm, *policy.output_extras, policy.head]
    for path in drop:
        if _get(model, path) is not None:
            _set(model, path, _Absent())
    return stages
