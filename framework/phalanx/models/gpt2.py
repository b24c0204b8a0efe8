"""GPT-2: LayerNorm, learned positions, GELU MLP (c_fc, c_proj), one fused [q | k | v] projection
(c_attn), Conv1D layers whose weights are stored [in, out], LM head tied to the token embedding."""
from __future__ import annotations

from phalanx.models.family import Family, heads_reader
from phalanx.models.heads import HeadCounts
from phalanx.models.names import NameTable, Piece, at
from phalanx.models.policy import Policy


def read(config) -> dict:
    hidden, heads = config.n_embd, config.n_head
    return dict(
        hidden_size=hidden, intermediate_size=config.n_inner or 4 * hidden, num_layers=config.n_layer,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, norm_eps=config.layer_norm_epsilon,
        max_position_embeddings=config.n_positions, qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False,
        activation=config.activation_function, norm="layer", positions="learned")


def check_inference(config) -> None:
    if not getattr(config, "scale_attn_weights", True) or getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("GPT-2 configs with scale_attn_weights=False or scale_attn_by_inverse_layer_idx=True "
                         "are not supported (the engine scales attention by 1/sqrt(head_dim))")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not a decoder-only model")


NAMES = NameTable(
    prefixes=("transformer.",), layer_prefix="h.",
    top={"wte": at("embed"), "wpe": at("pos_embed"), "ln_f": at("norm"), "lm_head": at("lm_head")},
    layer={"ln_1": at("input_norm"), "ln_2": at("post_norm"),
           # c_attn is q, k and v side by side along its output columns, stored [in, out] (Conv1D)
           "attn.c_attn": (Piece("q", lambda s: 0, True), Piece("k", lambda s: s.hidden_size, True),
                           Piece("v", lambda s: 2 * s.hidden_size, True)),
           "attn.c_proj": at("o", transposed=True), "mlp.c_fc": at("up", transposed=True),
           "mlp.c_proj": at("down", transposed=True)},
    ignored=(".attn.bias", ".attn.masked_bias"))


def _attrs(local: HeadCounts) -> dict[str, int]:
    width = local.heads * local.head_dim
    return {"num_heads": local.heads, "split_size": width, "embed_dim": width}


POLICY = Policy(
    family="gpt2", model_types=("gpt2",),
    layers="transformer.h", embedding="transformer.wte", position_embeddings=("transformer.wpe",),
    input_extras=("transformer.drop",),
    final_norm="transformer.ln_f", attention="attn", fused_qkv="attn.c_attn", out_proj="attn.c_proj",
    mlp_column=("mlp.c_fc",), mlp_row=("mlp.c_proj",), replicated=("ln_1", "ln_2"), heads=heads_reader(read),
    attention_attrs=_attrs)

FAMILY = Family("gpt2", ("gpt2",), read, NAMES, POLICY, tied_default=True, check_inference=check_inference)
