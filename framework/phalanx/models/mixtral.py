"""Mixtral: Mistral's layout (sliding window on every layer when set) with every MLP a block of
`num_local_experts` SwiGLU experts of width `intermediate_size`; the router's softmax top-k
weights are always renormalised to sum to 1; no shared expert."""
from phalanx.models import llama, moe
from phalanx.models.family import Family


def read(config) -> dict:
    return {**llama.read_llama_like(config, windows="all"),
            **dict(num_experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok,
                   expert_size=config.intermediate_size, norm_topk_prob=True)}


def check_inference(config) -> None:
    llama.check_llama_like(config)
    moe.check_moe_inference(config)


NAMES = moe.moe_names(llama.NAMES, moe.MIXTRAL_EXPERTS)
POLICY = moe.moe_policy(llama.POLICY, "mixtral", read)
REQUIRED = (*llama.REQUIRED, "num_local_experts", "num_experts_per_tok")
FAMILY = Family("mixtral", ("mixtral",), read, NAMES, POLICY, required=REQUIRED, check_inference=check_inference)
