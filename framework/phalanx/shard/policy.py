"""Shard policies: per model family, where the parallel pieces of a Hugging Face model are.

A policy is data, not code: the paths of the decoder-layer list, the token embedding, the final
norm and the LM head (which the pipeline splitter also uses), and inside one decoder layer the
attention module, its query/key/value projections (separate or one fused matrix), the output
projection, the MLP's column- and row-parallel projections, and per-head parameters. Two small
functions read the head counts from the config and name the attention-module attributes that
hold head counts (set to the local counts after sharding). Adding a family is a short file in
`phalanx/shard/policies/` that calls `register_policy`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from phalanx.mesh import LayoutError


@dataclass(frozen=True)
class HeadCounts:
    heads: int
    kv_heads: int
    head_dim: int


def llama_like_heads(config) -> HeadCounts:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return HeadCounts(heads, kv, head_dim)


def llama_like_attention_attrs(local: HeadCounts) -> dict[str, int]:
    return {"num_key_value_groups": local.heads // local.kv_heads}


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Where the parallel parts of one model family are (paths are dotted attribute paths).

    family: short name ("llama"); model_types: the `config.model_type` values it applies to.
    layers: the nn.ModuleList of decoder layers; embedding: the token embedding;
    position_embeddings: learned position tables (replicated); final_norm; head: the LM head.
    attention: the attention module inside a layer. q/k/v: separate projections (inside the
    layer), or fused_qkv: one projection producing [q | k | v]. out_proj: the attention output
    projection (row parallel). mlp_column / mlp_row: MLP projections split by output / input
    features; mlp: the module that calls them (None when the layer calls them directly). per_head_params: parameters applied to every head separately (Qwen3's q/k norms):
    replicated, their gradients summed over the tensor-parallel group.
    input_extras / output_extras: modules the base model applies between the embeddings and the
    first layer (GPT-2's embedding dropout, OPT's project_in) / after the final norm (OPT's
    project_out); the pipeline keeps them on the first / last stage only.
    heads(config) -> HeadCounts; attention_attrs(local HeadCounts) -> {attribute: value} to set on
    each attention module after sharding (the attributes its forward reads head counts from).
    """

    family: str
    model_types: tuple[str, ...]
    layers: str
    embedding: str
    final_norm: str
    head: str = "lm_head"
    position_embeddings: tuple[str, ...] = ()
    attention: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    fused_qkv: str | None = None
    out_proj: str
    mlp_column: tuple[str, ...]
    mlp_row: tuple[str, ...]
    mlp: str | None = "mlp"
    per_head_params: tuple[str, ...] = ()
    input_extras: tuple[str, ...] = ()
    output_extras: tuple[str, ...] = ()
    heads: Callable[[object], HeadCounts] = llama_like_heads
    attention_attrs: Callable[[HeadCounts], dict[str, int]] = llama_like_attention_attrs
    notes: str = field(default="", compare=False)

    def __post_init__(self):
        if (self.fused_qkv is None) == (self.q is None):
            raise ValueError(f"policy {self.family!r}: give either q/k/v or fused_qkv")

    # ---- lookups used by sharding, sequence parallelism and the pipeline splitter
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [layer.get_submodule(self.attention) for layer in self.decoder_layers(model)]


_POLICIES: dict[str, Policy] = {}
_BUILTIN = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt")


def register_policy(policy: Policy) -> Policy:
    """Make `policy` the one used for its model types (a later registration replaces an earlier one)."""
    for model_type in policy.model_types:
        _POLICIES[model_type] = policy
    return policy


def _load_builtin() -> None:
    for name in _BUILTIN:
        importlib.import_module(f"phalanx.shard.policies.{name}")


def supported_families() -> list[str]:
    _load_builtin()
    return sorted({p.family for p in _POLICIES.values()})


def policy_for(model: nn.Module) -> Policy:
    """The policy for a Hugging Face model, chosen by `model.config.model_type`."""
    _load_builtin()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in _POLICIES:
        return _POLICIES[model_type]
    what = f"model_type={model_type!r} ({type(model).__name__})" if model_type else f"{type(model).__name__} (no config.model_type)"
    raise LayoutError(
        f"no shard policy for {what}: tensor/sequence parallelism supports the families "
        f"{', '.join(supported_families())}. To add one, write phalanx/shard/policies/<family>.py with "
        "register_policy(Policy(family=..., model_types=(...), layers=..., embedding=..., attention=..., "
        "q/k/v or fused_qkv=..., out_proj=..., mlp_column=..., mlp_row=...)) — see docs/hybrid.md — and import it "
        "before boosting")
