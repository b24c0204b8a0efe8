"""DeepSeek-V2 / V3 in the engine: multi-head latent attention (MLA) over the paged KV cache, and
DeepSeek's router (group-limited softmax for V2, sigmoid with a correction bias for V3).

What is cached. Per token and layer one latent vector, [c_kv ; k_pe]: the RMS-normed compressed
key/value c_kv (kv_lora_rank wide) and the rotated rope key k_pe (qk_rope_head_dim wide) that
every head shares. It is stored as one key/value head of width kv_lora_rank + qk_rope_head_dim in
the engine's existing paged cache (one tensor per layer serves as both the key and the value
cache), so the block manager, prefix caching, preemption and the attention code are the dense
families'. DeepSeek-V3 (61 layers, 128 heads, kv_lora_rank 512, rope 64): 61 · 576 values per
token against 61 · 128 · (192 + 128) for decompressed keys and values, 71× less.

How attention runs over it (the "absorbed" form vLLM and SGLang use). kv_b_proj holds, per head h,
W_UK[h] (qk_nope_head_dim × kv_lora_rank) and W_UV[h] (v_head_dim × kv_lora_rank). A head's score
q_nope·(W_UK c) + q_pe·k_pe equals [W_UK^T q_nope ; q_pe]·[c ; k_pe], so the query is absorbed
(one batched matmul over the heads) and the cached latent is the key: multi-query attention with
one key head. The value is the latent too: softmax·c over the context, then W_UV[h] applied to
that average gives what softmax·(W_UV c) gives. The output's last qk_rope_head_dim columns
(the average of k_pe) are dropped. DeepSeek's softmax scale (qk_head_dim^-0.5, times mscale² under
YaRN with mscale_all_dim: transformers' `yarn_apply_mscale`) is folded into the query, since the
shared attention scales by the latent width's own 1/√D.

RoPE: V2 rotates interleaved pairs (x0, x1), (x2, x3), ... (complex multiplication); V3 the same
when `rope_interleave` (its default), else halves. Only q_pe·k_pe matters, so the rotated pairs
are laid out [first of each pair ; second of each pair] for both, which the dot product does not
see.

Tensor parallelism: this rank's heads of q_b_proj / q_proj, kv_b_proj (rows) and o_proj (columns);
q_a_proj, kv_a_proj_with_mqa and their norms whole on every rank, so every rank computes and caches
the same latent (the cache is not split by TP: its bytes per rank are the whole latent's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phalanx.inference.attention import AttentionBatch, paged_attention, store_kv
from phalanx.inference.kernels import rms_norm
from phalanx.models import rope_parameters

LOW_RANK_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps
MLA_ROLES = ("q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o")


def softmax_scale(spec) -> float:
    """DeepSeek's attention scale: 1/√(qk_nope_head_dim + qk_rope_head_dim), times mscale² under
    YaRN (transformers' own `yarn_apply_mscale`)."""
    from transformers.modeling_rope_utils import yarn_apply_mscale
    return yarn_apply_mscale(rope_parameters(spec.config), (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5)


def interleaved_rope(config) -> bool:
    """Whether the rope dims rotate as interleaved pairs (V2 always; V3 unless rope_interleave=False)."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


def init_layer(layer, spec, tp_size: int, param) -> None:
    """MLA's weights on a decoder layer (`param(*shape)` makes one): `mla_a` = [q_a_proj ;
    kv_a_proj_with_mqa] fused along outputs (both read the layer input, both whole on every rank),
    or kv_a_proj_with_mqa alone without q_lora_rank (then `q`: this rank's heads of q_proj); their
    biases with attention_bias; `q_b` (this rank's heads); the two RMSNorm weights; `kv_b` (this
    rank's heads' rows: per head qk_nope_head_dim rows of W_UK then v_head_dim rows of W_UV);
    `o` (this rank's heads' columns)."""
    h = spec.hidden_size
    heads = spec.num_heads // tp_size
    rq, rkv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, v = spec.qk_nope_head_dim, spec.v_head_dim
    layer.mla = True
    layer.heads = heads
    layer.mla_dims = (rq, rkv, rope, nope, v)
    layer.cache_heads, layer.cache_dim = 1, rkv + rope
    layer.q_size = heads * v  # o_proj's input width on this rank
    a_width = rq + rkv + rope
    layer.mla_a_weight = param(a_width, h)
    layer.mla_a_bias = param(a_width) if spec.o_bias else None
    layer.q_weight = None if rq else param(heads * (nope + rope), h)
    layer.q_bias = None
    layer.q_b_weight = param(heads * (nope + rope), rq) if rq else None
    layer.q_b_bias = None
    layer.q_a_norm = param(rq) if rq else None
    layer.kv_a_norm = param(rkv)
    layer.kv_b_weight = param(heads * (nope + v), rkv)
    layer.w_uk = None  # W_UK in fp32, built after every weight change (absorbed_key_weight)
    layer.o_weight = param(h, heads * v)
    layer.mla_scale = softmax_scale(spec) * (rkv + rope) ** 0.5  # the attention divides by √(rkv + rope)
    layer.mla_interleaved = interleaved_rope(spec.config)


MATMULS = ("mla_a", "q", "q_b")  # the MLA projections that go through `layer.linear` (o_proj is the dense path's)


def absorbed_key_weight(layer) -> torch.Tensor:
    """W_UK [heads, qk_nope_head_dim, kv_lora_rank] in fp32, which the query is absorbed through:
    a view of kv_b_proj in fp32, a copy in bf16, made once per weight change
    (`DecoderModel.pack_weights`) rather than cast in every layer of every step."""
    rq, rkv, rope, nope, v = layer.mla_dims
    return layer.kv_b_weight.view(layer.heads, nope + v, rkv)[:, :nope].float()


def target(model, layer, role: str, kind: str, index: int):
    """This rank's destination (`llama.Target`) of an MLA weight or bias."""
    from phalanx.inference.llama import Target

    rq, rkv, rope, nope, v = layer.mla_dims
    heads, r = layer.heads, model.tp_rank
    if kind == "bias":
        if role == "q_a" and rq and layer.mla_a_bias is not None:
            return Target(layer.mla_a_bias.narrow(0, 0, rq), None, 0, 0)
        if role == "kv_a" and layer.mla_a_bias is not None:
            return Target(layer.mla_a_bias.narrow(0, rq, rkv + rope), None, 0, 0)
        if role == "o" and layer.o_bias is not None:
            return Target(layer.o_bias, None, 0, 0)  # added once, after the all-reduce
        raise KeyError(role)
    if role == "q_a" and rq:
        return Target(layer.mla_a_weight.narrow(0, 0, rq), None, 0, 0)
    if role == "kv_a":
        return Target(layer.mla_a_weight.narrow(0, rq, rkv + rope), None, 0, 0)
    if role == "q_a_norm" and rq:
        return Target(layer.q_a_norm, None, 0, 0)
    if role == "kv_a_norm":
        return Target(layer.kv_a_norm, None, 0, 0)
    rows = {"q": (layer.q_weight, nope + rope), "q_b": (layer.q_b_weight, nope + rope),
            "kv_b": (layer.kv_b_weight, nope + v)}
    if role in rows and rows[role][0] is not None:
        dest, per_head = rows[role]
        return Target(dest, 0, r * heads * per_head, heads * per_head)
    if role == "o":
        return Target(layer.o_weight, 1, r * heads * v, heads * v)
    raise KeyError(role)


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleaved: bool) -> None:
    """RoPE of x [N, H, rope] written to out [N, H, rope]: pairs (x[2i], x[2i+1]) when
    `interleaved`, else (x[i], x[i + rope/2]); out holds [first of each pair ; second]. cos/sin
    [N, rope] are HF's tables (their halves repeat)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s


def attention(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
              batch: AttentionBatch) -> torch.Tensor:
    """x [N, hidden] (after the input norm) -> this rank's heads' attention output [N, heads ·
    v_head_dim], before o_proj. Writes the step's latents to `cache` [blocks, block_size, 1,
    kv_lora_rank + rope] at their slots first (as the dense path does)."""
    rq, rkv, rope, nope, v = layer.mla_dims
    n, heads = x.shape[0], layer.heads
    a = layer.linear("mla_a", x)
    if rq:
        q = layer.linear("q_b", rms_norm(a[:, :rq].contiguous(), layer.q_a_norm, LOW_RANK_NORM_EPS))
        kv = a[:, rq:]
    else:
        q, kv = layer.linear("q", x), a
    q = q.view(n, heads, nope + rope)
    latent = torch.empty(n, 1, rkv + rope, dtype=x.dtype, device=x.device)
    latent[:, 0, :rkv] = rms_norm(kv[:, :rkv].contiguous(), layer.kv_a_norm, LOW_RANK_NORM_EPS)
    _rotate_into(kv[:, None, rkv:], cos, sin, latent[:, :, rkv:], layer.mla_interleaved)
    w = layer.kv_b_weight.view(heads, nope + v, rkv)
    w_uk = layer.w_uk if layer.w_uk is not None else absorbed_key_weight(layer)
    # the query in fp32, rounded to the model's dtype once (absorbed, rotated and scaled)
    query = torch.empty(n, heads, rkv + rope, dtype=torch.float32, device=x.device)
    query[:, :, :rkv] = torch.bmm(q[:, :, :nope].float().transpose(0, 1), w_uk).transpose(0, 1)
    _rotate_into(q[:, :, nope:].float(), cos.float(), sin.float(), query[:, :, rkv:], layer.mla_interleaved)
    query = query.mul_(layer.mla_scale).to(x.dtype)
    store_kv(latent, latent, cache, cache, batch.slot_mapping, batch.skips_slots)
    out = paged_attention(query, latent, latent, cache, cache, batch)  # [N, heads, rkv + rope]
    values = torch.bmm(out[:, :, :rkv].transpose(0, 1), w[:, nope:].transpose(1, 2))  # W_UV: [heads, N, v]
    return values.transpose(0, 1).reshape(n, heads * v)


# -- DeepSeek's router -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """DeepSeek's routing, read from the HF config. sigmoid: V3 (sigmoid scores, the correction
    bias steering the choice, groups ranked by the sum of their two best biased scores); else V2
    (softmax scores; groups ranked by their best score when `group_limited`). norm: the chosen
    weights renormalised (V3's norm_topk_prob; V2 never). scale: routed_scaling_factor."""

    top_k: int
    sigmoid: bool
    group_limited: bool
    groups: int
    topk_group: int
    norm: bool
    scale: float

    @classmethod
    def from_spec(cls, spec) -> "Routing":
        c = spec.config
        v3 = c.model_type == "deepseek_v3"
        return cls(top_k=spec.experts_per_token, sigmoid=v3,
                   group_limited=v3 or getattr(c, "topk_method", "greedy") == "group_limited_greedy",
                   groups=getattr(c, "n_group", None) or 1, topk_group=getattr(c, "topk_group", None) or 1,
                   norm=v3 and bool(c.norm_topk_prob), scale=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0))


def route(routing: Routing, router_weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor):
    """(weights [N, k] fp32, chosen experts [N, k]) of tokens x [N, hidden], as transformers'
    DeepseekV2TopkRouter / DeepseekV3TopkRouter compute them (logits in fp32)."""
    logits = F.linear(x.float(), router_weight.float())
    experts = logits.shape[-1]
    if routing.sigmoid:
        scores = logits.sigmoid()
        choice = scores + bias
    else:
        scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
    if routing.group_limited:
        grouped = choice.view(-1, routing.groups, experts // routing.groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if routing.sigmoid else grouped.max(dim=-1).values
        keep = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1)
        mask = mask.unsqueeze(-1).expand(-1, routing.groups, experts // routing.groups).reshape(-1, experts).bool()
        choice = choice.masked_fill(~mask, float("-inf") if routing.sigmoid else 0.0)
    if routing.sigmoid:
        chosen = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if routing.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights, chosen = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)
    return weights * routing.scale, chosen
