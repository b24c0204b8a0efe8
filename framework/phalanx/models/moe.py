"""What the mixture-of-experts families share: reading the expert fields of an HF config, and the
shard policy of a Llama-layout model whose MLP may be an expert block.

In transformers 5 an expert block (`mlp`) holds a router `mlp.gate` (weight [experts, hidden]),
the routed experts fused as `mlp.experts.gate_up_proj` [experts, 2·width, hidden] and
`mlp.experts.down_proj` [experts, hidden, width], and optionally a shared expert (`mlp.shared_expert`,
a SwiGLU MLP) with a sigmoid gate `mlp.shared_expert_gate` [1, hidden]. Checkpoints on disk keep
one tensor per expert (`...experts.<e>.gate_proj.weight` / Mixtral's `w1`/`w3`/`w2`).
"""
from __future__ import annotations

import dataclasses

from phalanx.models.family import heads_reader
from phalanx.models.names import ExpertNames, NameTable, at

QWEN_EXPERTS = ExpertNames(("mlp.",), {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
MIXTRAL_EXPERTS = ExpertNames(("block_sparse_moe.", "mlp."), {"w1": "gate", "w3": "up", "w2": "down"})
SHARED_EXPERT = {"mlp.shared_expert.gate_proj": at("shared_gate"), "mlp.shared_expert.up_proj": at("shared_up"),
                 "mlp.shared_expert.down_proj": at("shared_down"),
                 "mlp.shared_expert_gate": at("shared_expert_gate")}


def moe_names(base: NameTable, experts: ExpertNames, shared: bool = False) -> NameTable:
    """A dense family's table plus the expert block (and the shared expert with its gate)."""
    layer = {**base.layer, **(SHARED_EXPERT if shared else {})}
    return dataclasses.replace(base, layer=layer, experts=experts)


def qwen_sparse_layers(config) -> tuple[bool, ...]:
    """Qwen2/3-MoE: layer i is an expert block unless listed in mlp_only_layers, when the model has
    experts and (i + 1) is a multiple of decoder_sparse_step (transformers' own rule)."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    experts = config.num_experts
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers))


def qwen_moe_fields(config, shared: bool) -> dict:
    """The expert fields of a Qwen2-MoE (shared=True) or Qwen3-MoE config."""
    fields = dict(num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                  expert_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                  sparse_layers=qwen_sparse_layers(config))
    if shared:
        fields.update(shared_expert_size=config.shared_expert_intermediate_size, shared_expert_gate=True)
    return fields


def moe_policy(base, family: str, read) -> object:
    """A Llama-layout policy whose MLP (dense or expert block) is kept whole on every tensor-parallel
    rank: attention is split as for the dense family; the router, the experts and the shared
    expert are replicated (expert parallelism, without tp so far: phalanx.shard.expert_parallel,
    docs/moe.md). `mlp=None`: no
    input hook on the block (a dense MLP's hook all-reduces its input gradient over tp, which
    would count a whole block's gradient tp times); under split-gather sequence parallelism the
    block runs on this rank's tokens, its gradients summed over the group like the norms'."""
    return dataclasses.replace(base, family=family, model_types=(family,), mlp_column=(), mlp_row=(), mlp=None,
                               replicated=(*base.replicated, "mlp"), heads=heads_reader(read),
                               notes="mixture of experts: the MLP / expert block is replicated under tp")


def check_moe_inference(config) -> None:
    """What the inference engine runs of an expert block: SiLU experts, no router jitter at
    inference (transformers applies it only in training)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the {config.model_type} experts run SwiGLU (silu) only")


def fuse_checkpoint_experts(state: dict, names: ExpertNames, model_keys) -> dict:
    """A checkpoint's state dict with one tensor per expert (as `save_pretrained` writes it:
    `<layer>.<block>experts.<e>.<proj>.weight`) turned into the fused tensors of transformers 5's
    modules (`<layer>.mlp.experts.gate_up_proj` [E, 2·width, hidden] = gate rows then up rows,
    `<layer>.mlp.experts.down_proj` [E, hidden, width]) and a router saved under another block
    name (Mixtral's `block_sparse_moe.gate.weight`) renamed to the module's; a state dict that is
    already fused comes back unchanged. `model_keys`: the model's own state-dict names."""
    import torch

    model_keys, module = set(model_keys), names.blocks[-1]
    out, experts = {}, {}
    for key, value in state.items():
        placed = False
        for block in names.blocks:
            layer, marker, rest = key.partition(f".{block}")
            if not marker:
                continue
            parts = rest.split(".")
            if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[2] in names.per_expert \
                    and parts[3] == "weight":
                experts.setdefault(layer, {})[(names.per_expert[parts[2]], int(parts[1]))] = value
                placed = True
            elif rest == "gate.weight" and key not in model_keys and f"{layer}.{module}gate.weight" in model_keys:
                out[f"{layer}.{module}gate.weight"] = value
                placed = True
            if placed:
                break
        if not placed:
            out[key] = value
    for layer, parts in experts.items():
        count = 1 + max(e for _, e in parts)
        out[f"{layer}.{module}experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[("gate", e)], parts[("up", e)]]) for e in range(count)])
        out[f"{layer}.{module}experts.down_proj"] = torch.stack([parts[("down", e)] for e in range(count)])
    return out
