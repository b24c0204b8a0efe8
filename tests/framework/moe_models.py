"""Tiny random mixture-of-experts configs (Mixtral, Qwen2-MoE, Qwen3-MoE) for the family, planner
and inference tests: the sizes of inference_models.py's dense models, 4 experts of width 32, top-2.
Nothing downloads."""
from __future__ import annotations

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_config(family: str, **overrides):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.25, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, attn_implementation="sdpa", num_experts_per_tok=2)
    if family == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": 4, **overrides})
    qwen = dict(num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=False)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**{**common, **qwen, "shared_expert_intermediate_size": 48, **overrides})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{**common, **qwen, "head_dim": 24, "norm_topk_prob": True, **overrides})
    raise ValueError(f"no tiny MoE config for {family!r}")
