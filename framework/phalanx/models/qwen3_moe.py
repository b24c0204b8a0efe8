"""Qwen3-MoE: Qwen3's attention (q/k norms, sliding windows per layer type) with expert blocks of
`num_experts` SwiGLU experts of width `moe_intermediate_size` on the layers transformers makes
sparse (`decoder_sparse_step`, `mlp_only_layers`: the others are dense MLPs of
`intermediate_size`); top-k weights renormalised when `norm_topk_prob`; no shared expert."""
from phalanx.models import llama, moe, qwen3
from phalanx.models.family import Family

REQUIRED = (*llama.REQUIRED, "num_experts|num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


def read(config) -> dict:
    return {**qwen3.read(config), **moe.qwen_moe_fields(config, shared=False)}


def check_inference(config) -> None:
    llama.check_llama_like(config)
    moe.check_moe_inference(config)


NAMES = moe.moe_names(qwen3.NAMES, moe.QWEN_EXPERTS)
POLICY = moe.moe_policy(qwen3.POLICY, "qwen3_moe", read)
FAMILY = Family("qwen3_moe", ("qwen3_moe",), read, NAMES, POLICY, required=REQUIRED,
                check_inference=check_inference)
