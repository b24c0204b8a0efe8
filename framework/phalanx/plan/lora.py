"""LoRA in the plan: which linear layers (or expert tensors) take adapters, and how many trainable
parameters that gives, in total and on one tensor-parallel rank (docs/plan.md, "LoRA").

PEFT's counts: an adapted linear layer [out, in] gets A [r, in] and B [out, r], r·(in + out); an
adapted expert tensor (`target_parameters`, all experts of a block in one tensor [E, out, in]) gets
A [r·E, in] and B [out, r·E], r·E·(in + out). Checked against `peft.get_peft_model` on the meta
device (tests/framework/test_plan_moe.py). Under tensor parallelism an adapter is split with its
base layer (`phalanx.shard.lora_tp`): a column-parallel layer keeps A whole and splits B by output
features, a row-parallel one splits A by input features and keeps B whole."""
from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.models import ModelSpec
from phalanx.models.heads import kv_weight_heads

# linear layers of the Llama layout (attention; a dense MLP, or a sparse layer's shared expert),
# and of multi-head latent attention (DeepSeek-V2/V3)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # target_parameters "mlp.experts.<name>"


@dataclasses.dataclass(frozen=True)
class LoRA:
    """rank: r; target_modules: linear layers by name (PEFT's suffix match: q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj; in a sparse layer gate/up/down are the shared
    expert's); target_parameters: fused expert tensors (mlp.experts.gate_up_proj,
    mlp.experts.down_proj)."""
    rank: int = 8
    target_modules: tuple[str, ...] = ATTENTION
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "target_parameters", tuple(self.target_parameters))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora rank={self.rank!r}: must be a positive integer (r, e.g. 8)")
        if not self.target_modules and not self.target_parameters:
            raise ValueError("lora: no target_modules: name the linear layers to adapt, e.g. [q_proj, v_proj]")
        unknown = [m for m in self.target_modules if m not in ATTENTION + MLA + MLP]
        if unknown:
            raise ValueError(f"lora target_modules {unknown}: the planner counts adapters on "
                             f"{', '.join(ATTENTION + MLA + MLP)} (the Llama layout's and multi-head latent "
                             "attention's linear layers)")
        bad = [p for p in self.target_parameters if p.rsplit(".", 1)[-1] not in EXPERT_TENSORS]
        if bad:
            raise ValueError(f"lora target_parameters {bad}: the planner counts adapters on "
                             "mlp.experts.gate_up_proj and mlp.experts.down_proj")

    @classmethod
    def of(cls, value: Any) -> "LoRA | None":
        """None, a LoRA, a dict ({rank, target_modules[, target_parameters, enabled]}) or a recipe's
        `lora:` section (phalanx.booster.lora.LoRASection: None unless enabled)."""
        if value is None or isinstance(value, LoRA):
            return value
        if isinstance(value, dict):
            if not value.get("enabled", True):
                return None
            fields = {k: value[k] for k in ("rank", "target_modules", "target_parameters") if k in value}
            return cls(**fields)
        if hasattr(value, "rank") and hasattr(value, "target_modules"):
            if not getattr(value, "enabled", True):
                return None
            return cls(rank=value.rank, target_modules=tuple(value.target_modules),
                       target_parameters=tuple(getattr(value, "target_parameters", ()) or ()))
        raise ValueError(f"lora={value!r}: give {{rank, target_modules}} or a recipe's lora: section")

    def describe(self) -> str:
        targets = ",".join(self.target_modules + tuple(p.rsplit(".", 1)[-1] for p in self.target_parameters))
        return f"LoRA r={self.rank} on {targets}"


def attention_shapes(spec: ModelSpec, t: int = 1) -> dict[str, tuple[int, int]]:
    """(in, out) of each attention projection on one tp rank (the shard policy's split): q/k/v/o
    of the Llama layout, or multi-head latent attention's (per-head q_proj or q_b_proj, kv_b_proj
    and o_proj split by heads; q_a_proj and kv_a_proj_with_mqa whole)."""
    h = spec.hidden_size
    if getattr(spec, "mla", False):
        heads = spec.num_heads // t
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        rq, rkv = spec.q_lora_rank, spec.kv_lora_rank
        out = {"q_a_proj": (h, rq), "q_b_proj": (rq, heads * qk)} if rq else {"q_proj": (h, heads * qk)}
        out["kv_a_proj_with_mqa"] = (h, rkv + spec.qk_rope_head_dim)
        out["kv_b_proj"] = (rkv, heads * (spec.qk_nope_head_dim + spec.v_head_dim))
        out["o_proj"] = (heads * spec.v_head_dim, h)
        return out
    q = spec.q_dim // t
    kv = kv_weight_heads(spec.heads, t) * spec.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}


def _linear_shapes(spec: ModelSpec, i: int, t: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable linear layer of layer i on one tp rank (the base layer's split)."""
    from phalanx.plan.memory import shared_expert_split

    h = spec.hidden_size
    out = attention_shapes(spec, t)
    if spec.sparse_layers[i]:
        width = spec.shared_expert_size  # the shared expert's linear layers (0: none)
        split = shared_expert_split(spec)  # DeepSeek's shared experts split like a dense MLP
    else:
        width, split = spec.intermediate_size, True
    if width:
        f = width // t if split else width  # else whole on every tp rank, with the expert block
        out.update(gate_proj=(h, f), up_proj=(h, f), down_proj=(f, h))
    return out


def layer_adapter_params(spec: ModelSpec, lora: LoRA, i: int, t: int = 1, ep: int = 1) -> int:
    """Trainable adapter parameters of decoder layer i on one tensor-parallel rank (experts split over ep)."""
    r, n = lora.rank, 0
    shapes = _linear_shapes(spec, i, t)
    for name in lora.target_modules:
        if name not in shapes:
            continue  # e.g. gate_proj of a sparse layer without a shared expert: nothing to adapt
        fan_in, fan_out = shapes[name]  # local shapes: A [r, in] and B [out, r] as the base splits them
        n += r * (fan_in + fan_out)
    if spec.sparse_layers[i]:
        h, width, experts = spec.hidden_size, spec.expert_size, spec.num_experts // ep
        for name in lora.target_parameters:
            tensor = name.rsplit(".", 1)[-1]
            fan_in, fan_out = (h, 2 * width) if tensor == "gate_up_proj" else (width, h)
            n += r * experts * (fan_in + fan_out)
    return n


def adapter_params(spec: ModelSpec, lora: LoRA) -> int:
    """Trainable parameters of the whole model's adapters (one process)."""
    return sum(layer_adapter_params(spec, lora, i) for i in range(spec.num_layers))


def adapter_numels(spec: ModelSpec, lora: LoRA, t: int = 1) -> list[int]:
    """Sizes of the adapter tensors in model order (Gemini's chunks hold only these)."""
    out = []
    r = lora.rank
    for i in range(spec.num_layers):
        shapes = _linear_shapes(spec, i, t)
        for name in (*ATTENTION, *MLA, *MLP):
            if name in lora.target_modules and name in shapes:
                fan_in, fan_out = shapes[name]
                out += [r * fan_in, r * fan_out]
        if spec.sparse_layers[i]:
            for name in lora.target_parameters:
                tensor = name.rsplit(".", 1)[-1]
                fan_in, fan_out = ((spec.hidden_size, 2 * spec.expert_size) if tensor == "gate_up_proj"
                                   else (spec.expert_size, spec.hidden_size))
                out += [r * spec.num_experts * fan_in, r * spec.num_experts * fan_out]
    return out
