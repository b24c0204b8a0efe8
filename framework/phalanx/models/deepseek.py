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
nothing updates: `BiasBalancer` below is the paper's aux-loss-free update (docs/models.md).

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
    raise ValueError(f"{config.model_type}: phalanx.inference does not run multi-head latent attention yet; "
                     f"train it with HybridParallelPlugin and generate with transformers' model.generate")


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
        if not routers:
            raise ValueError(f"{type(model).__name__} has no router with e_score_correction_bias: the aux-loss-free "
                             f"balancing is DeepSeek-V3's (model_type deepseek_v3)")
        balancer = cls(routers, rate)
        for name, router in routers.items():
            router.register_forward_hook(balancer._recorder(name))
        return balancer

    def _recorder(self, name: str):
        def hook(module, args, output):
            bias = module.e_score_correction_bias  # the loads live on its device (collectives, the update)
            counts = torch.zeros(bias.numel(), dtype=torch.long, device=bias.device)
            counts.index_add_(0, output[2].reshape(-1).to(bias.device), torch.ones_like(output[2].reshape(-1)))
            self.counts[name] = self.counts[name] + counts if name in self.counts else counts
        return hook

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
