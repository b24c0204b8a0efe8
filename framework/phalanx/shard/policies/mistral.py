"""Mistral: Llama's layout (its sliding window only matters beyond the window length)."""
import dataclasses

from phalanx.shard.policies.llama import LLAMA
from phalanx.shard.policy import register_policy

MISTRAL = register_policy(dataclasses.replace(LLAMA, family="mistral", model_types=("mistral",)))
