"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with expert blocks of `num_experts` SwiGLU experts
of width `moe_intermediate_size`, plus a shared expert of width `shared_expert_intermediate_size`
whose output is scaled by sigmoid(`shared_expert_gate`(x)) and added to the routed experts'; top-k
weights renormalised when `norm_topk_prob`; sparse layers by `decoder_sparse_step` and
`mlp_only_layers` as in Qwen3-MoE."""
from phalanx.models import llama, moe, qwen2
from phalanx.models.family import Family

REQUIRED = (*llama.REQUIRED, "num_experts|num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size")


def read(config) -> dict:
    return {**qwen2.read(config), **moe.qwen_moe_fields(config, shared=True)}


def check_inference(config) -> None:
    llama.check_llama_like(config)
    moe.check_moe_inference(config)


NAMES = moe.moe_names(llama.NAMES, moe.QWEN_EXPERTS, shared=True)
POLICY = moe.moe_policy(qwen2.POLICY, "qwen2_moe", read)
FAMILY = Family("qwen2_moe", ("qwen2_moe",), read, NAMES, POLICY, required=REQUIRED,
                check_inference=check_inference)
