"""Choosing a model's shard policy. The policies themselves are part of each family's description
in `phalanx.models` (`Family.policy`, the `Policy` dataclass); `register_policy` adds or
replaces one for other model types (e.g. apps/chat_rlhf's actor-critic wrapper), and
`policy_for` picks by `config.model_type`."""
from __future__ import annotations

from torch import nn

from phalanx.mesh import LayoutError
from phalanx.models import FAMILIES, HeadCounts, Policy
from phalanx.models.policy import llama_like_attention_attrs

__all__ = ["HeadCounts", "Policy", "llama_like_attention_attrs", "policy_for", "register_policy",
           "supported_families"]

_REGISTERED: dict[str, Policy] = {}


def register_policy(policy: Policy) -> Policy:
    """Make `policy` the one used for its model types (replacing a built-in or earlier one)."""
    for model_type in policy.model_types:
        _REGISTERED[model_type] = policy
    return policy


def _policies() -> dict[str, Policy]:
    builtin = {t: f.policy for f in FAMILIES.values() for t in f.policy.model_types}
    return {**builtin, **_REGISTERED}


def supported_families() -> list[str]:
    return sorted({p.family for p in _policies().values()})


def policy_for(model: nn.Module) -> Policy:
    """The policy for a Hugging Face model, chosen by `model.config.model_type`."""
    policies = _policies()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in policies:
        return policies[model_type]
    what = f"model_type={model_type!r} ({type(model).__name__})" if model_type else f"{type(model).__name__} (no config.model_type)"
    raise LayoutError(
        f"no shard policy for {what}: tensor/sequence parallelism supports the families "
        f"{', '.join(supported_families())}. To add one, describe the family in phalanx/models/<family>.py "
        "(docs/models.md), or register_policy(Policy(family=..., model_types=(...), layers=..., embedding=..., "
        "attention=..., q/k/v or fused_qkv=..., out_proj=..., mlp_column=..., mlp_row=..., heads=...)) before boosting")


def rooted_policy(policy: Policy, prefix: str) -> Policy:
    """`policy` with its model-level paths (layers, embedding, norm, head, position tables, extras)
    under `prefix`: for a model that keeps the Hugging Face model one level down (a PEFT model's
    "base_model.model."). Paths inside a decoder layer stay as they are."""
    if not prefix:
        return policy
    import dataclasses

    def under(path: str) -> str:
        return prefix + path

    return dataclasses.replace(
        policy, layers=under(policy.layers), embedding=under(policy.embedding), final_norm=under(policy.final_norm),
        head=under(policy.head), position_embeddings=tuple(map(under, policy.position_embeddings)),
        input_extras=tuple(map(under, policy.input_extras)), output_extras=tuple(map(under, policy.output_extras)))
