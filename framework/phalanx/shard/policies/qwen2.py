"""Qwen2: Llama's layout; q/k/v carry biases (split with their weights)."""
import dataclasses

from phalanx.shard.policies.llama import LLAMA
from phalanx.shard.policy import register_policy

QWEN2 = register_policy(dataclasses.replace(LLAMA, family="qwen2", model_types=("qwen2",)))
