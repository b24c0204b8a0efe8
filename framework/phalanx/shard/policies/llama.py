"""Llama: separate q/k/v projections (grouped-query attention), SwiGLU MLP, RMSNorm."""
from phalanx.shard.policy import Policy, register_policy

LLAMA = register_policy(Policy(
    family="llama", model_types=("llama",),
    layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm",
    attention="self_attn", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
    out_proj="self_attn.o_proj", mlp_column=("mlp.gate_proj", "mlp.up_proj"), mlp_row=("mlp.down_proj",),
))
