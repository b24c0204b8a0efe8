"""Shard policies: where the parallel pieces of a family's Hugging Face model are, as data.

The paths of the decoder-layer list, the token embedding, the final norm and the LM head (which
the pipeline splitter also uses), and inside one decoder layer the attention module, its
query/key/value projections (separate or one fused matrix), the output projection, the MLP's
column- and row-parallel projections, and per-head parameters. `heads(config)` reads the head
counts (through the family's config reader); `attention_attrs` names the attention-module
attributes that hold head counts (set to the local counts after sharding). `phalanx.shard`
applies a policy; `phalanx.shard.policy.policy_for` picks it by `config.model_type`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from phalanx.models.heads import HeadCounts


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
    features; mlp: the module that calls them (None when the layer calls them directly).
    per_head_params: parameters applied to every head separately (Qwen3's q/k norms):
    replicated, their gradients summed over the tensor-parallel group. replicated: the other
    modules inside a layer, kept whole on every rank (its norms): with the paths above they
    name every parameter of a layer (tests/framework/test_model_families.py checks it).
    input_extras / output_extras: modules the base model applies between the embeddings and the
    first layer (GPT-2's embedding dropout, OPT's project_in) / after the final norm (OPT's
    project_out); the pipeline keeps them on the first / last stage only.
    head_column: instead of q/k/v or fused_qkv, projections split by heads along their output
    features with no input communication (multi-head latent attention: q_proj / q_b_proj and
    kv_b_proj, whose input is the output of replicated low-rank projections, listed in
    per_head_params so that their partial gradients are summed over the group).
    optional: paths named above that a layer may lack (its attribute absent or None): DeepSeek's
    q_proj (no q_lora_rank) or q_b_proj, a dense MLP's projections on an expert layer and the
    shared expert's on a dense one; any other path must exist.
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
    head_column: tuple[str, ...] = ()
    out_proj: str
    mlp_column: tuple[str, ...]
    mlp_row: tuple[str, ...]
    mlp: str | None = "mlp"
    per_head_params: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    input_extras: tuple[str, ...] = ()
    output_extras: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    heads: Callable[[object], HeadCounts]  # a family's: `family.heads_reader(read)`
    attention_attrs: Callable[[HeadCounts], dict[str, int]] = llama_like_attention_attrs
    notes: str = field(default="", compare=False)

    def __post_init__(self):
        if (self.fused_qkv is not None) + (self.q is not None) + bool(self.head_column) != 1:
            raise ValueError(f"policy {self.family!r}: give one of q/k/v, fused_qkv or head_column")

    # ---- lookups used by sharding, sequence parallelism and the pipeline splitter
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [layer.get_submodule(self.attention) for layer in self.decoder_layers(model)]

    def split_paths(self) -> tuple[str, ...]:
        """Module paths inside a decoder layer that tensor parallelism splits."""
        qkv = (self.fused_qkv,) if self.fused_qkv else (self.q, self.k, self.v) if self.q else self.head_column
        return (*qkv, self.out_proj, *self.mlp_column, *self.mlp_row)

    def layer_module(self, layer: nn.Module, path: str) -> nn.Module | None:
        """The module at `path` inside a decoder layer; None where an `optional` path is absent."""
        if path in self.optional:
            parent, _, child = path.rpartition(".")
            try:
                owner = layer.get_submodule(parent) if parent else layer
            except AttributeError:
                return None
            module = getattr(owner, child, None)
            return module if isinstance(module, nn.Module) else None
        return layer.get_submodule(path)
