"""DeepSeek-V2 and DeepSeek-V3 (transformers' `deepseek_v2` / `deepseek_v3`, unmodified).

Attention is multi-head latent attention (MLA): queries through a low-rank `q_a_proj` (hidden ->
q_lora_rank), its RMSNorm `q_a_layernorm` and the per-head `q_b_proj`, or, without q_lora_rank
(V2-Lite), one per-head `q_proj`; keys and values from `kv_a_proj_with_mqa` (hidden ->
kv_lora_rank + qk_rope_head_dim: the latent and one rope key shared by every head), its RMSNorm
`kv_a_layernorm` and the per-head `kv_b_proj` (kv_lora_rank -> heads · (qk_nope_head_dim +
v_head_dim)); `o_proj` reads heads · v_head_dim.

Layers from `first_k_dense_replace` on are expert blocks: a router `mlp.gate` (weight
[experts, hidden]), `n_routed_experts` fused SwiGLU experts of width `moe_intermediate_size`
(`mlp.experts.gate_up_proj` / `down_proj`, as Mixtral and Qwen-MoE in transformers 5) and
always-on shared experts `mlp.shared_experts` (one SwiGLU of width moe_intermediate_size ·
n_shared_experts, no gate); the first layers are dense MLPs of `intermediate_size`.

Routing is transformers' own module, run as it is: V2 softmax scores, top-k greedy or
group-limited greedy (`topk_method`, `n_group`, `topk_group`), never renormalised, times
`routed_scaling_factor`; V3 sigmoid scores, groups ranked by the sum of their two best scores
plus `e_score_correction_bias`, top-k inside the `topk_group` best groups, the chosen scores (without
the bias) renormalised if `norm_topk_prob`, times `routed_scaling_factor`. transformers computes
no load-balancing loss for either (its loss is the cross-entropy); V3's bias is a buffer that
nothing updates: `BiasBalancer` below is the paper's aux-loss-free update (docs/models.md), and
`BalanceLoss` DeepSeek's own auxiliary losses (V2's expert-level balance loss, V3's complementary
sequence-wise one) from the routers' choices, which HybridParallelPlugin adds to the loss when
config.output_router_logits=True with config.aux_loss_alpha (docs/moe.md).

Tensor parallelism (POLICY): the per-head projections (`q_proj` or `q_b_proj`, `kv_b_proj`) are
split by heads along their output features and `o_proj` by its input features; the low-rank
down projections and their norms are replicated, their gradients (each rank's heads' share)
summed over the group. Dense MLPs and the shared experts are split like a Llama MLP (gate/up
column, down row); the router and the routed experts stay whole on every rank (expert
parallelism splits those: HybridParallelPlugin(ep_size=...), docs/moe.md).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from phalanx.models import llama, moe
from phalanx.models.family import Family, heads_reader
from phalanx.models.heads import HeadCounts
from phalanx.models.names import NameTable, at
from phalanx.models.policy import Policy
from phalanx.models.routers import RouterCall, RouterRecorder, named_expert_routers
from phalanx.models.shape_inference import in_shape_inference

REQUIRED = (*llama.REQUIRED, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim")


def read_v2(config) -> dict:
    return _read(config, version=2)


def read_v3(config) -> dict:
    return _read(config, version=3)


def _read(config, version: int) -> dict:
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    mlp_bias = version == 2 and bool(getattr(config, "mlp_bias", False))  # V3's MLPs never carry biases
    first_dense = config.first_k_dense_replace or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise ValueError(f"{config.model_type}: num_key_value_heads={kv_heads} differs from num_attention_heads="
                         f"{heads}; multi-head latent attention expands its latent to every head (set them equal)")
    return dict(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
        norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
        o_bias=bool(getattr(config, "attention_bias", False)), mlp_bias=mlp_bias,
        activation=getattr(config, "hidden_act", "silu"),
        num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok or 0,
        expert_size=config.moe_intermediate_size,
        shared_expert_size=config.moe_intermediate_size * (config.n_shared_experts or 0), shared_expert_bias=mlp_bias,
        norm_topk_prob=version == 3 and bool(config.norm_topk_prob),  # V2's router never renormalises
        sparse_layers=tuple(i >= first_dense for i in range(layers)),
        q_lora_rank=config.q_lora_rank or 0, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim)


def check_inference(config) -> None:
    """What phalanx.inference runs of DeepSeek (phalanx/inference/mla.py): SiLU MLPs and experts,
    RoPE fixed in length (YaRN included), routing by transformers' V2 methods (greedy,
    group_limited_greedy) or V3's sigmoid group routing, groups that divide the experts."""
    llama.check_llama_like(config)
    moe.check_moe_inference(config)
    method = getattr(config, "topk_method", "greedy")
    if config.model_type == "deepseek_v2" and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2: topk_method={method!r} is not a routing transformers' DeepseekV2 runs; "
                         f"use 'greedy' or 'group_limited_greedy' (V3's sigmoid routing: model_type deepseek_v3)")
    grouped = config.model_type == "deepseek_v3" or method == "group_limited_greedy"
    groups, top = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1
    if grouped and (config.n_routed_experts % groups or not 0 < top <= groups):
        raise ValueError(f"{config.model_type}: n_group={groups} must divide n_routed_experts="
                         f"{config.n_routed_experts} and topk_group={top} lie in 1..n_group; fix the config's "
                         f"routing groups")
    if config.model_type == "deepseek_v3" and config.n_routed_experts // groups < 2:
        raise ValueError(f"deepseek_v3: n_group={groups} leaves {config.n_routed_experts // groups} expert per group; "
                         f"V3 ranks groups by their two best experts: use n_group <= {config.n_routed_experts // 2}")


LOW_RANK = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")

NAMES = NameTable(
    prefixes=("model.",), layer_prefix="layers.",
    top={"embed_tokens": at("embed"), "norm": at("norm"), "lm_head": at("lm_head")},
    layer={"input_layernorm": at("input_norm"), "post_attention_layernorm": at("post_norm"),
           "self_attn.q_proj": at("q"), "self_attn.q_a_proj": at("q_a"), "self_attn.q_a_layernorm": at("q_a_norm"),
           "self_attn.q_b_proj": at("q_b"), "self_attn.kv_a_proj_with_mqa": at("kv_a"),
           "self_attn.kv_a_layernorm": at("kv_a_norm"), "self_attn.kv_b_proj": at("kv_b"),
           "self_attn.o_proj": at("o"), "mlp.gate_proj": at("gate"), "mlp.up_proj": at("up"),
           "mlp.down_proj": at("down"), "mlp.shared_experts.gate_proj": at("shared_gate"),
           "mlp.shared_experts.up_proj": at("shared_up"), "mlp.shared_experts.down_proj": at("shared_down")},
    ignored=("e_score_correction_bias",), experts=moe.QWEN_EXPERTS)


def mla_attention_attrs(local: HeadCounts) -> dict[str, int]:
    """MLA's forward reads its head count from the tensors (views of -1 heads); the attribute is
    kept true for readers."""
    return {"num_heads": local.heads, "num_key_value_groups": 1}


def _policy(family: str, read) -> Policy:
    return Policy(
        family=family, model_types=(family,),
        layers="model.layers", embedding="model.embed_tokens", final_norm="model.norm",
        attention="self_attn", head_column=("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj"),
        out_proj="self_attn.o_proj",
        mlp_column=(*DENSE_MLP[:2], *SHARED[:2]), mlp_row=(DENSE_MLP[2], SHARED[2]), mlp=None,
        per_head_params=tuple(f"{m}.{p}" for m in LOW_RANK for p in ("weight", "bias")),
        replicated=("input_layernorm", "post_attention_layernorm", "mlp.gate", "mlp.experts"),
        optional=("self_attn.q_proj", "self_attn.q_b_proj", *DENSE_MLP, *SHARED, "mlp.gate", "mlp.experts"),
        heads=heads_reader(read), attention_attrs=mla_attention_attrs,
        notes="multi-head latent attention split by heads (low-rank projections replicated); dense MLPs and "
              "shared experts split; router and routed experts replicated under tp (split by ep_size)")


POLICY_V2 = _policy("deepseek_v2", read_v2)
POLICY_V3 = _policy("deepseek_v3", read_v3)
FAMILY_V2 = Family("deepseek_v2", ("deepseek_v2",), read_v2, NAMES, POLICY_V2, required=REQUIRED,
                   check_inference=check_inference)
FAMILY_V3 = Family("deepseek_v3", ("deepseek_v3",), read_v3, NAMES, POLICY_V3, required=REQUIRED,
                   check_inference=check_inference)


# ------------------------------------------------------------------ V3's aux-loss-free balancing
@dataclasses.dataclass
class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing (Liu et al. 2024, §2.1.2), which
    transformers leaves out: after each optimizer step every sparse layer's
    `mlp.gate.e_score_correction_bias` moves by `rate` towards balance, b_e += rate ·
    sign(mean load − load_e), the loads being the top-k assignments of every token of the step
    (all forwards since the last `step`, summed over `group`: the data-parallel group, whose
    ranks read different tokens; None: the world when distributed). Hooks on the routers record
    the assignments, so it works with or without expert parallelism (the router is transformers').
    The bias only changes which experts are chosen, never a gradient.

        balancer = BiasBalancer.attach(model, rate=1e-3)
        ... loss.backward(); optimizer.step(); balancer.step(group=dp_group)
    """

    routers: dict
    rate: float
    counts: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def attach(cls, model: torch.nn.Module, rate: float = 1e-3) -> "BiasBalancer":
        routers = {name: m for name, m in model.named_modules()
                   if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor) and hasattr(m, "top_k")}
        # a pipeline stage holding only dense layers (first_k_dense_replace) has no router: nothing to update
        stage_of_v3 = any(getattr(getattr(m, "config", None), "model_type", None) == "deepseek_v3"
                          for m in model.modules())
        if not routers and not stage_of_v3:
            raise ValueError(f"{type(model).__name__} has no router with e_score_correction_bias: the aux-loss-free "
                             f"balancing is DeepSeek-V3's (model_type deepseek_v3)")
        balancer = cls(routers, rate)
        balancer._recorder = RouterRecorder(routers, on_call=balancer._count)
        return balancer

    def _count(self, name: str, call: RouterCall) -> None:
        """Add one forward's top-k assignments of router `name` to its loads."""
        if in_shape_inference():  # torch pipelining's shape inference (PipelineRunner marks it): not the step's
            return
        bias = self.routers[name].e_score_correction_bias  # the loads live on its device (collectives, the update)
        chosen = call.chosen.reshape(-1)
        counts = torch.zeros(bias.numel(), dtype=torch.long, device=bias.device)
        counts.index_add_(0, chosen.to(bias.device), torch.ones_like(chosen))
        self.counts[name] = self.counts[name] + counts if name in self.counts else counts

    def loads(self, group=None, reduce: bool = True) -> dict[str, torch.Tensor]:
        """{router: assignments per expert since the last step, summed over `group` (None: the
        world) when distributed and `reduce`; reduce=False: this process's own (a reference run
        on every rank)."""
        if set(self.counts) != set(self.routers):
            raise RuntimeError("BiasBalancer: run a forward through every router before step()")
        out = {}
        for name in self.routers:
            total = self.counts[name].clone()
            if reduce and dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
            out[name] = total
        return out

    @torch.no_grad()
    def step(self, group=None, reduce: bool = True) -> dict[str, torch.Tensor]:
        """Update every router's bias from the recorded loads (`loads`); returns the loads and
        forgets them."""
        loads = self.loads(group, reduce)
        for name, router in self.routers.items():
            load = loads[name].to(router.e_score_correction_bias.dtype)
            router.e_score_correction_bias.add_(self.rate * torch.sign(load.mean() - load))
        self.counts.clear()
        return loads


# ------------------------------------------------------------------ DeepSeek's auxiliary balance losses
def balance_settings(config) -> tuple[float, bool] | None:
    """(alpha, per_sequence) of DeepSeek's auxiliary balance loss when `config` asks for it
    (`output_router_logits=True` on a deepseek_v2 / deepseek_v3 config), else None.

    alpha is `config.aux_loss_alpha` (the key of DeepSeek's released config.json files; transformers
    keeps it as an attribute but computes no loss). per_sequence is `config.seq_aux` when the config
    has it (DeepSeek's released configs: true); otherwise V3's complementary sequence-wise loss
    (per sequence) and V2's expert-level loss over the batch."""
    if getattr(config, "model_type", None) not in ("deepseek_v2", "deepseek_v3") or \
            not getattr(config, "output_router_logits", False):
        return None
    alpha = getattr(config, "aux_loss_alpha", None)
    if alpha is None or not float(alpha) >= 0:
        raise ValueError(f"config.output_router_logits=True on a {config.model_type} model asks for DeepSeek's "
                         f"auxiliary balance loss, whose coefficient config.aux_loss_alpha is "
                         f"{'not set' if alpha is None else repr(alpha)}: set config.aux_loss_alpha (DeepSeek-V3's "
                         f"sequence-wise loss: 1e-4 in its paper; DeepSeek-V2's released config: 1e-3), or "
                         f"config.output_router_logits=False")
    per_sequence = getattr(config, "seq_aux", None)
    if per_sequence is None:
        per_sequence = config.model_type == "deepseek_v3"
    return float(alpha), bool(per_sequence)


class BalanceLoss:
    """DeepSeek's auxiliary balance loss, which transformers leaves out, computed from what its routers
    (`mlp.gate`, transformers' own modules) chose in the last forward: forward hooks record each
    router's logits, its top-k choices and the batch shape.

    For each expert block l, over a unit of tokens u (a sequence, or the whole batch) with T_u tokens
    (padding left out), N routed experts and top-k K:

        f_i = N / (K · T_u) · Σ_t 1(token t chose expert i)     (no gradient)
        P_i = 1 / T_u · Σ_t s'_{i,t}
        L = alpha · Σ_l mean_u Σ_i f_i · P_i

    s' is the softmax score (DeepSeek-V2, the expert-level balance loss of its paper, §2.2.3) or the
    sigmoid score normalised over the experts, s_{i,t} / Σ_j s_{j,t} (DeepSeek-V3's complementary
    sequence-wise balance loss, §2.1.2; the experts chosen with the correction bias). Per sequence
    (`per_sequence`) the mean runs over every sequence of the batch; over the batch, f and P count
    every token of the batch. In a distributed run "the batch" is every rank's batch in `group` (the
    data-parallel group): the counts are all-reduced and each rank returns its share in the form
    world · (its part) whose mean over the group is the global loss and whose averaged gradient
    is the global gradient (the Booster averages gradients over dp). One all-reduce per loss.

        loss = model(input_ids=x, labels=x).loss + balance.loss(attention_mask, group=dp_group)

    HybridParallelPlugin adds it for you when config.output_router_logits=True (balance_settings).
    """

    def __init__(self, routers: dict[str, torch.nn.Module], sigmoid: bool, alpha: float, per_sequence: bool):
        self.routers, self.sigmoid, self.alpha, self.per_sequence = routers, sigmoid, alpha, per_sequence
        self._recorder = RouterRecorder(routers)
        self.recorded: dict[str, RouterCall] = self._recorder.calls  # (logits, top-k, rows) by router

    @classmethod
    def attach(cls, model: torch.nn.Module, alpha: float | None = None,
               per_sequence: bool | None = None) -> "BalanceLoss":
        """Hooks on every router of `model` (a DeepSeek-V2 / V3 model, or a PEFT model around one);
        alpha / per_sequence default to `balance_settings(model.config)`."""
        config = model.config
        if config.model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(f"BalanceLoss is DeepSeek's (model_type deepseek_v2 / deepseek_v3), not "
                             f"{config.model_type}'s: Mixtral / Qwen-MoE train with their router_aux_loss_coef")
        if alpha is None or per_sequence is None:
            settings = balance_settings(config)
            if settings is None:
                raise ValueError("BalanceLoss.attach: pass alpha and per_sequence, or set config.output_router_logits"
                                 "=True and config.aux_loss_alpha")
            alpha = settings[0] if alpha is None else alpha
            per_sequence = settings[1] if per_sequence is None else per_sequence
        routers = named_expert_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no expert block with a router (mlp.gate): nothing to balance")
        return cls(routers, config.model_type == "deepseek_v3", float(alpha), bool(per_sequence))

    def loss(self, attention_mask: torch.Tensor | None = None, group=None, reduce: bool = True) -> torch.Tensor:
        """alpha · the balance loss of the last forward (the class docstring), over the batch of every
        rank of `group` (None: the world) when distributed and `reduce`; reduce=False: this
        process's batch alone (a one-process reference on every rank). Consumes the recording."""
        missing = sorted(set(self.routers) - set(self.recorded))
        if missing:
            raise RuntimeError(f"BalanceLoss: run a forward through every router first (none recorded for {missing[0]})")
        layers = [self.recorded.pop(name) for name in self.routers]
        parts, totals = [], []
        for logits, chosen, rows in layers:
            part, total = self.block_parts(logits.float(), chosen, rows, attention_mask)
            parts.append((part, chosen.shape[-1]))
            totals.append(total)
        size = 1
        if reduce and dist.is_initialized() and dist.get_world_size(group) > 1:
            size = dist.get_world_size(group)
            flat = torch.cat([t.reshape(-1) for t in totals])
            dist.all_reduce(flat, group=group)
            totals = list(flat.split([t.numel() for t in totals]))
        loss = sum(self.block_loss(part, k, total) for (part, k), total in zip(parts, totals, strict=True))
        return self.alpha * size * loss

    def block_parts(self, logits: torch.Tensor, chosen: torch.Tensor, rows: tuple, attention_mask):
        """One block's local pieces: (the differentiable part, the counts to sum over the group)."""
        experts, k = logits.shape[-1], chosen.shape[-1]
        batch, seq = (1, rows[0]) if len(rows) == 1 else rows
        if attention_mask is None:
            mask = torch.ones(batch, seq, device=logits.device)
        else:
            if tuple(attention_mask.shape) != (batch, seq):
                raise ValueError(f"BalanceLoss: attention_mask of shape {tuple(attention_mask.shape)} does not match "
                                 f"the routers' batch ({batch}, {seq}); pass the [batch, sequence] 0/1 padding mask")
            mask = attention_mask.to(logits.device, torch.float32)
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        if self.sigmoid:  # V3: s' = s / Σ_j s_j
            scores = scores / scores.sum(dim=-1, keepdim=True)
        chosen_onehot = torch.zeros_like(scores, dtype=torch.float32).scatter_add_(
            1, chosen.reshape(-1, k), torch.ones(chosen.numel() // k, k, device=logits.device))
        weights = mask.reshape(-1, 1)
        scores = torch.where(weights > 0, scores, 0.0)  # (a padding token's scores may be anything, NaN included)
        counts = (chosen_onehot * weights).reshape(batch, seq, experts).sum(1)  # [B, E]
        prob = (scores * weights).reshape(batch, seq, experts).sum(1)  # [B, E], with gradient
        tokens = mask.sum(1)  # [B]
        if self.per_sequence:
            # per sequence: f and P of each sequence, summed here; the group sums the sequences counted
            f = counts * experts / (k * tokens.clamp(min=1))[:, None]
            part = (f * prob / tokens.clamp(min=1)[:, None]).sum()
            return part, (tokens > 0).sum().to(torch.float32).reshape(1)
        return prob.sum(0), torch.cat([counts.sum(0), tokens.sum().reshape(1)]).detach()

    def block_loss(self, part: torch.Tensor, k: int, total: torch.Tensor) -> torch.Tensor:
        """The block's loss from its local part and the group's totals (the class docstring's
        per-rank form: divided by the group's sequences, or f and P over the group's tokens)."""
        if self.per_sequence:
            return part / total[0].clamp(min=1)
        counts, tokens = total[:-1], total[-1].clamp(min=1)
        f = counts * counts.numel() / (k * tokens)
        return (f * part / tokens).sum()
