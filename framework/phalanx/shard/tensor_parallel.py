"""`apply_tp`: split a Hugging Face model over the tensor-parallel group, following its policy.

Attention is split by heads (query/key/value projections column parallel, the output projection
row parallel), the MLP by its hidden features, the token embedding and the LM head by the
vocabulary. Key/value heads fewer than the tensor-parallel size are replicated (the head rule of
`phalanx.models.heads`): every rank keeps the small key/value projections whole and uses the head
its query heads read. Everything else
(norms, position tables) is replicated.

Parameters are plain tensors holding this rank's piece (not DTensors): the ZeRO optimizer
flattens parameters into one buffer, and plain pieces of equal shape on every rank make its
layout the same on every tensor-parallel rank. The module boundary does the communication
(`phalanx.shard.layers`). The split of each parameter is recorded in a `TPPlan`
(name -> `ShardSpec` and full shape), which checkpoints and gradient clipping read.

Every size is checked before any module is touched: a layout that cannot work stops with the
arithmetic in the message.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from phalanx.mesh import LayoutError
from phalanx.shard.layers import (ColumnParallelLinear, InputComm, ReplicatedHeadsLinear, RowParallelLinear,
                                  VocabParallelEmbedding, VocabParallelLMHead, VocabRange)
from phalanx.shard.lora_tp import check_adapters, is_lora_layer, split_adapters
from phalanx.models.heads import HeadCounts, first_kv_head, head_problem, kv_replicated, local_heads
from phalanx.models.policy import Policy
from phalanx.shard.spec import REPLICATED, ShardSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamShard:
    spec: ShardSpec
    full_shape: tuple[int, ...]


@dataclass
class TPPlan:
    """How the model was split: for every parameter name (tied aliases included), its spec and
    full shape; plus the group and head counts."""

    policy: Policy
    group: object
    rank: int
    size: int
    heads: HeadCounts
    local_heads: HeadCounts
    sequence_parallel: bool
    params: dict[str, ParamShard] = field(default_factory=dict)
    vocab: VocabRange | None = None

    def spec(self, name: str) -> ShardSpec:
        return self.params[name].spec if name in self.params else REPLICATED

    def full_shape(self, name: str, local: torch.Tensor) -> tuple[int, ...]:
        return self.params[name].full_shape if name in self.params else tuple(local.shape)


class ParamSource(Protocol):
    """Where a parameter's values come from when it is split or materialised."""

    def local(self, name: str, param: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor: ...

    def full(self, name: str, param: torch.Tensor) -> torch.Tensor: ...


class FromModel:
    """The default source: slice the model's own (full) weights."""

    def local(self, name, param, spec, rank, tp):
        return spec.shard(param.detach(), rank, tp)

    def full(self, name, param):
        return param.detach()


# ---------------------------------------------------------------------------------------- planning
@dataclass
class _Replace:
    path: str
    kind: str  # column | row | replicated_heads | embedding | lm_head
    weight: ShardSpec
    bias: ShardSpec
    extra: dict = field(default_factory=dict)


def _is_conv1d(module: nn.Module) -> bool:
    module = _base(module)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _base(module: nn.Module) -> nn.Module:
    """The layer a PEFT LoRA layer adapts (phalanx.shard.lora_tp), or the module itself."""
    return module.base_layer if is_lora_layer(module) else module


def _out_dim(module: nn.Module) -> int:
    return 1 if _is_conv1d(module) else 0


def check_heads(heads: HeadCounts, tp: int) -> None:
    """Stop unless `tp` ranks can split these heads (the rule of `phalanx.models.heads`)."""
    problem = head_problem(heads, tp)
    if problem:
        raise LayoutError(problem)


def local_head_counts(heads: HeadCounts, tp: int) -> HeadCounts:
    return local_heads(heads, tp)


def _plan(model: nn.Module, policy: Policy, heads: HeadCounts, rank: int, tp: int, sp: bool) -> list[_Replace]:
    out: list[_Replace] = []
    replicate_kv = kv_replicated(heads, tp)
    for i, layer in enumerate(policy.decoder_layers(model)):
        prefix = f"{policy.layers}.{i}."
        if policy.fused_qkv:
            module = layer.get_submodule(policy.fused_qkv)
            d = _out_dim(module)
            sections = (heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim, heads.kv_heads * heads.head_dim)
            out.append(_Replace(prefix + policy.fused_qkv, "column", ShardSpec(d, sections), ShardSpec(0, sections),
                                {"input_comm": "none"}))
        elif policy.head_column:  # MLA: per-head projections of replicated latents
            for path in policy.head_column:
                module = policy.layer_module(layer, path)
                if module is not None:
                    out.append(_Replace(prefix + path, "column", ShardSpec(_out_dim(module)), ShardSpec(0),
                                        {"input_comm": "none"}))
        else:
            module = layer.get_submodule(policy.q)
            out.append(_Replace(prefix + policy.q, "column", ShardSpec(_out_dim(module)), ShardSpec(0),
                                {"input_comm": "none"}))
            for path in (policy.k, policy.v):
                module = layer.get_submodule(path)
                if replicate_kv:
                    g = first_kv_head(heads, tp, rank)
                    keep = (g * heads.head_dim, (g + 1) * heads.head_dim)
                    partial = ShardSpec(partial_grad=True)
                    out.append(_Replace(prefix + path, "replicated_heads", partial, partial,
                                        {"keep": keep, "input_comm": "none"}))
                else:
                    out.append(_Replace(prefix + path, "column", ShardSpec(_out_dim(module)), ShardSpec(0),
                                        {"input_comm": "none"}))
        mlp_comm = "none" if policy.mlp else ("gather" if sp else "copy")
        for path in policy.mlp_column:
            module = policy.layer_module(layer, path)
            if module is None:
                continue
            out.append(_Replace(prefix + path, "column", ShardSpec(_out_dim(module)), ShardSpec(0),
                                {"input_comm": mlp_comm}))
        for path in (policy.out_proj, *policy.mlp_row):
            module = policy.layer_module(layer, path)
            if module is None:
                continue
            out.append(_Replace(prefix + path, "row", ShardSpec(1 - _out_dim(module)), ShardSpec(partial_grad=sp)))
    vocab_spec = ShardSpec(0, pad=True)
    out.append(_Replace(policy.embedding, "embedding", vocab_spec, REPLICATED))
    head = _get(model, policy.head)
    if head is not None:
        if _is_conv1d(head) or not isinstance(head, nn.Linear):
            raise LayoutError(f"{policy.family}: the LM head {policy.head} is a {type(head).__name__}, expected nn.Linear")
        out.append(_Replace(policy.head, "lm_head", vocab_spec, vocab_spec))
    return out


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _check_shapes(model: nn.Module, plan: list[_Replace], tp: int) -> None:
    for item in plan:
        module = model.get_submodule(item.path)
        if is_lora_layer(module):
            check_adapters(module, item.path, item.kind)
            module = module.base_layer
        for pname, spec in (("weight", item.weight), ("bias", item.bias)):
            p = getattr(module, pname, None)
            if p is None or not spec.is_sharded:
                continue
            try:
                spec.local_shape(p.shape, tp)
            except ValueError as exc:
                raise LayoutError(f"tp_size={tp} cannot split {item.path}.{pname} of shape {tuple(p.shape)}: {exc}; "
                                  f"choose a tp_size that divides it") from exc


# ---------------------------------------------------------------------------------------- applying
def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, child, new)


def apply_tp(model: nn.Module, policy: Policy, *, group, sequence_parallel: bool = False,
             source: ParamSource | None = None) -> TPPlan:
    """Split `model` in place over `group` (a process group; None or one rank: no split, but the
    plan is still returned). Returns the `TPPlan`."""
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    heads = policy.heads(model.config)
    check_heads(heads, tp)
    if sequence_parallel and tp == 1:
        raise LayoutError("sequence_parallelism='split_gather' splits the sequence over the tensor-parallel group, "
                          "so it needs tp_size > 1")
    source = source or FromModel()
    local = local_head_counts(heads, tp)
    split: dict[int, ShardSpec] = {}
    tp_plan = TPPlan(policy, group, rank, tp, heads, local, sequence_parallel)
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    if tp > 1:
        replacements = _plan(model, policy, heads, rank, tp, sequence_parallel)
        _check_shapes(model, replacements, tp)
        split = _replace_modules(model, replacements, tp_plan, source)
        for layer in policy.decoder_layers(model):
            attn = layer.get_submodule(policy.attention)
            for key, value in policy.attention_attrs(local).items():
                setattr(attn, key, value)
            attn.register_forward_pre_hook(InputComm(group, gather=sequence_parallel), with_kwargs=True)
            if policy.mlp:
                layer.get_submodule(policy.mlp).register_forward_pre_hook(InputComm(group, gather=sequence_parallel),
                                                                          with_kwargs=True)
    _record_specs(model, policy, tp_plan, full_shapes, split)
    materialise_params(model, source)
    log.info("tensor parallel: %s split over %d ranks (%d heads, %d kv heads per rank)%s", policy.family, tp,
             local.heads, local.kv_heads, ", sequence parallel (split-gather)" if sequence_parallel else "")
    return tp_plan


def _replace_modules(model: nn.Module, replacements: list[_Replace], plan: TPPlan,
                     source: ParamSource) -> dict[int, ShardSpec]:
    """Swap in the parallel layers; returns {id(new parameter): its spec}."""
    names = {id(p): n for n, p in model.named_parameters()}  # first name of each (tied) parameter
    new_params: dict[int, nn.Parameter] = {}
    specs: dict[int, ShardSpec] = {}
    tp, rank, group, sp = plan.size, plan.rank, plan.group, plan.sequence_parallel

    def take(param: nn.Parameter | None, spec: ShardSpec) -> nn.Parameter | None:
        if param is None:
            return None
        if id(param) not in new_params:
            value = source.local(names[id(param)], param, spec, rank, tp)
            new_params[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            specs[id(new_params[id(param)])] = spec
        return new_params[id(param)]

    def parallel(module: nn.Module, item: _Replace, input_comm: str | None = None) -> nn.Module:
        transposed = _is_conv1d(module)
        weight = take(module.weight, item.weight)
        bias = take(getattr(module, "bias", None), item.bias)
        comm_in = input_comm or item.extra.get("input_comm")
        if item.kind == "column":
            return ColumnParallelLinear(weight, bias, group=group, transposed=transposed, input_comm=comm_in)
        if item.kind == "replicated_heads":
            return ReplicatedHeadsLinear(weight, bias, keep=item.extra["keep"], group=group, transposed=transposed,
                                         input_comm=comm_in)
        if item.kind == "row":
            return RowParallelLinear(weight, bias, group=group, transposed=transposed, sequence_parallel=sp)
        if item.kind == "embedding":
            plan.vocab = VocabRange(module.num_embeddings, rank, tp)
            return VocabParallelEmbedding(weight, vocab=plan.vocab, group=group, padding_idx=module.padding_idx)
        if item.kind == "lm_head":
            vocab = VocabRange(module.out_features, rank, tp)
            # the head's input is the final norm's output: whole sequence, replicated
            return VocabParallelLMHead(weight, bias, vocab=vocab, group=group)
        raise AssertionError(item.kind)  # pragma: no cover - the planner only emits the kinds above

    for item in replacements:
        module = model.get_submodule(item.path)
        if is_lora_layer(module):  # split the adapters, then the base inside the PEFT layer
            comm_in = split_adapters(module, item.kind, item.extra, item.bias, take, specs, group=group,
                                     sequence_parallel=sp)
            module.base_layer = parallel(module.base_layer, item, comm_in)
        else:
            _set_submodule(model, item.path, parallel(module, item))
    return specs


def _record_specs(model: nn.Module, policy: Policy, plan: TPPlan, full_shapes: dict[str, tuple[int, ...]],
                  split: dict[int, ShardSpec]) -> None:
    """Write every parameter's spec into the plan: the split ones as planned, the rest replicated
    (with partial gradients for per-head parameters, and for everything inside the decoder layers
    under split-gather sequence parallelism)."""
    layer_prefix = policy.layers + "."
    per_head = set(policy.per_head_params)
    # LoRA adapters of a replicated per-head module (DeepSeek's q_a_proj, kv_a_proj_with_mqa): their
    # gradients are this rank's heads' share, partial as their base weight's
    per_head_adapters = tuple({n.rsplit(".", 1)[0] + ".lora_" for n in per_head})
    for name, p in model.named_parameters(remove_duplicate=False):
        if plan.size == 1:
            spec = REPLICATED
        elif id(p) in split:
            spec = split[id(p)]
        elif name.startswith(layer_prefix):
            in_layer = name[len(layer_prefix):].split(".", 1)[1]
            partial = in_layer in per_head or in_layer.startswith(per_head_adapters)
            spec = ShardSpec(partial_grad=partial or plan.sequence_parallel)
        else:
            spec = REPLICATED
        plan.params[name] = ParamShard(spec, full_shapes[name])


def materialise_params(model: nn.Module, source: ParamSource) -> None:
    """Parameters still on the meta device (lazy init) get their full values from the source
    (ties kept: one new parameter per meta parameter)."""
    names = {id(p): n for n, p in model.named_parameters()}
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(source.full(names[id(p)], p), requires_grad=p.requires_grad)
            setattr(module, pname, done[id(p)])
