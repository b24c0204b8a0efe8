"""The tensor-parallel head rule, written once for training (`phalanx.shard`), the planner
(`phalanx.plan`) and the inference engine (`phalanx.inference`).

Query heads are split evenly over the tp ranks. Key/value heads are split too when tp divides
them; when there are fewer of them than ranks and they divide tp, they are *replicated*: each
group of tp / kv_heads consecutive ranks shares one kv head, the one its query heads read
(query head j reads kv head j // (heads / kv_heads), and a rank's heads/tp query heads all fall
in one such group). Any other tp fits neither way and is refused with the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadCounts:
    heads: int
    kv_heads: int
    head_dim: int


def head_problem(heads: HeadCounts, tp: int) -> str | None:
    """Why `tp` ranks cannot split these heads (one message for every caller), or None."""
    h, kv = heads.heads, heads.kv_heads
    if h % tp:
        ok = [d for d in range(1, h + 1) if h % d == 0]
        return (f"tp_size={tp} does not divide num_attention_heads={h} ({h} % {tp} = {h % tp}); "
                f"choose tp_size in {ok}")
    if kv % tp and tp % kv:
        return (f"tp_size={tp} and num_key_value_heads={kv}: the key/value heads can be split only when tp "
                f"divides them ({kv} % {tp} = {kv % tp}) and replicated only when they divide tp "
                f"({tp} % {kv} = {tp % kv}); choose a tp_size that divides or is a multiple of {kv}")
    return None


def kv_replicated(heads: HeadCounts, tp: int) -> bool:
    """Fewer key/value heads than ranks: each rank keeps the one its query heads read."""
    return heads.kv_heads < tp


def local_heads(heads: HeadCounts, tp: int) -> HeadCounts:
    """The query and key/value heads one rank computes with (1 kv head when replicated)."""
    return HeadCounts(heads.heads // tp, max(1, heads.kv_heads // tp), heads.head_dim)


def first_kv_head(heads: HeadCounts, tp: int, rank: int) -> int:
    """The first (full-model) key/value head that `rank` holds."""
    if kv_replicated(heads, tp):
        return rank // (tp // heads.kv_heads)
    return rank * (heads.kv_heads // tp)


def kv_weight_heads(heads: HeadCounts, tp: int) -> int:
    """Key/value heads whose projection weights a *training* rank stores: all of them when
    replicated (`ReplicatedHeadsLinear` keeps the whole small projection and its partial
    gradient), else its share."""
    return heads.kv_heads if kv_replicated(heads, tp) else heads.kv_heads // tp


def latent_width(spec) -> int:
    """Multi-head latent attention (DeepSeek-V2/V3): values cached per token and layer, the
    compressed latent and the rotary key part, kv_lora_rank + qk_rope_head_dim."""
    return spec.kv_lora_rank + spec.qk_rope_head_dim


def kv_bytes_per_block(spec, block_size: int, tp_size: int, dtype) -> int:
    """KV-cache bytes of one block of `block_size` tokens on one tensor-parallel rank, all layers:
    each local key/value head's key and value (one per rank where they are replicated), or under
    multi-head latent attention the one latent per token and layer, whole on every rank (serving as
    key and value). The engine sizes its cache by it and the planner counts serving memory by it."""
    import torch

    if spec.mla:
        per_token = spec.num_layers * latent_width(spec)
    else:
        per_token = 2 * spec.num_layers * local_heads(spec.heads, tp_size).kv_heads * spec.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()
