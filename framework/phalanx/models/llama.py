"""Llama: RMSNorm, RoPE, SwiGLU MLP, separate q/k/v projections (grouped-query attention).
Mistral, Qwen2 and Qwen3 are this layout with a few flags (their own files); this file holds
the shared reader and tables."""
from __future__ import annotations

from phalanx.models.family import Family, heads_reader
from phalanx.models.names import NameTable, at
from phalanx.models.policy import Policy

STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # RoPE types whose tables do not change with length
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def rope_parameters(config) -> dict:
    """RoPE parameters of a config, old (rope_theta/rope_scaling) or new (rope_parameters) style."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # older configs
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def read_llama_like(config, *, windows: str = "none", qkv_bias: bool = False, qk_norm: bool = False) -> dict:
    """The ModelSpec fields of a Llama-layout config. windows: "none", "all" (Mistral: every layer
    slides when sliding_window is set) or "layer_types" (Qwen2/3: use_sliding_window and each
    layer's type); qkv_bias: q/k/v always carry biases (Qwen2, whose o_proj has none)."""
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if windows == "all":
        per_layer = (window,) * layers
    elif windows == "layer_types":
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        use = getattr(config, "use_sliding_window", False)
        per_layer = tuple(window if (use and t == "sliding_attention") else None for t in types)
    else:
        per_layer = (None,) * layers
    attention_bias = bool(getattr(config, "attention_bias", False))
    return dict(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_layers=layers,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
        qkv_bias=qkv_bias or attention_bias, o_bias=not qkv_bias and attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=qk_norm,
        activation=getattr(config, "hidden_act", "silu"), sliding_windows=per_layer)


def check_llama_like(config) -> None:
    """What the inference engine runs of this layout: SwiGLU with SiLU, RoPE fixed in length."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the {config.model_type} runner implements SwiGLU (silu) only")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in STATIC_ROPE:
        raise ValueError(f"RoPE type {rope.get('rope_type')!r} is not supported (it changes with the "
                         f"sequence length); supported: {', '.join(STATIC_ROPE)}")


NAMES = NameTable(
    prefixes=("model.",), layer_prefix="layers.",
    top={"embed_tokens": at("embed"), "norm": at("norm"), "lm_head": at("lm_head")},
    layer={"input_layernorm": at("input_norm"), "post_attention_layernorm": at("post_norm"),
           "self_attn.q_proj": at("q"), "self_attn.k_proj": at("k"), "self_attn.v_proj": at("v"),
           "self_attn.o_proj": at("o"), "mlp.gate_proj": at("gate"), "mlp.up_proj": at("up"),
           "mlp.down_proj": at("down")})


def read(config) -> dict:
    return read_llama_like(config)


POLICY = Policy(
    family="llama", model_types=("llama",),
    layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm",
    attention="self_attn", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
    out_proj="self_attn.o_proj", mlp_column=("mlp.gate_proj", "mlp.up_proj"), mlp_row=("mlp.down_proj",),
    replicated=("input_layernorm", "post_attention_layernorm"),
    heads=heads_reader(read))

FAMILY = Family("llama", ("llama",), read, NAMES, POLICY, required=REQUIRED, check_inference=check_llama_like)
