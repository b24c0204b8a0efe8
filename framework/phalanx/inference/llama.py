"""Our own compact decoder for inference over the paged KV cache, for every family in
`phalanx.models` (Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT, and the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE, and DeepSeek-V2/V3, whose latent attention and router are in
`mla`), reading Hugging Face configs and
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

from phalanx.inference import mla, packed_linear
from phalanx.inference.attention import AttentionBatch, paged_attention, rope_and_store, rotate_, store_kv
from phalanx.inference.kernels import rms_norm, swiglu
from phalanx.models import SUPPORTED, ModelSpec, family_of, rope_parameters, spec_from_config
from phalanx.models.heads import first_kv_head, head_problem, kv_bytes_per_block, local_heads

__all__ = ["SUPPORTED", "ModelSpec", "DecoderModel", "LlamaModel", "Pieces", "EAGER", "check_tp", "kv_bytes_per_block",
           "rope_tables", "spec_for_inference"]


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
    widths = {"intermediate size": spec.intermediate_size if not all(spec.sparse_layers) else 0,
              "expert width (moe_intermediate_size)": spec.expert_size,
              "shared expert width": spec.shared_expert_size}
    for what, width in widths.items():
        if problem is None and width % tp_size:
            problem = (f"tp_size={tp_size} does not divide the model's {what} ({width}); "
                       f"choose a tp_size that divides {width}")
    if problem:
        raise ValueError(problem)


def rope_tables(spec: ModelSpec, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, rotated dims] in fp32, computed like HF's rotary embedding (for
    learned-position families: cos 1 and sin 0, which the forward never reads). The rotated dims
    are head_dim, or qk_rope_head_dim under multi-head latent attention."""
    rotated = spec.qk_rope_head_dim if spec.mla else spec.head_dim
    if not spec.rope:
        return (torch.ones(max_positions, rotated, device=device),
                torch.zeros(max_positions, rotated, device=device))
    params = rope_parameters(spec.config)
    if params["rope_type"] == "default":
        dim = rotated
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


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
         residual: torch.Tensor | None = None, rms: Callable | None = None):
    """RMSNorm (bias None) or LayerNorm of x (+ residual first, returned too, like `rms_norm`).
    `rms`: the RMSNorm to call (default: this module's dispatching `rms_norm`, looked up at call
    time; the compiled pieces pass the torch reference, which inductor fuses)."""
    rms = rms_norm if rms is None else rms
    if bias is None:
        return rms(x, weight, eps) if residual is None else rms(x, weight, eps, residual=residual)
    if residual is not None:
        x = x + residual
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, x)


class Pieces(NamedTuple):
    """The elementwise work of a decoder layer, between its matmuls: `norm` (residual add + norm),
    `rotate` (RoPE in place) and `swiglu`. The decoder is written once (`DecoderModel.forward`)
    and runs either these eager functions (`EAGER`) or their compiled forms
    (`compiled.CompiledModelStep`); the matmuls always go through `DecoderLayer.linear` (packed bf16
    weights, LoRA wrappers), the attention and the collectives always run eager."""

    norm: Callable
    rotate: Callable
    swiglu: Callable


EAGER = Pieces(norm, rotate_, swiglu)


class DecoderLayer(nn.Module):
    """One decoder layer; `sparse`: its MLP is a mixture-of-experts block (router, routed experts,
    optional shared expert), each expert's width split over the tensor-parallel ranks."""

    def __init__(self, spec: ModelSpec, tp_size: int, sliding_window: int | None, sparse: bool = False) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        local = local_heads(spec.heads, tp_size)
        self.heads, self.kv_heads = local.heads, local.kv_heads
        self.head_dim = d
        self.q_size, self.kv_size = self.heads * d, self.kv_heads * d
        self.mla = False  # multi-head latent attention (DeepSeek): its weights from `mla.init_layer`
        self.cache_heads, self.cache_dim = self.kv_heads, d  # what the KV cache holds per token
        layer_norm = spec.norm == "layer"
        self.input_norm = _param(h)
        self.input_norm_bias = _param(h) if layer_norm else None
        self.post_norm = _param(h)
        self.post_norm_bias = _param(h) if layer_norm else None
        self.q_norm = _param(d) if spec.qk_norm else None
        self.k_norm = _param(d) if spec.qk_norm else None
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h) if not spec.mla else None
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if spec.qkv_bias and not spec.mla else None
        self.o_weight = _param(h, self.q_size)
        self.o_bias = _param(h) if spec.o_bias else None
        if spec.mla:
            mla.init_layer(self, spec, tp_size, _param)
        self.gated = spec.gated_mlp  # SwiGLU (SiLU: checked by spec_for_inference)
        self.eps = spec.norm_eps
        self.sliding_window = sliding_window
        self.act = None
        if not self.gated:
            from transformers.activations import ACT2FN  # HF's own functions: the same numerics
            self.act = ACT2FN[spec.activation]
        self.sparse = sparse
        self._init_mlp(spec, tp_size, dense=not sparse)
        self._init_experts(spec, tp_size, sparse)
        self.packed: dict[str, object] = {}  # "qkv", "o", "gate_up", "down" -> packed weight (CPU bf16)

    def _init_mlp(self, spec: ModelSpec, tp_size: int, dense: bool) -> None:
        """The dense MLP's fused gate/up (column-parallel) and down (row-parallel) weights; None in
        an expert layer."""
        h, inter = spec.hidden_size, spec.intermediate_size // tp_size
        width = (2 if self.gated else 1) * inter  # gate and up side by side, or up alone
        self.inter = inter
        self.gate_up_weight = _param(width, h) if dense else None
        self.gate_up_bias = _param(width) if dense and spec.mlp_bias else None
        self.down_weight = _param(h, inter) if dense else None
        self.down_bias = _param(h) if dense and spec.mlp_bias else None

    def _init_experts(self, spec: ModelSpec, tp_size: int, sparse: bool) -> None:
        """An expert layer's router [experts, hidden] (whole on every rank), every expert's fused
        gate/up [experts, 2·width/tp, hidden] and down [experts, hidden, width/tp] (this rank's
        columns of each expert), and the shared expert (its columns) with its sigmoid gate."""
        h = spec.hidden_size
        self.num_experts, self.top_k, self.norm_topk = spec.num_experts, spec.experts_per_token, spec.norm_topk_prob
        self.expert_inter = spec.expert_size // tp_size
        self.shared_inter = spec.shared_expert_size // tp_size if sparse else 0
        self.router_weight = _param(spec.num_experts, h) if sparse else None
        self.experts_gate_up = _param(spec.num_experts, 2 * self.expert_inter, h) if sparse else None
        self.experts_down = _param(spec.num_experts, h, self.expert_inter) if sparse else None
        self.shared_gate_up_weight = _param(2 * self.shared_inter, h) if self.shared_inter else None
        self.shared_down_weight = _param(h, self.shared_inter) if self.shared_inter else None
        shared_bias = bool(self.shared_inter) and spec.shared_expert_bias  # DeepSeek-V2 with mlp_bias
        self.shared_gate_up_bias = _param(2 * self.shared_inter) if shared_bias else None
        self.shared_down_bias = _param(h) if shared_bias else None  # added after the all-reduce
        self.shared_expert_gate = _param(1, h) if sparse and spec.shared_expert_gate else None
        # DeepSeek's router (`mla.route`: group-limited softmax, V3's sigmoid with its correction
        # bias), its weight and bias kept in fp32 as transformers keeps them; None: softmax top-k
        self.routing = mla.Routing.from_spec(spec) if sparse and spec.mla else None
        self.router_bias = (_param(spec.num_experts) if self.routing is not None and self.routing.sigmoid
                            else None)
        self.fp32_params = ("router_weight", "router_bias") if self.routing is not None else ()

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """The expert block of x [N, hidden], this rank's partial sum (all-reduced by the caller),
        as transformers computes it: router logits, softmax in fp32, top-k, renormalised when the
        family does; each expert runs on the tokens routed to it (one matmul pair per expert hit,
        in expert order), its output scaled by the token's routing weight and added; the shared
        expert's output, scaled by sigmoid of its gate, added last (its down projection's bias,
        if any, is the caller's to add after the all-reduce). DeepSeek routes by `mla.route`."""
        if self.routing is not None:
            weights, chosen = mla.route(self.routing, self.router_weight, self.router_bias, x)
        else:
            probs = torch.softmax(F.linear(x, self.router_weight).float(), dim=-1)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start, inter = 0, self.expert_inter
        for e, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            gate_up = F.linear(x.index_select(0, tokens), self.experts_gate_up[e])
            y = F.linear(swiglu(gate_up[:, :inter], gate_up[:, inter:]), self.experts_down[e])
            out.index_add_(0, tokens, (y * weights.flatten()[pairs, None]).to(out.dtype))
        if self.shared_gate_up_weight is not None:
            up = self.linear("shared_gate_up", x)
            shared = self.linear("shared_down", swiglu(up[:, :self.shared_inter], up[:, self.shared_inter:]),
                                 bias=False)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
            out = out + shared
        return out

    def linear(self, name: str, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        weight, b = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias") if bias else None
        return packed_linear.linear(x, weight, b, self.packed.get(name))

    def mlp(self, x: torch.Tensor, act: Callable = swiglu) -> torch.Tensor:
        """The MLP up to (not including) the row-parallel down projection; `act`: the SwiGLU to
        call (gated MLPs)."""
        up = self.linear("gate_up", x)
        if self.gated:
            return act(up[:, :self.inter], up[:, self.inter:])
        return self.act(up)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3: RMSNorm over each head's q and k (before RoPE); returns a new [N, Hq + Hkv, D]."""
        n = qk.shape[0]
        q = rms_norm(qk[:, :self.heads].reshape(-1, self.head_dim), self.q_norm, self.eps)
        k = rms_norm(qk[:, self.heads:].reshape(-1, self.head_dim), self.k_norm, self.eps)
        return torch.cat((q.view(n, self.heads, -1), k.view(n, self.kv_heads, -1)), dim=1)


# Where each role's weight lives in a layer: fused column-parallel ones (param prefix, which
# slice), row-parallel ones, and replicated ones.
_COLUMN = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "gate": ("gate_up", 0), "up": ("gate_up", 1),
           "shared_gate": ("shared_gate_up", 0), "shared_up": ("shared_gate_up", 1)}
_ROW = {"o": "o", "down": "down", "shared_down": "shared_down"}
_ROUTER_BIAS = "e_score_correction_bias"
_REPLICATED = {"input_norm": "input_norm", "post_norm": "post_norm", "q_norm": "q_norm", "k_norm": "k_norm",
               "shared_expert_gate": "shared_expert_gate"}


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
        self.layers = nn.ModuleList(DecoderLayer(spec, tp_size, w, sparse)
                                    for w, sparse in zip(spec.sliding_windows, spec.sparse_layers))
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
                sin_table: torch.Tensor, pieces: Pieces = EAGER) -> torch.Tensor:
        """Tokens [N] at positions [N] -> final hidden states [N, hidden] (after the last norm and,
        for OPT with project_out, projected to the embedding width). `pieces`: the elementwise
        functions to run between the matmuls (eager, or compiled by `compiled.CompiledModelStep`)."""
        norm_ = pieces.norm
        h = self.embed_tokens(input_ids, positions)
        rope = self.spec.rope
        if rope:
            cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        residual = None
        n = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, x = h, norm_(h, layer.input_norm, layer.input_norm_bias, layer.eps)
            else:
                x, residual = norm_(h, layer.input_norm, layer.input_norm_bias, layer.eps, residual=residual)
            if layer.mla:
                attn = mla.attention(layer, x, cos, sin, k_cache, batch)
            else:
                attn = self._attention(layer, x, cos if rope else None, sin if rope else None, k_cache, v_cache,
                                       batch, pieces)
            h = self._reduce(layer.linear("o", attn.reshape(n, layer.q_size), bias=False))  # bias after the reduce
            if layer.o_bias is not None:
                h = h + layer.o_bias
            x, residual = norm_(h, layer.post_norm, layer.post_norm_bias, layer.eps, residual=residual)
            if layer.sparse:  # an expert block: its partial sums meet in the same one all-reduce
                h = self._reduce(layer.moe(x))
                if layer.shared_down_bias is not None:
                    h = h + layer.shared_down_bias
            else:
                h = self._reduce(layer.linear("down", layer.mlp(x, pieces.swiglu), bias=False))
                if layer.down_bias is not None:
                    h = h + layer.down_bias
        if residual is not None:
            h = h + residual
        if self.spec.final_norm:
            h = norm_(h, self.norm, self.norm_bias, self.spec.norm_eps)
        if self.project_out is not None:
            h = F.linear(h, self.project_out)
        return h

    @staticmethod
    def _attention(layer, x, cos, sin, k_cache, v_cache, batch, pieces) -> torch.Tensor:
        """The dense families' attention of x [N, hidden] -> [N, heads, head_dim]: fused q/k/v,
        Qwen3's q/k norms, RoPE (cos None: learned positions), the cache write, paged attention."""
        n = x.shape[0]
        qkv = layer.linear("qkv", x)
        qk = qkv[:, :layer.q_size + layer.kv_size].view(n, layer.heads + layer.kv_heads, layer.head_dim)
        if layer.q_norm is not None:
            qk = layer.norm_qk(qk)
        q, k = qk[:, :layer.heads], qk[:, layer.heads:]
        v = qkv[:, layer.q_size + layer.kv_size:].view(n, layer.kv_heads, layer.head_dim)
        if cos is not None:
            rope_and_store(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping, qk=qk,
                           skips_slots=batch.skips_slots, rotate=pieces.rotate)
        else:
            store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.skips_slots)
        return paged_attention(q, k, v, k_cache, v_cache, batch, layer.sliding_window)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [M, vocab_shard]."""
        return packed_linear.linear(hidden, self.lm_head, packed=self._lm_head_packed)

    def pack_weights(self) -> None:
        """(Re)build the packed copies of the matmul weights (see `packed_linear`); call after
        every change to the weights."""
        for layer in self.layers:
            names = ("qkv", "o", "gate_up", "down", "shared_gate_up", "shared_down")
            names += mla.MATMULS if layer.mla else ()
            if layer.mla:
                layer.w_uk = mla.absorbed_key_weight(layer)
            layer.packed = {name: p for name in names
                            if getattr(layer, f"{name}_weight") is not None
                            and (p := packed_linear.pack(getattr(layer, f"{name}_weight"))) is not None}
        self._lm_head_packed = packed_linear.pack(self.lm_head)

    # -- weights ---------------------------------------------------------------------------------
    def weight_targets(self, name: str) -> list[Target]:
        """Where an HF weight goes (a list of `Target`s: a fused source such as GPT-2's c_attn
        fills several). Unknown names raise KeyError; buffers, tied heads and DeepSeek-V3's
        multi-token-prediction layers give []."""
        if self._is_mtp_layer(name):
            return []
        if name.endswith(_ROUTER_BIAS):  # DeepSeek-V3's correction bias: a buffer the router reads
            return self._router_bias_target(name)
        if name.endswith(self.names.ignored):
            return []
        expert = self._expert_role(name)
        if expert is not None:
            return self._expert_targets(*expert)
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
        if layer.mla and role in mla.MLA_ROLES:
            return mla.target(self, layer, role, kind, index)
        if role in _REPLICATED:
            dest = getattr(layer, _REPLICATED[role] + ("_bias" if kind == "bias" else ""), None)
            if dest is None:
                raise KeyError(role)
            return Target(dest, None, 0, 0)
        if role in _COLUMN:  # this rank's output rows of the source, into a slice of the fused param
            fused, part = _COLUMN[role]
            inter = layer.shared_inter if fused == "shared_gate_up" else layer.inter
            size = (layer.q_size, layer.kv_size, layer.kv_size)[part] if fused == "qkv" else inter
            at = (0, layer.q_size, layer.q_size + layer.kv_size)[part] if fused == "qkv" else part * inter
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
            size = {"o": layer.q_size, "shared_down": layer.shared_inter}.get(role, layer.inter)
            return Target(dest, 0 if transposed else 1, r * size, size, transposed)
        raise KeyError(role)

    def _is_mtp_layer(self, name: str) -> bool:
        """DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers
        after the decoder's (model.layers.61 in V3); transformers skips them when loading, and so
        does the engine (it does not speculate with them)."""
        if self.spec.family != "deepseek_v3":
            return False
        found = self.names.layer_local(name)
        extra = getattr(self.spec.config, "num_nextn_predict_layers", 0) or 0
        return found is not None and len(self.layers) <= found[0] < len(self.layers) + extra

    def _router_bias_target(self, name: str) -> list[Target]:
        found = self.names.layer_local(name)
        if found is None or found[0] >= len(self.layers) or self.layers[found[0]].router_bias is None:
            raise KeyError(name)
        return [Target(self.layers[found[0]].router_bias, None, 0, 0)]

    def _expert_role(self, name: str) -> tuple[int, str, int | None] | None:
        """(layer, role, expert) of a mixture-of-experts name (router, one expert, fused experts)."""
        found = self.names.experts and self.names.layer_local(name)
        parsed = found and self.names.experts.parse(found[1])
        return (found[0], *parsed) if parsed else None

    def _expert_targets(self, index: int, role: str, expert: int | None) -> list[Target]:
        """This rank's columns of every expert's width: rows [r·w, (r+1)·w) of gate and of up
        (into the two halves of the fused gate/up), columns of down; the router whole."""
        if index >= len(self.layers) or not self.layers[index].sparse:
            raise KeyError(role)
        layer = self.layers[index]
        w, full = layer.expert_inter, self.spec.expert_size
        first = self.tp_rank * w
        if role == "router":
            return [Target(layer.router_weight, None, 0, 0)]
        if role == "experts_gate_up":  # [experts, 2·width, hidden]
            return [Target(layer.experts_gate_up.narrow(1, 0, w), 1, first, w),
                    Target(layer.experts_gate_up.narrow(1, w, w), 1, full + first, w)]
        if role == "experts_down":  # [experts, hidden, width]
            return [Target(layer.experts_down, 2, first, w)]
        if expert is None or expert >= layer.num_experts:
            raise KeyError(role)
        if role == "expert_down":  # [hidden, width]
            return [Target(layer.experts_down[expert], 1, first, w)]
        half = {"expert_gate": 0, "expert_up": 1}[role]  # [width, hidden]
        return [Target(layer.experts_gate_up[expert].narrow(0, half * w, w), 0, first, w)]

    def covered_weight_names(self, name: str) -> set[str]:
        """Checkpoint names that `name` provides besides itself: transformers' fused expert
        tensors stand for the per-expert tensors of a checkpoint (the strict load's check)."""
        found = self.names.experts and self.names.layer_local(name)
        if not found:
            return set()
        return {self.names.layer_name(found[0], n) for n in self.names.experts.covered(found[1], self.spec.num_experts)}

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
        for i, layer in enumerate(self.layers):
            if layer.sparse:
                names |= {self.names.layer_name(i, n) for n in self.names.experts.checkpoint_names(layer.num_experts)}
            if layer.router_bias is not None:
                names.add(self.names.layer_name(i, "mlp.gate." + _ROUTER_BIAS))
        return names


LlamaModel = DecoderModel  # the name the runner and older code use
