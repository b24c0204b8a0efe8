"""Peak memory per rank of one layout: parameters, gradients, optimizer state, activations and
communication buffers, each from the model's shapes and what each plugin keeps (docs/plan.md
derives every term).

The peak is taken over the two phases of a step, on top of what lives through the whole step
(parameters, persistent gradient buffers, optimizer state):
  forward/backward — saved activations and the loss' logits at the start of backward, or the
  gradients built during backward at its end (activations are freed as gradients appear, so
  the larger of the two), plus the buffers the plugin gathers or reduces through (FSDP, whose
  root keeps its whole gradients to the end of backward, takes the largest of three moments;
  under Ulysses the last layer's output all-to-all in forward where that is higher);
  optimizer step — the gradients the step consumes plus the optimizer's temporaries.
"""
from __future__ import annotations

import dataclasses
import math

from phalanx.plan.layout import Layout
from phalanx.models import ModelSpec
from phalanx.models.heads import kv_weight_heads
from phalanx.plan.workload import Workload

FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq
ADAM_TEMPS = 2   # torch's single-tensor Adam makes about two parameter-sized temporaries


@dataclasses.dataclass(frozen=True)
class LocalModel:
    """This rank's share of the model under tp, pp and ep (the largest pipeline stage)."""
    params: int        # parameters this rank holds
    layers: int        # decoder layers on this rank's stage
    layer: int         # parameters of one (tp-split) layer
    root: int          # embedding + final norm + LM head held by this rank
    largest: int       # largest single parameter tensor (optimizer temporaries)
    has_head: bool     # this (worst) stage runs the LM head and loss
    experts: int = 0   # routed-expert parameters among `params` (sharded over their dp/ep replicas)
    adapters: int = 0  # LoRA: trainable adapter parameters on this rank (the rest is frozen)
    largest_adapter: int = 0


def _ep(layout: Layout) -> int:
    return getattr(layout, "ep", 1)


def sequence_shards(layout: Layout) -> int:
    """Pieces each sequence is cut into across ranks for everything outside attention: sp under
    Ulysses or ring (each rank embeds, normalises, routes and runs the MLP or experts on seq / sp
    tokens), else 1 (split-gather cuts only the norms' and dropout's share, over tp)."""
    return layout.sp if layout.sp_mode in ("ulysses", "ring") else 1


def _local_attention(spec: ModelSpec, t: int) -> int:
    """Attention parameters on one tp rank: heads split, key/value heads split or replicated (the
    head rule). Multi-head latent attention (DeepSeek): the per-head projections (q_proj or q_b_proj,
    kv_b_proj, o_proj) split by heads, the low-rank ones and their norms whole (the family's shard
    policy). Another layout ModelSpec counts differently is taken as split evenly over tp."""
    from phalanx.plan.lora import attention_shapes

    if getattr(spec, "mla", False):
        shapes = attention_shapes(spec, t)
        n = sum(fan_in * fan_out for fan_in, fan_out in shapes.values())
        rq, rkv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
        n += (rq if rq else 0) + rkv  # q_a_layernorm, kv_a_layernorm (whole)
        if spec.o_bias:  # q_a_proj, kv_a_proj_with_mqa (whole) and o_proj biases
            n += (rq if rq else 0) + rkv + rope + spec.hidden_size
        return n
    h, hd = spec.hidden_size, spec.head_dim

    def llama_layout(t: int) -> int:
        q = spec.q_dim // t
        kv = kv_weight_heads(spec.heads, t) * hd  # replicated key/value heads: whole on every rank
        n = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if spec.qkv_bias else 0) + (h if spec.o_bias else 0)
        return n + (2 * hd if spec.qk_norm else 0)

    if llama_layout(1) != spec.attention_params():
        return math.ceil(spec.attention_params() / t)
    return llama_layout(t)


def shared_expert_split(spec: ModelSpec) -> bool:
    """Whether the family's shard policy splits the shared expert over tp (DeepSeek's shared
    experts are column/row parallel like a dense MLP; Qwen2-MoE's stays whole with the block)."""
    if not spec.shared_expert_size:
        return False
    try:
        from phalanx.models import family_of

        policy = family_of(spec.family).policy
    except ValueError:
        return False
    return any("shared" in name for name in (*policy.mlp_column, *policy.mlp_row))


def _routed_expert_params(spec: ModelSpec) -> int:
    """All routed experts of one sparse layer (ModelSpec's own count: router and shared expert apart)."""
    return spec.num_experts * spec.expert_params()


def _local_mlp(spec: ModelSpec, i: int, t: int, ep: int = 1) -> int:
    """MLP parameters of layer i on one tensor-parallel rank: a dense MLP is split over tp; an
    expert block (router, experts, shared expert) is whole on every tp rank, as the
    mixture-of-experts shard policies keep it, with the routed experts split over ep."""
    if spec.sparse_layers[i]:
        routed, shared = _routed_expert_params(spec), spec.shared_expert_params()
        local_shared = math.ceil(shared / t) if t > 1 and shared_expert_split(spec) else shared
        return spec.moe_params() - routed + routed // ep - shared + local_shared
    h, fl = spec.hidden_size, spec.intermediate_size // t
    return (3 if spec.gated_mlp else 2) * h * fl + (((2 if spec.gated_mlp else 1) * fl + h) if spec.mlp_bias else 0)


def local_model(spec: ModelSpec, layout: Layout, lora=None) -> LocalModel:
    """Mixtures of experts: memory counts every expert this rank holds (all of them, or E/ep under
    expert parallelism); a pipeline stage is sized by the largest layer (an expert block where the
    model mixes dense and sparse layers). `lora` (a `phalanx.plan.lora.LoRA`): the adapters this
    rank holds, beside the frozen base."""
    from phalanx.plan.lora import adapter_numels, layer_adapter_params

    t, pp, ep = layout.tp, layout.pp, _ep(layout)
    h, f = spec.hidden_size, spec.intermediate_size
    attn = _local_attention(spec, t)
    layers = [attn + _local_mlp(spec, i, t, ep) + 2 * spec.norm_params() for i in range(spec.num_layers)]
    layer = max(layers)
    expert_layer = _routed_expert_params(spec) // ep
    vocab_rows = math.ceil(spec.vocab_size / t)
    embed = vocab_rows * spec.embedding_width + spec.position_table * h + spec.projection_params()
    head = vocab_rows * spec.embedding_width
    largest = max(embed, h * f // t, 2 * (spec.num_experts // ep) * spec.expert_size * h)  # experts' fused gate_up
    adapters = [layer_adapter_params(spec, lora, i, t, ep) for i in range(spec.num_layers)] if lora else []
    largest_adapter = max(adapter_numels(spec, lora, t), default=0) if lora else 0
    sparse = sum(spec.sparse_layers)
    if pp == 1:
        root = embed + spec.final_norm_params() + (0 if spec.tie_word_embeddings else head)
        return LocalModel(root + sum(layers), spec.num_layers, layer, root, largest, True,
                          experts=sparse * expert_layer, adapters=sum(adapters), largest_adapter=largest_adapter)
    base, rem = divmod(spec.num_layers, pp)
    first = base * layer + embed
    last = base * layer + head + spec.final_norm_params()  # a tied head is a second copy on the last stage
    middle = (base + (1 if rem else 0)) * layer if pp > 2 else 0
    if pp == 2 and rem:
        last += layer  # 2 stages: the extra layer goes to one of them
    worst = max(first, last, middle)
    stage_layers = base + (1 if rem else 0)
    return LocalModel(worst, stage_layers, layer, embed if worst == first else head, largest, worst == last,
                      experts=min(stage_layers, sparse) * expert_layer,
                      adapters=stage_layers * max(adapters, default=0), largest_adapter=largest_adapter)


# ---------------------------------------------------------------------------- activations
def layer_activation_bytes_per_token(spec: ModelSpec, layout: Layout, p: int, lora=None) -> float:
    """Bytes autograd saves per token in one decoder layer (HF Llama forward with SDPA, no
    attention mask; p = bytes of the compute dtype):
      each RMSNorm: its fp32 input, the fp32 reciprocal RMS, the normalised value and the output
        in the compute dtype (4h + 4 + 2ph; in fp32 the "cast" input is the input itself);
      attention: q and k after RoPE, v, SDPA's output (already in [batch, seq, heads, dim] order,
        so the o_proj input is a view of it), and SDPA's fp32 log-sum-exp per head:
        p(2q + 2kv) + 4·heads;
      MLP: gate, SiLU(gate), up and their product: 4pf.
    Parts computed on 1/tp of the heads or features are divided by tp; norms are not, unless
    split-gather sequence parallelism splits them. Checked exactly against the saved tensors of
    a transformers Llama (tests/framework/test_plan.py). Mixtures of experts: the MLP term of a
    sparse layer is an estimate (`_moe_mlp_bytes_per_token`). `lora`: frozen weights need no
    saved inputs (`_lora_activation_change`)."""
    t = layout.tp
    h, f = spec.hidden_size, spec.intermediate_size
    q = spec.q_dim / t
    kv = kv_weight_heads(spec.heads, t) * spec.head_dim
    norm = FP32 * h + FP32 + 2 * p * h
    if layout.sp_mode == "split_gather":
        norm = (FP32 * h + FP32 + p * h) / t + p * h  # the gathered norm output is whole
    attention = (_mla_bytes_per_token(spec, t, p) if getattr(spec, "mla", False)
                 else p * (2 * q + 2 * kv) + FP32 * spec.num_heads / t)
    attention += sp_saved_extra_bytes_per_token(spec, layout, p, lora)
    mlp = 4 * p * f / t
    if spec.is_moe:  # the average over layers of dense and expert-block MLPs (whole under tp; on
        # 1/tp of the tokens under split-gather sequence parallelism)
        sparse = sum(spec.sparse_layers)
        block = _moe_mlp_bytes_per_token(spec, p) + (_ep_extra_saved_bytes_per_token(spec, p) if _ep(layout) > 1 else 0)
        block /= t if layout.sp_mode == "split_gather" else 1
        mlp = (mlp * (spec.num_layers - sparse) + block * sparse) / spec.num_layers
    change = _lora_activation_change(spec, layout, p, lora) if lora is not None else 0.0
    return 2 * norm + attention + mlp + change


def _ulysses_repeats_kv(spec: ModelSpec, layout: Layout) -> bool:
    """Whether Ulysses gives every local query head its own key/value head before the all-to-all
    (`phalanx.sequence.attention.ulysses_attention_forward`: `repeat_interleave` where the key/value
    heads a tp rank attends with, kv_heads / tp or one, do not divide by sp)."""
    return max(1, spec.num_kv_heads // layout.tp) % layout.sp != 0


def sp_saved_extra_bytes_per_token(spec: ModelSpec, layout: Layout, p: int, lora=None) -> float:
    """What a decoder layer saves under Ulysses or ring attention (`phalanx.sequence`) beyond the
    SDPA layer `layer_activation_bytes_per_token` counts, per token of the rank's shard:
      o_proj's input, p·q: both return attention's output as [B, heads, L, D] (Ulysses: fresh from
        the all-to-all, [B, heads, L/sp, D]), and transformers' transpose(1, 2).contiguous() copies
        it into [B, L, heads·D], which o_proj saves for its weight's gradient, while the attention
        keeps its own output for its backward (plain SDPA's output is already in [B, L, H, D]
        order, so o_proj's input is a view of it there) — only where o_proj's weight takes a
        gradient (not under LoRA without an o_proj adapter);
      Ulysses, where the key/value heads are repeated for the all-to-all (`_ulysses_repeats_kv`):
        the attention kernel saves the repeated key and value, q wide each: 2p·(q − kv).
    Equal to the storages autograd keeps in a transformers Llama under Ulysses sp 4 on four gloo
    ranks, with and without the repeat (tests/framework/test_plan_ulysses.py). Latent attention
    (DeepSeek): not counted (its o_proj copy is in `_mla_bytes_per_token` already)."""
    if layout.sp_mode not in ("ulysses", "ring") or layout.sp < 2 or getattr(spec, "mla", False):
        return 0.0
    q = spec.q_dim / layout.tp
    kv = kv_weight_heads(spec.heads, layout.tp) * spec.head_dim
    extra = p * q if lora is None or "o_proj" in lora.target_modules else 0.0
    if layout.sp_mode == "ulysses" and _ulysses_repeats_kv(spec, layout):
        extra += 2 * p * (q - kv)
    return extra


# Bytes per byte of the exchanged tensor that one Ulysses all-to-all (`phalanx.sequence.comm`) holds
# beyond its input while it runs on gloo: the contiguous chunks it sends, the chunks it receives, and
# gloo's flattened send and receive buffers (torch's gloo all_to_all of tensor lists concatenates
# both). NCCL sends the chunks as they are: 3 there (the chunks, those received and their
# concatenation), so the count is conservative by one tensor on a GPU, as FSDP's gloo receive
# buffer is.
ULYSSES_ALL_TO_ALL_COPIES = 4


def ulysses_forward_excess_bytes_per_token(spec: ModelSpec, layout: Layout, p: int, lora=None) -> float:
    """Under Ulysses the peak of forward/backward can be the last layer's attention in forward rather
    than the start of backward: while its output goes back through the all-to-all, the rank holds the
    saved activations of the layers before it, and of this layer its first norm, the query, key and
    value twice (the caller's RoPE'd tensors, which transformers' attention keeps as locals until
    the attention function returns, p·(q + 2kv) — plus the repeated key and value, 2p·q, where
    `_ulysses_repeats_kv` — and the all-to-all'd ones the kernel saves), the kernel's output and
    log-sum-exp, and the exchange's ULYSSES_ALL_TO_ALL_COPIES · p·q. Against the activations at the
    start of backward, which hold that layer whole (its second norm, its MLP and o_proj's copy,
    none made yet) and the final norm, this moment holds, per token of the rank's shard,
      p·(q + 2kv) [+ 2p·q] + (COPIES − 1)·p·q − norm − mlp − final norm
    (mlp: the last layer's MLP or expert block). The estimate takes the larger of this moment and
    the start of backward (which adds the loss' working set instead): on attention-heavy models with
    a small vocabulary this one is the peak (measured: tests/framework/test_plan_ulysses.py,
    docs/plan.md). Returns 0 where it is no peak candidate: not Ulysses, latent attention, LoRA
    (whose saved set differs: not measured). With activation checkpointing the same moment comes in
    the last layer's recomputation (not measured)."""
    if layout.sp_mode != "ulysses" or layout.sp < 2 or getattr(spec, "mla", False) or lora is not None:
        return 0.0
    t = layout.tp
    h, q = spec.hidden_size, spec.q_dim / t
    kv = kv_weight_heads(spec.heads, t) * spec.head_dim
    held = p * (q + 2 * kv) + (2 * p * q if _ulysses_repeats_kv(spec, layout) else 0)
    norm = FP32 * h + FP32 + 2 * p * h  # as in layer_activation_bytes_per_token (no split-gather here)
    if spec.is_moe and spec.sparse_layers[-1]:
        mlp = _moe_mlp_bytes_per_token(spec, p) + (_ep_extra_saved_bytes_per_token(spec, p) if _ep(layout) > 1 else 0)
    else:
        mlp = 4 * p * spec.intermediate_size / t
    return held + (ULYSSES_ALL_TO_ALL_COPIES - 1) * p * q - norm - mlp - norm


def ring_kv_width(spec: ModelSpec, t: int) -> float:
    """Elements per token of the key and value blocks ring attention passes around, on one tp rank:
    2 · key/value heads · head_dim (heads split over tp, or one per rank where replicated);
    latent attention (DeepSeek) hands attention every head's key (qk width) and value (v width)."""
    if getattr(spec, "mla", False):
        return spec.num_heads / t * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
    return 2 * kv_weight_heads(spec.heads, t) * spec.head_dim


def ring_buffer_bytes_per_token(spec: ModelSpec, layout: Layout, p: int) -> float:
    """What ring attention (`phalanx.sequence.ring`) holds beyond its saved tensors while one layer's
    attention runs backward, per token of the rank's sequence shard: the fp32 accumulators of the
    queries' gradient (4·q) and of the visiting block's key/value gradients (4·kv), twice for the
    latter while they travel on to the next rank (the block sent and the one received), and the
    key/value blocks in flight, min(2, sp − 1) of them (the one in use and the next one received
    while it is used; with sp = 2 only the one received). Forward holds less (the next block and the
    fp32 output and log-sum-exp accumulators, 4·q + 4·heads, with the layers' activations not yet
    all saved), so backward's is what the peak sees. q = q_dim / tp; kv = `ring_kv_width`.
    (On a CPU the blocks run torch's reference, which also materialises each block's fp32 scores,
    batch × heads × (seq / 2sp)² several times: not counted: on a GPU the flash kernel keeps none.)"""
    if layout.sp_mode != "ring" or layout.sp < 2:
        return 0.0
    mla = getattr(spec, "mla", False)
    q = (spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim) if mla else spec.q_dim) / layout.tp
    kv = ring_kv_width(spec, layout.tp)
    return FP32 * q + 2 * FP32 * kv + min(2, layout.sp - 1) * p * kv


def _mla_bytes_per_token(spec: ModelSpec, t: int, p: int) -> float:
    """Multi-head latent attention (DeepSeek-V2/V3 in transformers, SDPA), per token on one tp rank
    (heads split, the low-rank paths whole on every rank, as the shard policy splits them):
      the query's low-rank path (q_lora_rank > 0): q_a_layernorm as any RMSNorm, 4·rq + 4 + 2p·rq
        (its fp32 input, reciprocal RMS, normalised value, and its output, q_b_proj's input);
      the key/value latent: kv_a_layernorm likewise over kv_lora_rank, 4·rkv + 4 + 2p·rkv; in fp32
        the "cast" input is a slice of kv_a_proj_with_mqa's output, which keeps the whole
        kv_lora_rank + qk_rope_head_dim storage alive (+4·rope);
      SDPA's saved tensors: the query and the key (fresh concatenations of the no-RoPE and RoPE
        parts: p·heads·qk each), the value (a slice of kv_b_proj's output, whose storage holds the
        keys' no-RoPE part too: p·heads·(nope + v)), its output (p·heads·v) and fp32 log-sum-exp
        (4·heads);
      o_proj's input, a copy of SDPA's output: the query is laid out [batch, heads, seq, dim], the
        output follows that layout, and transformers transposes it back to [batch, seq, ...] with a
        copy (p·heads·v).
    Checked exactly against the storages autograd saves in transformers' DeepSeek-V2 and V3 layers
    (fp32 and bf16, with and without q_lora_rank; tests/framework/test_plan.py). (With
    v_head_dim != the query/key head width, torch's CPU SDPA falls back to its math kernel, which
    keeps the heads × seq attention probabilities instead; GPUs run the memory-efficient kernel,
    which keeps what is counted here.)"""
    heads = spec.num_heads / t
    rq, rkv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, v = spec.qk_nope_head_dim, spec.v_head_dim
    qk = nope + rope
    q_path = (FP32 * rq + FP32 + 2 * p * rq) if rq else 0
    kv_path = FP32 * rkv + FP32 + 2 * p * rkv + (FP32 * rope if p == FP32 else 0)
    sdpa = p * heads * (2 * qk + (nope + v) + v) + FP32 * heads
    return q_path + kv_path + sdpa + p * heads * v


# What phalanx.shard.expert_parallel's forward keeps beyond transformers' expert path: the int64
# indices of its two gathers (the experts' outputs back to arrival order, then to [token, k]
# order), one per assignment each. (Until 2026-12-06 it put them back with index_copy_ /
# index_add_, whose sources autograd kept whole: 2 · k · hidden values per token.)
EP_EXTRA_INDICES = 2


def _ep_extra_saved_bytes_per_token(spec: ModelSpec, p: int) -> float:
    """What the expert-parallel block keeps per token beyond `_moe_mlp_bytes_per_token`:
    EP_EXTRA_INDICES int64 indices per assignment (measured on one process against transformers'
    experts: 32 bytes per token and layer at k = 2, in fp32 and bf16)."""
    return EP_EXTRA_INDICES * spec.experts_per_token * 8


def _lora_activation_change(spec: ModelSpec, layout: Layout, p: int, lora) -> float:
    """What LoRA changes in a layer's saved tensors, per token (averaged over dense and sparse
    layers): autograd saves a linear layer's input, and a norm's normalised value, only for the
    weight's gradient, so with the base frozen
      each norm's normalised value goes (−ph each);
      a norm's output stays only where an adapter reads it (attention's if q/k/v is adapted, the
        MLP's if gate/up of a dense MLP or of the shared expert is): −ph each otherwise;
      the down projection's input goes unless down_proj is adapted (−pf; the shared expert's −pI_s);
      the routed experts (frozen, without `target_parameters`) keep no gathered input and no
        down-projection input: −k·p(h + I);
      every adapter keeps its A's output: +p·r per adapted module;
      latent attention (DeepSeek): the latent norms' normalised values go (−p·rq − p·rkv), q_b_proj's
        and kv_b_proj's inputs stay only where they are adapted, and o_proj's input (a copy of
        SDPA's output, −p·heads·v) only where o_proj is.
    Checked exactly against the saved tensors of transformers Llama, Mixtral, Qwen2-MoE and
    DeepSeek-V2 layers under PEFT (tests/framework/test_plan_moe.py)."""
    from phalanx.plan.lora import ATTENTION, MLA, MLP

    t = layout.tp
    split = layout.sp_mode == "split_gather"
    h, r = spec.hidden_size, lora.rank
    targets = set(lora.target_modules)
    normed = p * h / t if split else p * h
    change = -2 * normed + p * r * len(targets & set(ATTENTION + MLA))
    if not targets & {"q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"}:
        change -= p * h
    if getattr(spec, "mla", False):  # latent attention's frozen norms and projections
        rq, rkv = spec.q_lora_rank, spec.kv_lora_rank
        change -= p * rkv + (0 if "kv_b_proj" in targets else p * rkv)
        if rq:
            change -= p * rq + (0 if "q_b_proj" in targets else p * rq)
        if "o_proj" not in targets:
            change -= p * spec.num_heads / t * spec.v_head_dim
    reads_mlp_input = bool(targets & {"gate_proj", "up_proj"})
    dense = p * r * len(targets & set(MLP)) - (0 if reads_mlp_input else p * h)
    dense -= 0 if "down_proj" in targets else p * spec.intermediate_size / t
    if not spec.is_moe:
        return change + dense
    shared = spec.shared_expert_size
    block = p * r * len(targets & set(MLP)) if shared else 0
    if not ((shared and reads_mlp_input) or lora.target_parameters):
        block -= p * h  # the MLP norm's output: the router and experts are frozen
    if shared and "down_proj" not in targets:
        block -= p * shared
    if not lora.target_parameters:
        block -= spec.experts_per_token * p * (h + spec.expert_size)
    block /= t if split else 1
    sparse = sum(spec.sparse_layers)
    return change + (dense * (spec.num_layers - sparse) + block * sparse) / spec.num_layers


def _moe_mlp_bytes_per_token(spec: ModelSpec, p: int) -> float:
    """An expert block, per token (estimate): the router's fp32 logits and probabilities (8·E),
    for each of its top-k experts the gathered input, the SwiGLU's four tensors and the expert's
    output kept for the routing weight's product (k·p(2h + 4I): transformers' loop over experts and
    the expert-parallel grouped path save the same), and the shared expert's SwiGLU plus, with its
    sigmoid gate, the gate's output and the shared expert's output kept for their product
    (4p·I_shared + p + ph); the routing's int64 indices (each assignment's token and slot, the
    top-k indices: 24·k) and, where the top-k weights are renormalised, the fp32 weights and their
    sum (4k + 4). Against the saved tensors of transformers' Mixtral and Qwen2-MoE layers (fp32 and
    bf16, with and without LoRA) it is 8.25 bytes per token short (0.2-0.4% of the layer;
    tests/framework/test_plan_moe.py). DeepSeek's router computes its logits in fp32, keeping an
    fp32 copy of the block's input below fp32 (4h); with it DeepSeek-V2/V3's blocks are short by
    the same 8.25 bytes per token (tests/framework/test_plan.py)."""
    k = spec.experts_per_token
    routed = k * p * (2 * spec.hidden_size + 4 * spec.expert_size) + 24 * k + ((4 * k + 4) if spec.norm_topk_prob else 0)
    shared = 4 * p * spec.shared_expert_size + ((p + p * spec.hidden_size) if spec.shared_expert_gate else 0)
    # DeepSeek's router computes its logits in fp32: below fp32 it keeps an fp32 copy of the block's input
    router_input = FP32 * spec.hidden_size if spec.family.startswith("deepseek") and p != FP32 else 0
    return 2 * FP32 * spec.num_experts + routed + shared + router_input


def kv_cache_bytes_per_token(spec: ModelSpec, tp: int = 1, p=2) -> int:
    """Serving's KV cache per token on one tensor-parallel rank, all layers; p: bytes per element (1,
    2, 4, 8) or a torch dtype. The engine's own count (`phalanx.models.heads.kv_bytes_per_block`
    for a block of one token), so plan and engine cannot disagree: multi-head latent attention
    (DeepSeek-V2/V3) caches the compressed latent, kv_lora_rank + qk_rope_head_dim per layer, whole
    on every tp rank, as transformers' own cache does; other attention each key/value head's key and
    value, 2 · kv_heads · head_dim per layer, the key/value heads split over tp, or one per rank where
    they are replicated."""
    import torch

    from phalanx.models.heads import kv_bytes_per_block

    dtypes = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
    dtype = p if isinstance(p, torch.dtype) else dtypes.get(p)
    if dtype is None:
        raise ValueError(f"kv_cache_bytes_per_token: p={p!r} must be bytes per element (1, 2, 4 or 8) or a torch dtype")
    return kv_bytes_per_block(spec, 1, tp, dtype)


def loss_bytes_per_token(spec: ModelSpec, layout: Layout, work: Workload) -> float:
    """The LM head + cross-entropy at the start of backward. "hf": the fp32 log-softmax output
    (saved), its gradient and the gradient of its input live together in log-softmax's backward:
    12·V bytes per token in any compute dtype (the logits themselves are not saved; in bf16 the
    fp32 copy is freed after the forward, and the bf16 gradient appears after the saved output
    is released). "fused": chunked, about one chunk of logits (counted as 0 per token)."""
    if work.loss == "fused":
        return 0.0
    return 3 * FP32 * spec.vocab_size / layout.tp


def _rope_table_bytes_per_position(spec: ModelSpec, p: int) -> float:
    """RoPE's tables saved by the rotation (per position, shared by the batch): cos and sin over the
    head (2p·head_dim); multi-head latent attention rotates only the rope part, with a complex64
    table in DeepSeek-V2 (8 bytes per pair: 4·rope) and cos and sin in DeepSeek-V3 (2p·rope)."""
    if getattr(spec, "mla", False):
        return FP32 * spec.qk_rope_head_dim if spec.family == "deepseek_v2" else 2 * p * spec.qk_rope_head_dim
    return 2 * p * spec.head_dim


def activation_bytes(spec: ModelSpec, layout: Layout, work: Workload, local: LocalModel, microbatches: int) -> dict:
    """{"activations": saved tensors at the start of backward, "loss": the head's working set}."""
    p = work.p
    tokens = work.micro_batch * work.seq / sequence_shards(layout)
    per_layer = layer_activation_bytes_per_token(spec, layout, p, work.lora)
    if layout.checkpointing:
        kept = p * spec.hidden_size / (layout.tp if layout.sp_mode == "split_gather" else 1)
        one_microbatch = tokens * (local.layers * kept + per_layer)
    else:
        one_microbatch = tokens * local.layers * per_layer
    # outside the layers: the final norm, the input ids (int64), RoPE's cos and sin (per position)
    one_microbatch += tokens * (FP32 * spec.hidden_size + FP32 + 2 * p * spec.hidden_size + 8
                                + _rope_table_bytes_per_position(spec, p) / work.micro_batch)
    if layout.pp == 1:
        in_flight = 1
    else:
        in_flight = microbatches if layout.pp_schedule == "gpipe" else min(microbatches, layout.pp)
    loss = tokens * loss_bytes_per_token(spec, layout, work) if local.has_head else 0.0
    return {"activations": one_microbatch * in_flight, "loss": loss}


# ---------------------------------------------------------------------------- the estimate
@dataclasses.dataclass
class MemoryEstimate:
    """Per-rank bytes by part at the peak, on the device and on the host."""
    device: dict[str, float]
    host: dict[str, float]
    phase: str          # which phase makes the peak: "backward" or "step"
    activations: float  # saved activations at the start of backward (whatever the peak phase)
    loss: float         # the LM head and loss' working set at the start of backward

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


@dataclasses.dataclass
class _Parts:
    """What one plugin keeps, before the phases are combined."""
    device: dict[str, float] = dataclasses.field(default_factory=lambda: {
        "parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "buffers": 0.0})
    host: dict[str, float] = dataclasses.field(default_factory=lambda: {
        "parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "temporaries": 0.0})
    built: float = 0.0           # gradients created bit by bit during backward, live until the step
    early: float = 0.0           # gradient buffers allocated whole at backward's first reduction
    backward_extra: float = 0.0  # buffers alive only during forward/backward
    step_extra: float = 0.0      # temporaries alive only during the optimizer step
    # (what lies under backward_extra at backward's peak: "activations" or "gradients", bytes), where
    # the plugin works its backward peak out itself (FSDP); None: the larger of saved and built
    backward_floor: tuple[str, float] | None = None


def _replicated(local: LocalModel, layout: Layout, work: Workload) -> _Parts:
    """DDP, and the hybrid plugin without ZeRO: every rank keeps everything (fp32 masters when mixed)."""
    n, p = local.params, work.p
    out = _Parts()
    out.device["parameters"] = p * n
    if layout.plugin == "ddp":
        out.device["gradients"] = p * n  # DDP's buckets; the .grad tensors are views of them
    else:
        out.built = p * n
    out.device["optimizer"] = (FP32 * n if work.mixed else 0) + ADAM_STATES * FP32 * n
    # bf16: fp32 copies of the gradients for the masters; Adam's temporaries of the largest tensor
    out.step_extra = (FP32 * n if work.mixed else 0) + ADAM_TEMPS * FP32 * local.largest
    return out


def zero_shard(local: LocalModel, layout: Layout) -> int:
    """Elements of this rank's ZeRO partition: the dense parameters over dp × sp; under expert
    parallelism the routed experts over their own replicas, dp / ep ranks (`ExpertZeroOptimizer`'s
    twin optimizer, docs/moe.md)."""
    ep = _ep(layout)
    if ep == 1 or not local.experts:
        return math.ceil(local.params / layout.shard_group)
    return (math.ceil((local.params - local.experts) / layout.shard_group)
            + math.ceil(local.experts / max(1, layout.shard_group // ep)))


def _zero(local: LocalModel, layout: Layout, work: Workload) -> _Parts:
    """ZeRO-1/2 (ZeroPlugin, or the hybrid plugin's zero_stage over dp × sp; experts over dp/ep)."""
    n, p = local.params, work.p
    shard = zero_shard(local, layout)
    out = _Parts()
    out.device["parameters"] = p * n
    if layout.zero_stage == 1:
        out.device["gradients"] = p * n  # the persistent flat gradient buffer
    else:
        out.backward_extra = min(p * n, 2 * work.bucket_mb * 2**20)  # buckets in flight
        out.backward_extra += p * local.largest  # autograd's .grad before the hook copies it
    side = out.host if layout.offload_optim else out.device
    # master shard + moments; an fp32 model's master is its own slice of the parameters
    shares_master = p == FP32 and not layout.offload_optim
    side["optimizer"] = (ADAM_STATES if shares_master else 1 + ADAM_STATES) * FP32 * shard
    if layout.offload_optim:
        out.host["gradients"] = FP32 * shard
        out.host["temporaries"] = ADAM_TEMPS * FP32 * shard  # the update runs on the host
        out.step_extra = p * shard  # the updated shard copied back to the device for the all-gather
    else:
        out.early = FP32 * shard  # the fp32 gradient shard is created whole at the first fold
        # the update's temporaries, and the shard cast to the compute dtype for the all-gather
        out.step_extra = ADAM_TEMPS * FP32 * shard + (p * shard if work.mixed else 0)
    return out


def _fsdp(spec: ModelSpec, local: LocalModel, layout: Layout, work: Workload, act: dict) -> _Parts:
    """FSDP2 on every block and the root, fp32 sharded parameters, compute-dtype gathers, fp32
    gradient reduction (reduce-scatter input in fp32, output viewed as the sharded gradient).
    The root (embedding, final norm, head) stays gathered through forward and backward, and its
    gradients stay whole until its reduce-scatter, the last of backward, so backward's peak is
    the largest of three moments (`_fsdp_backward_peak`)."""
    shard = math.ceil(local.params / layout.world)
    out = _Parts()
    out.device["parameters"] = FP32 * shard
    out.device["optimizer"] = ADAM_STATES * FP32 * shard
    out.built = FP32 * shard
    out.backward_floor, out.backward_extra = _fsdp_backward_peak(spec, local, layout, work, act)
    out.step_extra = ADAM_TEMPS * FP32 * math.ceil(local.largest / layout.world)
    return out


def _fsdp_backward_peak(spec: ModelSpec, local: LocalModel, layout: Layout, work: Workload,
                        act: dict) -> tuple[tuple[str, float], float]:
    """((what lies under the buffers, its bytes), the buffers) at the largest of
      start of backward: every saved activation and the loss' working set; the root gathered,
        the last block (kept gathered after forward) and the next one prefetched;
      through the blocks: the layers' activations (the loss' working set is gone) or the blocks'
        gradient shards made so far; the root gathered, the LM head's whole gradient (made
        first, kept until the root's reduce), two blocks gathered, one block's gradients and
        their fp32 reduce-scatter input, and the previous block's, which FSDP2 keeps until the
        next reduce (`reduce_scatter_max_input_buffers`, 1), in place of the current one's
        gradients once those are copied in; on gloo the pending block's all-to-all receive buffer
        (mixed precision on gloo: input and receive buffer in the compute dtype);
      end of backward: the blocks' gradient shards (the root's own shard is made after its
        reduce); the root's whole gradients (the embedding's, the last made) with, before the
        root reshards, its gathered parameters and the last block's reduce-scatter input and
        receive buffer, after it, their fp32 reduce-scatter input (an in-place all-reduce; in
        mixed precision on gloo a compute-dtype input and receive buffer, no larger).
    Every term is in the model's shapes; p = bytes of the compute dtype."""
    p, root, block = work.p, local.root, local.layer
    blocks_built = FP32 * math.ceil((local.params - root) / layout.world)
    head_grad = p * math.ceil(spec.vocab_size / layout.tp) * spec.hidden_size
    start = (("activations", act["activations"] + act["loss"]), p * root + 2 * p * block)
    floor = (("activations", act["activations"]) if act["activations"] >= blocks_built
             else ("gradients", blocks_built))
    # On gloo a block's reduce-scatter is an all-to-all into a receive buffer as large as its input
    # (fsdp_comms): the pending block's through the blocks (measured at 158M: +0.8 of an fp32 block),
    # the last block's beside its input at the end; the root's reduce is an in-place all-reduce.
    # A rank whose slice is at either end of the input leaves it out of the exchange
    # (`zero.comm.OwnPartExchange`): with two ranks the buffer is half the input; with more, the
    # ranks in the middle receive every copy. (Conservative by those buffers on NCCL.)
    receive = FP32 * block / 2 if layout.world == 2 else FP32 * block
    # Mixed precision on gloo: the input and receive buffer hold the compute dtype (p * block and
    # half or all of that again: fsdp_comms.GlooReduceScatter), never more than NCCL's fp32 input.
    reduce_buffers = FP32 * block if work.mixed else FP32 * block + receive
    through = (floor, p * root + head_grad + 2 * p * block + p * block + reduce_buffers)
    end = (("gradients", blocks_built), p * root + max(p * root + reduce_buffers, FP32 * root))
    return max(start, through, end, key=lambda moment: moment[0][1] + moment[1])


def _fsdp_lora(local: LocalModel, layout: Layout, work: Workload, act: dict) -> _Parts:
    """FSDP2 with LoRA: every parameter sharded in fp32 (the frozen base too), gathered per block
    in the compute dtype; gradients, their reduce-scatter and the optimizer state are the adapters'
    alone. Backward's peak: the saved activations (or the adapters' gradient shards) with the root
    and two blocks gathered."""
    world, p = layout.world, work.p
    out = _Parts()
    out.device["parameters"] = FP32 * math.ceil((local.params + local.adapters) / world)
    out.device["optimizer"] = ADAM_STATES * FP32 * math.ceil(local.adapters / world)
    out.built = FP32 * math.ceil(local.adapters / world)
    saved = act["activations"] + act["loss"]
    out.backward_floor = ("activations", saved) if saved >= out.built else ("gradients", out.built)
    out.backward_extra = p * local.root + 2 * p * local.layer + FP32 * local.adapters / max(1, local.layers)
    out.step_extra = ADAM_TEMPS * FP32 * math.ceil(local.largest_adapter / world)
    return out


def _gemini(spec: ModelSpec, local: LocalModel, layout: Layout, work: Workload) -> _Parts:
    """Gemini (static placement): compute-dtype shards, fp32 master (the shard itself in fp32 when
    both share a tier)/moments/gradient per chunk, all with the chunks' padding. With LoRA only the
    adapters go into chunks (the frozen base stays on the device, counted by the caller)."""
    from phalanx.plan.chunks import gemini_chunks
    from phalanx.plan.lora import adapter_numels

    p = work.p
    numels = adapter_numels(spec, work.lora, layout.tp) if work.lora else None
    chunk_numel, padded = gemini_chunks(spec, layout.world, p, work.gemini_chunk_mb, layout.tp, numels=numels)
    shard, chunk = padded // layout.world, chunk_numel * p  # elements per rank (padding included); bytes
    out = _Parts()
    (out.host if layout.offload_param else out.device)["parameters"] = p * shard
    side = out.host if layout.offload_optim else out.device
    # fp32 chunks whose shard and optimizer state share a tier: the master IS the shard
    # (phalanx.gemini.chunk.SHARE_FP32_MASTER), so only the two moments are extra
    shares_master = p == FP32 and bool(layout.offload_param) == bool(layout.offload_optim)
    side["optimizer"] = (ADAM_STATES if shares_master else 1 + ADAM_STATES) * FP32 * shard
    side["gradients"] = FP32 * shard  # fp32 gradient shards, allocated at boost
    # at the start of backward: the LM head's chunks (held by the root from the first forward until
    # their gradient is reduced) and their gradient buffer, and one chunk gathered ahead
    head = 0 if work.lora else p * spec.vocab_size * spec.hidden_size / layout.tp  # LoRA: the head is frozen
    out.backward_extra = min(p * padded, 2 * head + chunk)
    chunk_shard = min(shard, chunk / p / layout.world)
    # Gemini's Adam makes one temporary per chunk (the denominator)
    if layout.offload_optim:
        out.host["temporaries"] = FP32 * chunk_shard
        out.step_extra = p * chunk_shard
    else:
        out.step_extra = FP32 * chunk_shard
    return out


def estimate_memory(spec: ModelSpec, layout: Layout, work: Workload, microbatches: int = 1) -> MemoryEstimate:
    """Per-rank peak of `layout` (see the module docstring for the phases). With `work.lora` the
    plugin's terms are those of the adapters (the trainable parameters) and the frozen base is
    added in the compute dtype (FSDP: sharded in fp32 like every parameter)."""
    local = local_model(spec, layout, work.lora)
    act = activation_bytes(spec, layout, work, local, microbatches)
    trainable = local
    if work.lora:  # the plugins see the adapters only (Booster.boost drops the frozen base from the optimizer)
        trainable = dataclasses.replace(local, params=local.adapters, layer=local.adapters // max(1, local.layers),
                                        root=0, largest=local.largest_adapter, experts=0)
    if layout.plugin == "ddp" or (layout.plugin == "hybrid" and layout.zero_stage == 0):
        parts = _replicated(trainable, layout, work)
    elif layout.plugin in ("zero", "hybrid"):
        parts = _zero(trainable, layout, work)
    elif layout.plugin == "fsdp":
        parts = _fsdp_lora(local, layout, work, act) if work.lora else _fsdp(spec, local, layout, work, act)
    elif layout.plugin == "gemini":
        parts = _gemini(spec, trainable, layout, work)
    else:
        raise ValueError(f"unknown plugin {layout.plugin!r}")
    if work.lora and layout.plugin != "fsdp":  # the frozen base, whole on the rank in the compute dtype
        parts.device["parameters"] += work.p * local.params
    if layout.tp > 1 or layout.pp > 1:  # all-reduce / send-recv buffers of one activation (the rank's tokens)
        parts.backward_extra += 2 * work.p * work.micro_batch * work.seq / sequence_shards(layout) * spec.hidden_size
    if layout.sp_mode == "ring":  # ring attention's gradient accumulators and blocks in flight (one layer)
        parts.backward_extra += (work.micro_batch * work.seq / sequence_shards(layout)
                                 * ring_buffer_bytes_per_token(spec, layout, work.p))
    if _ep(layout) > 1:  # one all-to-all's send and receive buffers: the k assignments of the rank's
        # tokens (its sequence shard under Ulysses/ring)
        tokens = work.micro_batch * work.seq / sequence_shards(layout)
        parts.backward_extra += 2 * work.p * tokens * spec.experts_per_token * spec.hidden_size

    saved = act["activations"] + act["loss"]
    if parts.backward_floor is None:
        floor = ("activations", saved) if saved >= parts.built else ("gradients", parts.built)
    else:
        floor = parts.backward_floor
    backward = floor[1] + parts.early + parts.backward_extra
    # Ulysses: the last layer's attention output in its all-to-all, in forward (no loss, no
    # backward buffers yet), where that is higher than the start of backward
    ulysses = (work.micro_batch * work.seq / sequence_shards(layout)
               * ulysses_forward_excess_bytes_per_token(spec, layout, work.p, work.lora))
    if act["activations"] + ulysses + parts.early > backward:
        floor, backward = ("activations", act["activations"]), act["activations"] + ulysses + parts.early
        parts.backward_extra = ulysses  # reported as buffers: the exchange and the layer's held tensors
    step = parts.built + parts.early + parts.step_extra
    device = dict(parts.device, activations=0.0, temporaries=0.0)
    device["gradients"] += parts.early
    if backward >= step:
        phase = "backward"
        device[floor[0]] += floor[1]
        device["buffers"] += parts.backward_extra
    else:
        phase = "step"
        device["gradients"] += parts.built
        device["temporaries"] = parts.step_extra
    return MemoryEstimate(device=device, host={k: v for k, v in parts.host.items() if v}, phase=phase,
                          activations=act["activations"], loss=act["loss"])
