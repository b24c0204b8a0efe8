"""OPT: LayerNorm, learned positions offset by 2, ReLU MLP (fc1, fc2) called by the layer itself,
q/k/v/out projections with biases, optional project_in/out around the decoder when the word
embeddings are narrower (word_embed_proj_dim), LM head tied to the token embedding."""
from __future__ import annotations

from phalanx.models.family import Family, heads_reader
from phalanx.models.heads import HeadCounts
from phalanx.models.names import NameTable, at
from phalanx.models.policy import Policy


def read(config) -> dict:
    hidden, heads = config.hidden_size, config.num_attention_heads
    bias = bool(getattr(config, "enable_bias", True))
    return dict(
        hidden_size=hidden, intermediate_size=config.ffn_dim, num_layers=config.num_hidden_layers,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, norm_eps=1e-5,  # nn.LayerNorm's default
        max_position_embeddings=config.max_position_embeddings, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        gated_mlp=False, activation=config.activation_function, norm="layer", positions="learned",
        position_offset=2, embed_dim=config.word_embed_proj_dim or hidden,
        final_norm=config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False))


def check_inference(config) -> None:
    if not config.do_layer_norm_before:
        raise ValueError("OPT with do_layer_norm_before=False (post-norm, e.g. opt-350m) is not supported; "
                         "the engine runs pre-norm decoders")
    if not getattr(config, "layer_norm_elementwise_affine", True):
        raise ValueError("OPT with layer_norm_elementwise_affine=False is not supported")


NAMES = NameTable(
    prefixes=("model.decoder.", "decoder.", "model."), layer_prefix="layers.",
    top={"embed_tokens": at("embed"), "embed_positions": at("pos_embed"), "final_layer_norm": at("norm"),
         "project_in": at("project_in"), "project_out": at("project_out"), "lm_head": at("lm_head")},
    layer={"self_attn_layer_norm": at("input_norm"), "final_layer_norm": at("post_norm"),
           "self_attn.q_proj": at("q"), "self_attn.k_proj": at("k"), "self_attn.v_proj": at("v"),
           "self_attn.out_proj": at("o"), "fc1": at("up"), "fc2": at("down")})


def _attrs(local: HeadCounts) -> dict[str, int]:
    return {"num_heads": local.heads, "embed_dim": local.heads * local.head_dim}


POLICY = Policy(
    family="opt", model_types=("opt",),
    layers="model.decoder.layers", embedding="model.decoder.embed_tokens",
    position_embeddings=("model.decoder.embed_positions",),
    input_extras=("model.decoder.project_in",), output_extras=("model.decoder.project_out",),
    final_norm="model.decoder.final_layer_norm",
    attention="self_attn", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
    out_proj="self_attn.out_proj", mlp_column=("fc1",), mlp_row=("fc2",), mlp=None,
    replicated=("self_attn_layer_norm", "final_layer_norm"),
    heads=heads_reader(read), attention_attrs=_attrs)

FAMILY = Family("opt", ("opt",), read, NAMES, POLICY, tied_default=True, check_inference=check_inference)
