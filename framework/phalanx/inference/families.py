"""The model families the engine serves, as a small table: how each reads its Hugging Face config
into a `ModelSpec`, and where each of its checkpoint's weights goes in our decoder.

Every family runs the same decoder (`llama.DecoderModel`): pre-norm blocks of attention over the
paged KV cache and an MLP. What differs is data, not code:

| family | norm | positions | MLP | extras |
|---|---|---|---|---|
| llama, mistral, qwen2 | RMSNorm | RoPE | SwiGLU | Qwen2 q/k/v bias; Mistral/Qwen2 sliding windows |
| qwen3 | RMSNorm | RoPE | SwiGLU | RMSNorm of each head's q and k before RoPE |
| gpt2 | LayerNorm | learned | GELU (tanh) | fused c_attn, Conv1D weights stored [in, out] |
| opt | LayerNorm | learned, offset 2 | ReLU | optional project_in/out around the decoder |

Weights are mapped through *roles* (`q`, `k`, `v`, `o`, `gate`, `up`, `down`, norms, `embed`, …):
each family's table says which role(s) an HF name fills, at which offset of a fused source
tensor and whether it is stored transposed; `DecoderModel.role_target` turns a role into the
destination slice for this TP rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Piece:
    """Part of an HF weight: fills `role` (its weight or bias, `kind`); `offset(spec)` is where the
    role's rows start in a fused source tensor; `transposed` for Conv1D weights ([in, out])."""

    role: str
    offset: Callable[[object], int] = lambda spec: 0
    transposed: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    read_config: Callable[[object], dict]  # HF config -> ModelSpec fields
    prefixes: tuple[str, ...]  # prefixes of the checkpoint's names, longest first (stripped)
    layer_prefix: str  # after the stripped prefix: "layers." / "h."
    top: dict[str, tuple[Piece, ...]]  # model-level names (without prefix, without .weight/.bias)
    layer: dict[str, tuple[Piece, ...]]  # per-layer names (after "<layer_prefix><i>.")
    ignored: tuple[str, ...] = ()  # name suffixes that are buffers, not weights

    def pieces(self, name: str) -> tuple[int | None, tuple[Piece, ...], str]:
        """(layer index or None, the pieces, "weight"/"bias") of a checkpoint name; KeyError if unknown."""
        if name == "lm_head.weight":
            return None, self.top["lm_head"], "weight"
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        base, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            raise KeyError(name)
        if base.startswith(self.layer_prefix):
            index, _, local = base[len(self.layer_prefix):].partition(".")
            if not index.isdigit() or local not in self.layer:
                raise KeyError(name)
            return int(index), self.layer[local], kind
        if base not in self.top:
            raise KeyError(name)
        return None, self.top[base], kind

    def names(self, num_layers: int) -> list[tuple[str, str]]:
        """Every (checkpoint name, kind) this family may have, for the expected-weights check."""
        prefix = self.prefixes[0] if self.prefixes else ""
        out = [("lm_head.weight", "weight")] + [(f"{prefix}{t}.{k}", k) for t in self.top if t != "lm_head"
                                                for k in ("weight", "bias")]
        for i in range(num_layers):
            out += [(f"{prefix}{self.layer_prefix}{i}.{local}.{k}", k) for local in self.layer
                    for k in ("weight", "bias")]
        return out


# -- config readers ---------------------------------------------------------------------------------
def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # older configs
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama_like(config) -> dict:
    family = config.model_type
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the {family} runner implements SwiGLU (silu) only")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in _STATIC_ROPE:
        raise ValueError(f"RoPE type {rope.get('rope_type')!r} is not supported (it changes with the "
                         f"sequence length); supported: {', '.join(_STATIC_ROPE)}")
    heads = config.num_attention_heads
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family == "mistral":
        windows = tuple([window] * layers)
    elif family in ("qwen2", "qwen3"):
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        use = getattr(config, "use_sliding_window", False)
        windows = tuple(window if (use and t == "sliding_attention") else None for t in types)
    else:
        windows = tuple([None] * layers)
    attention_bias = bool(getattr(config, "attention_bias", False))
    return dict(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_layers=layers,
        num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        qkv_bias=family == "qwen2" or attention_bias, o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)), sliding_windows=windows,
        qk_norm=family == "qwen3")


def _gpt2(config) -> dict:
    if not getattr(config, "scale_attn_weights", True) or getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("GPT-2 configs with scale_attn_weights=False or scale_attn_by_inverse_layer_idx=True "
                         "are not supported (the engine scales attention by 1/sqrt(head_dim))")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not a decoder-only model")
    hidden, heads = config.n_embd, config.n_head
    return dict(
        hidden_size=hidden, intermediate_size=config.n_inner or 4 * hidden, num_layers=config.n_layer,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, norm_eps=config.layer_norm_epsilon,
        max_position_embeddings=config.n_positions, qkv_bias=True, o_bias=True, mlp_bias=True,
        sliding_windows=tuple([None] * config.n_layer), norm="layer", activation=config.activation_function,
        positions="learned")


def _opt(config) -> dict:
    if not config.do_layer_norm_before:
        raise ValueError("OPT with do_layer_norm_before=False (post-norm, e.g. opt-350m) is not supported; "
                         "the engine runs pre-norm decoders")
    if not getattr(config, "layer_norm_elementwise_affine", True):
        raise ValueError("OPT with layer_norm_elementwise_affine=False is not supported")
    hidden, heads = config.hidden_size, config.num_attention_heads
    bias = bool(getattr(config, "enable_bias", True))
    return dict(
        hidden_size=hidden, intermediate_size=config.ffn_dim, num_layers=config.num_hidden_layers,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, norm_eps=1e-5,  # nn.LayerNorm's default
        max_position_embeddings=config.max_position_embeddings, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        sliding_windows=tuple([None] * config.num_hidden_layers), norm="layer",
        activation=config.activation_function, positions="learned", position_offset=2,
        embed_dim=config.word_embed_proj_dim or hidden,
        final_norm=not getattr(config, "_remove_final_layer_norm", False))


# -- weight-name tables -----------------------------------------------------------------------------
def _at(role: str, offset=lambda spec: 0, transposed: bool = False) -> tuple[Piece, ...]:
    return (Piece(role, offset, transposed),)


_LLAMA_TOP = {"embed_tokens": _at("embed"), "norm": _at("norm"), "lm_head": _at("lm_head")}
_LLAMA_LAYER = {
    "input_layernorm": _at("input_norm"), "post_attention_layernorm": _at("post_norm"),
    "self_attn.q_proj": _at("q"), "self_attn.k_proj": _at("k"), "self_attn.v_proj": _at("v"),
    "self_attn.o_proj": _at("o"), "mlp.gate_proj": _at("gate"), "mlp.up_proj": _at("up"),
    "mlp.down_proj": _at("down"),
}
_QWEN3_LAYER = {**_LLAMA_LAYER, "self_attn.q_norm": _at("q_norm"), "self_attn.k_norm": _at("k_norm")}

_GPT2_TOP = {"wte": _at("embed"), "wpe": _at("pos_embed"), "ln_f": _at("norm"), "lm_head": _at("lm_head")}
_GPT2_LAYER = {
    "ln_1": _at("input_norm"), "ln_2": _at("post_norm"),
    # c_attn is q, k and v side by side along its output columns, stored [in, out] (Conv1D)
    "attn.c_attn": (Piece("q", lambda s: 0, True), Piece("k", lambda s: s.hidden_size, True),
                    Piece("v", lambda s: 2 * s.hidden_size, True)),
    "attn.c_proj": _at("o", transposed=True), "mlp.c_fc": _at("up", transposed=True),
    "mlp.c_proj": _at("down", transposed=True),
}

_OPT_TOP = {"embed_tokens": _at("embed"), "embed_positions": _at("pos_embed"), "final_layer_norm": _at("norm"),
            "project_in": _at("project_in"), "project_out": _at("project_out"), "lm_head": _at("lm_head")}
_OPT_LAYER = {
    "self_attn_layer_norm": _at("input_norm"), "final_layer_norm": _at("post_norm"),
    "self_attn.q_proj": _at("q"), "self_attn.k_proj": _at("k"), "self_attn.v_proj": _at("v"),
    "self_attn.out_proj": _at("o"), "fc1": _at("up"), "fc2": _at("down"),
}

_llama = dict(read_config=_llama_like, prefixes=("model.",), layer_prefix="layers.", top=_LLAMA_TOP,
              layer=_LLAMA_LAYER)
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", **_llama),
    "mistral": Family("mistral", **_llama),
    "qwen2": Family("qwen2", **_llama),
    "qwen3": Family("qwen3", **{**_llama, "layer": _QWEN3_LAYER}),
    "gpt2": Family("gpt2", _gpt2, ("transformer.",), "h.", _GPT2_TOP, _GPT2_LAYER,
                   ignored=(".attn.bias", ".attn.masked_bias")),
    "opt": Family("opt", _opt, ("model.decoder.", "decoder.", "model."), "layers.", _OPT_TOP, _OPT_LAYER),
}
SUPPORTED = tuple(FAMILIES)


def family_of(config) -> Family:
    name = getattr(config, "model_type", None)
    if name not in FAMILIES:
        raise ValueError(f"model type {name!r} is not supported by phalanx.inference; supported families: "
                         f"{', '.join(SUPPORTED)}")
    return FAMILIES[name]
