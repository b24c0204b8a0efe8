"""Step time of one layout: FLOPs against the device's peak, bytes moved against the links,
and the pipeline bubble. Idealised on purpose (even split of work, ring collectives, data-parallel
communication hidden behind backward up to backward's length): it ranks layouts; it does not
replace a measured step."""
from __future__ import annotations

import dataclasses

from phalanx.plan.layout import Layout
from phalanx.plan.memory import FP32, local_model, ring_kv_width, sequence_shards
from phalanx.models import ModelSpec
from phalanx.plan.workload import Hardware, Workload


def training_flops_per_token(spec: ModelSpec, seq: int, checkpointing: bool, lora=None) -> float:
    """6·N (forward 2·N, backward 4·N over the matmul parameters) plus causal attention
    (QKᵀ and AV: 2·seq·q_dim per token and layer forward, ×3 with backward); activation
    checkpointing runs the forward once more (8·N + 8·L·seq·q_dim). With LoRA the frozen base
    needs no weight gradients: 4·N for the base (forward, input gradients), 6·N_adapters.
    Multi-head latent attention: q_dim → heads · (qk + v_head_dim) / 2 (QKᵀ over the query/key
    width, AV over the value width)."""
    dense = spec.matmul_params()
    # QKᵀ over the query/key width, AV over the value width (they differ under latent attention)
    width = (spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) / 2
             if getattr(spec, "mla", False) else spec.q_dim)
    attention = spec.num_layers * seq * width
    factor = 8 if checkpointing else 6
    if lora is not None:
        from phalanx.plan.lora import adapter_params

        return (factor - 2) * dense + factor * adapter_params(spec, lora) + factor * attention
    return factor * dense + factor * attention


@dataclasses.dataclass
class StepTime:
    compute: float       # seconds of matmul work per rank at peak × efficiency
    bubble: float        # pipeline idle time
    dp_comm: float       # data-parallel communication not hidden behind backward
    tp_comm: float       # tensor/sequence-parallel collectives (on the critical path; ring's hops beyond its overlap)
    pp_comm: float       # activations between stages
    offload: float       # device↔host copies
    tokens: int          # tokens per optimizer step, all ranks
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (dispatch + combine, forward and backward)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.dp_comm + self.tp_comm + self.pp_comm + self.offload + self.ep_comm

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total if self.total else float("inf")


def _ring(g: int) -> float:
    return (g - 1) / g if g > 1 else 0.0


def all_to_all_seconds(spec: ModelSpec, layout: Layout, work: Workload, hw: Hardware, microbatches: int) -> float:
    """Expert parallelism's exchanges per step on one rank: in each sparse layer of its stage a
    dispatch and a combine forward and both again in backward (4; 6 with activation checkpointing,
    which repeats the forward), each moving the rank's tokens × top-k × hidden × p bytes, of which
    (ep − 1)/ep leave the rank (balanced routing), at the collective bandwidth. Under Ulysses/ring
    the rank's tokens are its sequence shard, micro batch × seq / sp."""
    ep = getattr(layout, "ep", 1)
    if ep == 1 or not spec.is_moe:
        return 0.0
    sparse = sum(spec.sparse_layers) / spec.num_layers  # the stage's share of sparse layers
    layers = local_model(spec, layout).layers * sparse
    exchanges = 6 if layout.checkpointing else 4
    tokens = work.micro_batch * work.seq / sequence_shards(layout)
    per_exchange = tokens * spec.experts_per_token * spec.hidden_size * work.p * _ring(ep)
    return microbatches * layers * exchanges * per_exchange / hw.bandwidth


def ring_seconds(spec: ModelSpec, layout: Layout, work: Workload, hw: Hardware, microbatches: int) -> float:
    """Ring attention's exchanges per step on one rank, where they are not hidden
    (`phalanx.sequence.ring`). Per layer and microbatch, with T the rank's tokens (micro batch ×
    seq / sp) and kv its key/value width (`ring_kv_width`):
      forward: sp − 1 hops of the rank's key and value block, T · kv · p bytes each, every one
        started before the current block's attention and waited for after it (overlapped): only
        what exceeds one step's attention compute (1/sp of the pass's: the zigzag evens the steps)
        counts (again in the recomputed forward with activation checkpointing);
      backward: the same sp − 1 key/value hops, overlapped with backward's attention (twice the
        forward's FLOPs), and sp hops of the block's fp32 key/value gradients (T · kv · 4 each),
        each waited for as soon as it starts: serial, counted in full.
    Attention compute per pass: 2 · seq · width / tp FLOPs per token forward (causal QKᵀ and AV,
    `training_flops_per_token`'s attention term) at peak × efficiency."""
    s = layout.sp
    if layout.sp_mode != "ring" or s < 2:
        return 0.0
    tokens = work.micro_batch * work.seq / s
    kv = ring_kv_width(spec, layout.tp)
    width = (spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) / 2
             if getattr(spec, "mla", False) else spec.q_dim)
    # one of the sp steps of a pass: its share of the attention (the zigzag evens the steps out)
    step = 2 * work.seq * width / layout.tp * tokens / (hw.peak_flops * hw.efficiency) / s
    hop = tokens * kv * work.p / hw.bandwidth
    forward = (s - 1) * max(0.0, hop - step) * (2 if layout.checkpointing else 1)
    backward = (s - 1) * max(0.0, hop - 2 * step) + s * tokens * kv * FP32 / hw.bandwidth
    return microbatches * local_model(spec, layout).layers * (forward + backward)


def estimate_time(spec: ModelSpec, layout: Layout, work: Workload, hw: Hardware, microbatches: int) -> StepTime:
    local = local_model(spec, layout, work.lora)
    p, m = work.p, microbatches
    tokens_per_dp = m * work.micro_batch * work.seq
    tokens = tokens_per_dp * layout.dp
    flops = tokens * training_flops_per_token(spec, work.seq, layout.checkpointing, work.lora)
    compute = flops / layout.world / (hw.peak_flops * hw.efficiency)
    bubble = compute * (layout.pp - 1) / m if layout.pp > 1 else 0.0

    g = layout.shard_group if layout.plugin == "hybrid" else layout.dp
    ep = getattr(layout, "ep", 1)
    # what data parallelism moves: the trainable parameters (LoRA: the adapters), the routed experts
    # over their own dp/ep replicas (counted as the same bytes over a ring of g/ep ranks)
    trainable = local.adapters if work.lora else local.params
    experts = 0 if work.lora or ep == 1 else local.experts
    n = trainable - experts + experts * _ring(max(1, g // ep)) / _ring(g) if g > 1 else trainable
    ring = _ring(g)
    plugin, stage = layout.plugin, layout.zero_stage
    offload_bytes = 0.0
    if plugin == "ddp" or (plugin == "hybrid" and stage == 0):
        dp_bytes = 2 * ring * p * n
    elif plugin in ("zero", "hybrid"):
        dp_bytes = (2 if stage == 1 else 1) * ring * p * n + ring * p * n  # reduce + all-gather
        offload_bytes = 2 * p * n / g if layout.offload_optim else 0.0
    elif plugin == "fsdp":
        gathered = local.params + local.adapters if work.lora else n  # LoRA: the frozen base is gathered too
        dp_bytes = ring * (2 * p * gathered + 4 * n)  # two all-gathers, a fp32 reduce-scatter
    else:  # gemini
        dp_bytes = ring * 3 * p * n
        offload_bytes = (2 * p * n / g if layout.offload_optim else 0.0) + (2 * p * n / g if layout.offload_param else 0.0)
    dp_time = dp_bytes / hw.bandwidth
    hidden = compute if plugin in ("fsdp", "gemini") else compute * 2 / 3  # prefetch vs backward-only overlap
    dp_comm = max(0.0, dp_time - hidden)

    # one microbatch's hidden states on this rank (its sequence shard under Ulysses/ring)
    activation = work.micro_batch * work.seq / sequence_shards(layout) * spec.hidden_size * p
    tp_bytes = 0.0
    if layout.tp > 1:
        # per layer: 2 forward, 2 backward (+2 recomputed); an expert block (whole on every rank) has
        # none of its own: attention's 1 + 1 (+1)
        per_block = 2 + (1 if layout.checkpointing else 0)
        collectives = per_block * (2 - sum(spec.sparse_layers) / spec.num_layers)
        tp_bytes += m * local.layers * collectives * 2 * _ring(layout.tp) * activation
    if layout.sp_mode == "ulysses":
        # per layer: q, k, v to head shards and the output back (2q + 2kv of the rank's seq / sp
        # tokens), forward and backward, and again in the recomputed forward with checkpointing
        per_layer = (2 * spec.q_dim + 2 * spec.kv_dim) / layout.tp * work.micro_batch * work.seq / layout.sp * p
        tp_bytes += m * local.layers * (3 if layout.checkpointing else 2) * _ring(layout.sp) * per_layer
    pp_bytes = 2 * m * activation if layout.pp > 1 else 0.0
    tp_time = tp_bytes / hw.bandwidth + ring_seconds(spec, layout, work, hw, m)  # ring: seconds (its overlap)
    return StepTime(compute=compute, bubble=bubble, dp_comm=dp_comm, tp_comm=tp_time,
                    pp_comm=pp_bytes / hw.bandwidth, offload=offload_bytes / hw.host_bandwidth, tokens=tokens,
                    ep_comm=all_to_all_seconds(spec, layout, work, hw, m))
