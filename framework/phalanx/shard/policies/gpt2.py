"""GPT-2: one fused [q | k | v] projection and Conv1D layers (weights stored [in, out]), learned
position embeddings, LM head tied to the token embedding."""
from phalanx.shard.policy import HeadCounts, Policy, register_policy


def _heads(config) -> HeadCounts:
    return HeadCounts(config.n_head, config.n_head, config.n_embd // config.n_head)


def _attrs(local: HeadCounts) -> dict[str, int]:
    width = local.heads * local.head_dim
    return {"num_heads": local.heads, "split_size": width, "embed_dim": width}


GPT2 = register_policy(Policy(
    family="gpt2", model_types=("gpt2",),
    layers="transformer.h", embedding="transformer.wte", position_embeddings=("transformer.wpe",),
    input_extras=("transformer.drop",),
    final_norm="transformer.ln_f", attention="attn", fused_qkv="attn.c_attn", out_proj="attn.c_proj",
    mlp_column=("mlp.c_fc",), mlp_row=("mlp.c_proj",), heads=_heads, attention_attrs=_attrs,
))
