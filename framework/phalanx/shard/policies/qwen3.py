"""Qwen3: Llama's layout plus RMSNorms over each query and key head (replicated, partial gradients)."""
import dataclasses

from phalanx.shard.policies.llama import LLAMA
from phalanx.shard.policy import register_policy

QWEN3 = register_policy(dataclasses.replace(
    LLAMA, family="qwen3", model_types=("qwen3",),
    per_head_params=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
))
