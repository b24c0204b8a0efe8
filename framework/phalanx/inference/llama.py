"""Our own compact Llama-family decoder (Llama, Mistral, Qwen2) for inference over the paged KV
cache, reading Hugging Face configs and weight names.

Written for serving, not training: the batch is flattened (token-major [N, hidden], every
sequence's tokens back to back, no padding), q/k/v and gate/up are fused into one matmul each,
and the logits are computed only for rows that sample. Tensor parallelism is in the weights'
shapes: q/k/v and gate/up hold this rank's heads and intermediate columns (column-parallel),
o_proj and down_proj the matching input columns (row-parallel, summed with one all-reduce each),
and lm_head a slice of the vocabulary (gathered by the runner). The numerics follow HF operation
for operation (RMSNorm in fp32, RoPE cos/sin in fp32 then cast), so greedy decoding reproduces
`transformers`' tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from phalanx.inference import packed_linear
from phalanx.inference.attention import AttentionBatch, paged_attention, rope_and_store
from phalanx.inference.kernels import rms_norm, swiglu

SUPPORTED = ("llama", "mistral", "qwen2")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from its HF config."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple  # per layer: a window size or None
    config: object  # the HF config (RoPE parameters are computed from it)

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        family = getattr(config, "model_type", None)
        if family not in SUPPORTED:
            raise ValueError(f"model type {family!r} is not supported by phalanx.inference; supported: "
                             f"{', '.join(SUPPORTED)} (Llama-family decoders)")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r}: the Llama-family runner implements SwiGLU (silu) only")
        rope = _rope_parameters(config)
        if rope.get("rope_type", "default") not in _STATIC_ROPE:
            raise ValueError(f"RoPE type {rope.get('rope_type')!r} is not supported (it changes with the "
                             f"sequence length); supported: {', '.join(_STATIC_ROPE)}")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if family == "mistral":
            windows = tuple([window] * layers)
        elif family == "qwen2":
            types = getattr(config, "layer_types", None) or ["full_attention"] * layers
            use = getattr(config, "use_sliding_window", False)
            windows = tuple(window if (use and t == "sliding_attention") else None for t in types)
        else:
            windows = tuple([None] * layers)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            family=family, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias, o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)), sliding_windows=windows, config=config)

    def check_tp(self, tp_size: int) -> None:
        """Refuse a TP size that does not divide the heads, KV heads or MLP width."""
        for what, n in (("attention heads", self.num_heads), ("key/value heads", self.num_kv_heads),
                        ("intermediate size", self.intermediate_size)):
            if n % tp_size:
                raise ValueError(f"tp_size={tp_size} does not divide the model's {what} ({n}); "
                                 f"choose a tp_size that divides {n}")

    def kv_bytes_per_block(self, block_size: int, tp_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * self.num_layers * (self.num_kv_heads // tp_size) * self.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # older configs
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_tables(spec: ModelSpec, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in fp32, computed like HF's rotary embedding."""
    params = _rope_parameters(spec.config)
    if params["rope_type"] == "default":
        dim = spec.head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](spec.config, torch.device("cpu"))
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp_size: int, sliding_window: int | None) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads = spec.num_heads // tp_size, spec.num_kv_heads // tp_size
        self.head_dim = d
        inter = spec.intermediate_size // tp_size
        self.q_size, self.kv_size = self.heads * d, self.kv_heads * d
        self.input_norm = _param(h)
        self.post_norm = _param(h)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if spec.qkv_bias else None
        self.o_weight = _param(h, self.q_size)
        self.o_bias = _param(h) if spec.o_bias else None
        self.gate_up_weight = _param(2 * inter, h)
        self.gate_up_bias = _param(2 * inter) if spec.mlp_bias else None
        self.down_weight = _param(h, inter)
        self.down_bias = _param(h) if spec.mlp_bias else None
        self.eps = spec.rms_norm_eps
        self.sliding_window = sliding_window
        self.inter = inter
        self.packed: dict[str, object] = {}  # "qkv", "o", "gate_up", "down" -> packed weight (CPU bf16)

    def linear(self, name: str, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        weight, b = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias") if bias else None
        return packed_linear.linear(x, weight, b, self.packed.get(name))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the (vocabulary-sharded) LM head."""

    def __init__(self, spec: ModelSpec, *, tp_rank: int = 0, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        spec.check_tp(tp_size)
        self.spec, self.tp_rank, self.tp_size = spec, tp_rank, tp_size
        self.all_reduce = all_reduce
        self.vocab_shard = -(-spec.vocab_size // tp_size)  # padded: the last shard may run short
        self.embed = _param(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, tp_size, w) for w in spec.sliding_windows)
        self.norm = _param(spec.hidden_size)
        self.lm_head = _param(self.vocab_shard, spec.hidden_size)
        nn.init.zeros_(self.lm_head)  # rows past the vocabulary (padding of the last shard) stay 0
        self._lm_head_packed = None

    # -- forward ---------------------------------------------------------------------------------
    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(x) if self.tp_size > 1 else x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cos_table: torch.Tensor,
                sin_table: torch.Tensor) -> torch.Tensor:
        """Tokens [N] at positions [N] -> final hidden states [N, hidden] (after the last norm)."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        residual = None
        n = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = h, rms_norm(h, layer.input_norm, layer.eps)
            else:
                x, residual = rms_norm(h, layer.input_norm, layer.eps, residual=residual)
            qkv = layer.linear("qkv", x)
            qk = qkv[:, :layer.q_size + layer.kv_size].view(n, layer.heads + layer.kv_heads, layer.head_dim)
            q, k = qk[:, :layer.heads], qk[:, layer.heads:]
            v = qkv[:, layer.q_size + layer.kv_size:].view(n, layer.kv_heads, layer.head_dim)
            rope_and_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping, qk=qk,
                           skips_slots=batch.skips_slots)
            attn = paged_attention(q, k, v, k_cache, v_cache, batch, layer.sliding_window)
            h = self._reduce(layer.linear("o", attn.view(n, layer.q_size), bias=False))  # bias after the reduce
            if layer.o_bias is not None:
                h = h + layer.o_bias
            x, residual = rms_norm(h, layer.post_norm, layer.eps, residual=residual)
            gate_up = layer.linear("gate_up", x)
            h = self._reduce(layer.linear("down", swiglu(gate_up[:, :layer.inter], gate_up[:, layer.inter:]), bias=False))
            if layer.down_bias is not None:
                h = h + layer.down_bias
        if residual is None:
            return rms_norm(h, self.norm, self.spec.rms_norm_eps)
        return rms_norm(h, self.norm, self.spec.rms_norm_eps, residual=residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [M, vocab_shard]."""
        return packed_linear.linear(hidden, self.lm_head, packed=self._lm_head_packed)

    def pack_weights(self) -> None:
        """(Re)build the packed copies of the matmul weights (see `packed_linear`); call after
        every change to the weights."""
        for layer in self.layers:
            layer.packed = {name: p for name in ("qkv", "o", "gate_up", "down")
                            if (p := packed_linear.pack(getattr(layer, f"{name}_weight"))) is not None}
        self._lm_head_packed = packed_linear.pack(self.lm_head)

    # -- weights ---------------------------------------------------------------------------------
    def weight_targets(self, name: str) -> list[tuple[torch.Tensor, int | None, int, int]]:
        """Where an HF weight goes: a list of (destination, shard dim, start, length). With a shard
        dim, `source.narrow(dim, start, length)` is copied into the first `length` entries of the
        destination along that dim; without one, the whole source. Unknown names raise KeyError."""
        spec, r = self.spec, self.tp_rank
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            out = [(self.embed, None, 0, 0)]
            if spec.tie_word_embeddings:
                out.append(self._lm_head_target())
            return out
        if name == "lm_head.weight":
            return [] if spec.tie_word_embeddings else [self._lm_head_target()]
        if name == "model.norm.weight":
            return [(self.norm, None, 0, 0)]
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise KeyError(name)
        index = int(parts[2])
        if index >= len(self.layers):
            raise KeyError(name)
        layer = self.layers[index]
        rest = ".".join(parts[3:])
        q, kv, inter = layer.q_size, layer.kv_size, layer.inter
        column = {  # column-parallel: this rank's rows of the HF weight, into a slice of ours
            "self_attn.q_proj": ("qkv", 0, q, r * q),
            "self_attn.k_proj": ("qkv", q, kv, r * kv),
            "self_attn.v_proj": ("qkv", q + kv, kv, r * kv),
            "mlp.gate_proj": ("gate_up", 0, inter, r * inter),
            "mlp.up_proj": ("gate_up", inter, inter, r * inter),
        }
        module, _, kind = rest.rpartition(".")
        if rest == "input_layernorm.weight":
            return [(layer.input_norm, None, 0, 0)]
        if rest == "post_attention_layernorm.weight":
            return [(layer.post_norm, None, 0, 0)]
        if module in column and kind in ("weight", "bias"):
            fused, offset, size, src_start = column[module]
            dest = getattr(layer, f"{fused}_{kind}")
            if dest is None:
                raise KeyError(name)
            return [(dest.narrow(0, offset, size), 0, src_start, size)]
        row = {"self_attn.o_proj": ("o", q), "mlp.down_proj": ("down", inter)}
        if module in row:
            prefix, size = row[module]
            dest = getattr(layer, f"{prefix}_{kind}")
            if dest is None:
                raise KeyError(name)
            if kind == "weight":
                return [(dest, 1, r * size, size)]
            return [(dest, None, 0, 0)]  # the bias is added once, after the all-reduce
        raise KeyError(name)

    def _lm_head_target(self):
        start = self.tp_rank * self.vocab_shard
        rows = max(0, min(self.vocab_shard, self.spec.vocab_size - start))
        return (self.lm_head, 0, start, rows)

    def expected_weight_names(self) -> set[str]:
        """The HF names a complete checkpoint provides for this model."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.spec.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"}
            for m in ("q_proj", "k_proj", "v_proj"):
                names.add(f"{p}self_attn.{m}.weight")
                if layer.qkv_bias is not None:
                    names.add(f"{p}self_attn.{m}.bias")
            if layer.o_bias is not None:
                names.add(p + "self_attn.o_proj.bias")
            for m in ("gate_proj", "up_proj", "down_proj"):
                names.add(f"{p}mlp.{m}.weight")
                if layer.gate_up_bias is not None:
                    names.add(f"{p}mlp.{m}.bias")
        return names
