"""OPT: separate q/k/v projections with biases, learned position embeddings (offset 2), the
attention reshapes with `self.num_heads`."""
from phalanx.shard.policy import HeadCounts, Policy, register_policy


def _heads(config) -> HeadCounts:
    heads = config.num_attention_heads
    return HeadCounts(heads, heads, config.hidden_size // heads)


def _attrs(local: HeadCounts) -> dict[str, int]:
    return {"num_heads": local.heads, "embed_dim": local.heads * local.head_dim}


OPT = register_policy(Policy(
    family="opt", model_types=("opt",),
    layers="model.decoder.layers", embedding="model.decoder.embed_tokens",
    position_embeddings=("model.decoder.embed_positions",),
    input_extras=("model.decoder.project_in",), output_extras=("model.decoder.project_out",), final_norm="model.decoder.final_layer_norm",
    attention="self_attn", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
    out_proj="self_attn.out_proj", mlp_column=("fc1",), mlp_row=("fc2",), mlp=None, heads=_heads, attention_attrs=_attrs,
))
