"""Qwen3: Llama's layout plus an RMSNorm over each query and key head before RoPE (replicated
under tensor parallelism, their gradients summed over the group)."""
import dataclasses

from phalanx.models import llama
from phalanx.models.family import Family, heads_reader
from phalanx.models.names import at


def read(config) -> dict:
    return llama.read_llama_like(config, windows="layer_types", qk_norm=True)


NAMES = dataclasses.replace(llama.NAMES, layer={**llama.NAMES.layer, "self_attn.q_norm": at("q_norm"),
                                                "self_attn.k_norm": at("k_norm")})
POLICY = dataclasses.replace(llama.POLICY, family="qwen3", model_types=("qwen3",), heads=heads_reader(read),
                             per_head_params=("self_attn.q_norm.weight", "self_attn.k_norm.weight"))
FAMILY = Family("qwen3", ("qwen3",), read, NAMES, POLICY, required=llama.REQUIRED,
                check_inference=llama.check_llama_like)
