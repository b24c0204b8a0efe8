"""Our own compact decoder for inference over the paged KV cache, for every family in
`phalanx.models` (Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT), reading Hugging Face configs and
weight names through each family's `ModelSpec` and weight-name table. The families differ in
data (norm kind, positions, MLP kind, q/k norm, biases), not in code: one forward reads those
flags.

Written for serving, not training: the batch is flattened (token-major [N, hidden], every
sequence's tokens back to back, no padding), q/k/v and gate/up are fused into one matmul each,
and the logits are computed only for rows that sample. Tensor parallelism is in the weights'
shapes: q/k/v and gate/up hold this rank's heads and intermediate columns (column-parallel; with
fewer key/value heads than ranks each rank holds the one kv head its query heads read),
o_proj and down_proj the matching input columns (row-parallel, summed with one all-reduce each),
and lm_head a slice of the vocabulary (gathered by the runner). The numerics follow HF operation
for operation (RMSNorm in fp32, RoPE cos/sin in fp32 then cast, HF's own activation functions),
so greedy decoding reproduces `transformers`' tokens.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from phalanx.inference import packed_linear
from phalanx.inference.attention import AttentionBatch, paged_attention, rope_and_store, store_kv
from phalanx.inference.kernels import rms_norm, swiglu
from phalanx.models import SUPPORTED, ModelSpec, family_of, rope_parameters, spec_from_config
from phalanx.models.heads import first_kv_head, head_problem, local_heads

__all__ = ["SUPPORTED", "ModelSpec", "DecoderModel", "LlamaModel", "check_tp", "kv_bytes_per_block", "rope_tables",
           "spec_for_inference"]


def spec_for_inference(config) -> ModelSpec:
    """The `ModelSpec` of an HF config, refusing (ValueError, by name) the families and variants
    this engine does not run."""
    try:
        family = family_of(config)
    except ValueError:
        raise ValueError(f"model type {getattr(config, 'model_type', None)!r} is not supported by phalanx.inference; "
                         f"supported families: {', '.join(SUPPORTED)}") from None
    family.check_inference(config)
    return spec_from_config(config)


def check_tp(spec: ModelSpec, tp_size: int) -> None:
    """Refuse a TP size that fits neither the heads (`phalanx.models.heads`: key/value heads split
    or replicated) nor the MLP width."""
    problem = head_problem(spec.heads, tp_size)
    if problem is None and spec.intermediate_size % tp_size:
        problem = (f"tp_size={tp_size} does not divide the model's intermediate size ({spec.intermediate_size}); "
                   f"choose a tp_size that divides {spec.intermediate_size}")
    if problem:
        raise ValueError(problem)


def kv_bytes_per_block(spec: ModelSpec, block_size: int, tp_size: int, dtype: torch.dtype) -> int:
    """KV-cache bytes of one block on one rank: its key/value heads (one when replicated)."""
    per_token = 2 * spec.num_layers * local_heads(spec.heads, tp_size).kv_heads * spec.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def rope_tables(spec: ModelSpec, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in fp32, computed like HF's rotary embedding (for
    learned-position families: cos 1 and sin 0, which the forward never reads)."""
    if not spec.rope:
        return (torch.ones(max_positions, spec.head_dim, device=device),
                torch.zeros(max_positions, spec.head_dim, device=device))
    params = rope_parameters(spec.config)
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


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
          residual: torch.Tensor | None = None):
    """RMSNorm (bias None) or LayerNorm of x (+ residual first, returned too, like `rms_norm`)."""
    if bias is None:
        return rms_norm(x, weight, eps) if residual is None else rms_norm(x, weight, eps, residual=residual)
    if residual is not None:
        x = x + residual
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, x)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp_size: int, sliding_window: int | None) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        local = local_heads(spec.heads, tp_size)
        self.heads, self.kv_heads = local.heads, local.kv_heads
        self.head_dim = d
        inter = spec.intermediate_size // tp_size
        self.q_size, self.kv_size = self.heads * d, self.kv_heads * d
        layer_norm = spec.norm == "layer"
        self.input_norm = _param(h)
        self.input_norm_bias = _param(h) if layer_norm else None
        self.post_norm = _param(h)
        self.post_norm_bias = _param(h) if layer_norm else None
        self.q_norm = _param(d) if spec.qk_norm else None
        self.k_norm = _param(d) if spec.qk_norm else None
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if spec.qkv_bias else None
        self.o_weight = _param(h, self.q_size)
        self.o_bias = _param(h) if spec.o_bias else None
        self.gated = spec.gated_mlp  # SwiGLU (SiLU: checked by spec_for_inference)
        width = (2 if self.gated else 1) * inter  # gate and up side by side, or up alone
        self.gate_up_weight = _param(width, h)
        self.gate_up_bias = _param(width) if spec.mlp_bias else None
        self.down_weight = _param(h, inter)
        self.down_bias = _param(h) if spec.mlp_bias else None
        self.eps = spec.norm_eps
        self.sliding_window = sliding_window
        self.inter = inter
        self.act = None
        if not self.gated:
            from transformers.activations import ACT2FN  # HF's own functions: the same numerics
            self.act = ACT2FN[spec.activation]
        self.packed: dict[str, object] = {}  # "qkv", "o", "gate_up", "down" -> packed weight (CPU bf16)

    def linear(self, name: str, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        weight, b = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias") if bias else None
        return packed_linear.linear(x, weight, b, self.packed.get(name))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP up to (not including) the row-parallel down projection."""
        up = self.linear("gate_up", x)
        if self.gated:
            return swiglu(up[:, :self.inter], up[:, self.inter:])
        return self.act(up)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3: RMSNorm over each head's q and k (before RoPE); returns a new [N, Hq + Hkv, D]."""
        n = qk.shape[0]
        q = rms_norm(qk[:, :self.heads].reshape(-1, self.head_dim), self.q_norm, self.eps)
        k = rms_norm(qk[:, self.heads:].reshape(-1, self.head_dim), self.k_norm, self.eps)
        return torch.cat((q.view(n, self.heads, -1), k.view(n, self.kv_heads, -1)), dim=1)


# Where each role's weight lives in a layer: fused column-parallel ones (param prefix, which
# slice), row-parallel ones, and replicated ones.
_COLUMN = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "gate": ("gate_up", 0), "up": ("gate_up", 1)}
_ROW = {"o": "o", "down": "down"}
_REPLICATED = {"input_norm": "input_norm", "post_norm": "post_norm", "q_norm": "q_norm", "k_norm": "k_norm"}


class Target(NamedTuple):
    """Where (part of) an HF weight goes: `source.narrow(dim, start, length)` (the whole source
    when dim is None), transposed first when `transpose`, is copied into `dest` (into its first
    `length` rows when dest is longer: the padded last vocabulary shard)."""

    dest: torch.Tensor
    dim: int | None
    start: int
    length: int
    transpose: bool = False


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the (vocabulary-sharded) LM head, for every family."""

    def __init__(self, spec: ModelSpec, *, tp_rank: int = 0, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        check_tp(spec, tp_size)
        self.spec, self.tp_rank, self.tp_size = spec, tp_rank, tp_size
        self.names = family_of(spec.family).names
        self.first_kv_head = first_kv_head(spec.heads, tp_size, tp_rank)
        self.all_reduce = all_reduce
        self.vocab_shard = -(-spec.vocab_size // tp_size)  # padded: the last shard may run short
        width = spec.embedding_width
        self.embed = _param(spec.vocab_size, width)
        self.pos_embed = (_param(spec.max_position_embeddings + spec.position_offset, spec.hidden_size)
                          if not spec.rope else None)
        self.project_in = _param(spec.hidden_size, width) if spec.projects_embeddings else None
        self.project_out = _param(width, spec.hidden_size) if spec.projects_embeddings else None
        self.layers = nn.ModuleList(DecoderLayer(spec, tp_size, w) for w in spec.sliding_windows)
        self.norm = _param(spec.hidden_size) if spec.final_norm else None  # OPT may have none
        self.norm_bias = _param(spec.hidden_size) if spec.final_norm and spec.norm == "layer" else None
        self.lm_head = _param(self.vocab_shard, width)
        nn.init.zeros_(self.lm_head)  # rows past the vocabulary (padding of the last shard) stay 0
        self._lm_head_packed = None

    # -- forward ---------------------------------------------------------------------------------
    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(x) if self.tp_size > 1 else x

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        if self.project_in is not None:
            h = F.linear(h, self.project_in)
        if self.pos_embed is not None:
            h = h + F.embedding(positions + self.spec.position_offset, self.pos_embed)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cos_table: torch.Tensor,
                sin_table: torch.Tensor) -> torch.Tensor:
        """Tokens [N] at positions [N] -> final hidden states [N, hidden] (after the last norm and,
        for OPT with project_out, projected to the embedding width)."""
        h = self.embed_tokens(input_ids, positions)
        rope = self.spec.rope
        if rope:
            cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        residual = None
        n = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = h, _norm(h, layer.input_norm, layer.input_norm_bias, layer.eps)
            else:
                x, residual = _norm(h, layer.input_norm, layer.input_norm_bias, layer.eps, residual=residual)
            qkv = layer.linear("qkv", x)
            qk = qkv[:, :layer.q_size + layer.kv_size].view(n, layer.heads + layer.kv_heads, layer.head_dim)
            if layer.q_norm is not None:
                qk = layer.norm_qk(qk)
            q, k = qk[:, :layer.heads], qk[:, layer.heads:]
            v = qkv[:, layer.q_size + layer.kv_size:].view(n, layer.kv_heads, layer.head_dim)
            if rope:
                rope_and_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping, qk=qk,
                               skips_slots=batch.skips_slots)
            else:
                store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.skips_slots)
            attn = paged_attention(q, k, v, k_cache, v_cache, batch, layer.sliding_window)
            h = self._reduce(layer.linear("o", attn.reshape(n, layer.q_size), bias=False))  # bias after the reduce
            if layer.o_bias is not None:
                h = h + layer.o_bias
            x, residual = _norm(h, layer.post_norm, layer.post_norm_bias, layer.eps, residual=residual)
            h = self._reduce(layer.linear("down", layer.mlp(x), bias=False))
            if layer.down_bias is not None:
                h = h + layer.down_bias
        if residual is not None:
            h = h + residual
        if self.spec.final_norm:
            h = _norm(h, self.norm, self.norm_bias, self.spec.norm_eps)
        if self.project_out is not None:
            h = F.linear(h, self.project_out)
        return h

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
    def weight_targets(self, name: str) -> list[Target]:
        """Where an HF weight goes (a list of `Target`s: a fused source such as GPT-2's c_attn
        fills several). Unknown names raise KeyError; buffers and tied heads give []."""
        if name.endswith(self.names.ignored):
            return []
        index, pieces, kind = self.names.pieces(name)
        if index is not None and index >= len(self.layers):
            raise KeyError(name)
        tied = self.spec.tie_word_embeddings
        targets = [self.role_target(p.role, kind, index, p.offset(self.spec), p.transposed) for p in pieces
                   if not (p.role == "lm_head" and tied)]
        if tied and kind == "weight" and any(p.role == "embed" for p in pieces):
            targets.append(self._lm_head_target())  # the tied head is the embedding
        return targets

    def role_target(self, role: str, kind: str, index: int | None, offset: int = 0,
                    transposed: bool = False) -> Target:
        """This rank's destination for `role`'s weight or bias. `offset` is where the role starts in
        a fused source along its output dimension; `transposed` for sources stored [in, out]."""
        if index is None:
            if role == "lm_head":
                return self._lm_head_target(transposed)
            dest = {"embed": self.embed, "pos_embed": self.pos_embed, "norm": self.norm if kind == "weight"
                    else self.norm_bias, "project_in": self.project_in, "project_out": self.project_out}.get(role)
            if dest is None or kind == "bias" and role != "norm":
                raise KeyError(role)
            return Target(dest, None, 0, 0, transposed)
        layer, r = self.layers[index], self.tp_rank
        if role in _REPLICATED:
            dest = getattr(layer, _REPLICATED[role] + ("_bias" if kind == "bias" else ""), None)
            if dest is None:
                raise KeyError(role)
            return Target(dest, None, 0, 0)
        if role in _COLUMN:  # this rank's output rows of the source, into a slice of the fused param
            fused, part = _COLUMN[role]
            size = (layer.q_size, layer.kv_size, layer.kv_size)[part] if fused == "qkv" else layer.inter
            at = (0, layer.q_size, layer.q_size + layer.kv_size)[part] if fused == "qkv" else part * layer.inter
            # where this rank's rows start in the source: its query heads / MLP columns, or its
            # first key/value head (the one shared by a group of ranks when replicated)
            first = self.first_kv_head * layer.head_dim if fused == "qkv" and part else r * size
            if fused == "gate_up" and not layer.gated:
                if role == "gate":
                    raise KeyError(role)
                at = 0
            dest = getattr(layer, f"{fused}_{kind}")
            if dest is None:
                raise KeyError(role)
            out_dim = 1 if transposed and kind == "weight" else 0
            return Target(dest.narrow(0, at, size), out_dim, offset + first, size,
                          transposed and kind == "weight")
        if role in _ROW:  # this rank's input columns; the bias is added once, after the all-reduce
            dest = getattr(layer, f"{_ROW[role]}_{kind}")
            if dest is None:
                raise KeyError(role)
            if kind == "bias":
                return Target(dest, None, 0, 0)
            size = layer.q_size if role == "o" else layer.inter
            return Target(dest, 0 if transposed else 1, r * size, size, transposed)
        raise KeyError(role)

    def _lm_head_target(self, transposed: bool = False) -> Target:
        start = self.tp_rank * self.vocab_shard
        rows = max(0, min(self.vocab_shard, self.spec.vocab_size - start))
        return Target(self.lm_head, 0, start, rows, transposed)

    def expected_weight_names(self) -> set[str]:
        """The HF names a complete checkpoint provides for this model."""
        names = set()
        for name, _ in self.names.names(len(self.layers)):
            try:
                if self.weight_targets(name):
                    names.add(name)
            except KeyError:
                pass
        return names


LlamaModel = DecoderModel  # the name the runner and older code use
