"""Qwen2: Llama's layout; q/k/v carry biases (o_proj does not); sliding windows per layer type."""
import dataclasses

from phalanx.models import llama
from phalanx.models.family import Family, heads_reader


def read(config) -> dict:
    return llama.read_llama_like(config, windows="layer_types", qkv_bias=True)


POLICY = dataclasses.replace(llama.POLICY, family="qwen2", model_types=("qwen2",), heads=heads_reader(read))
FAMILY = Family("qwen2", ("qwen2",), read, llama.NAMES, POLICY, required=llama.REQUIRED,
                check_inference=llama.check_llama_like)
