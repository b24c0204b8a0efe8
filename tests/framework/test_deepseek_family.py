"""DeepSeek-V2 / V3 as families (phalanx.models.deepseek): unmodified transformers models.

One process: exact parameter counts (total and active) against transformers for multi-head
latent attention with and without q_lora_rank, attention / MLP biases, shared experts and
first_k_dense_replace dense layers; the shard policy; V3's aux-loss-free bias update.
Two gloo ranks (one spawn, tests/framework/spawn_batch.py): two SGD steps under tp2 (MLA split
by heads, dense MLPs and shared experts split) and under ep2 (the routed experts split, V3's
group-limited sigmoid routing with its correction bias, updated by BiasBalancer over the data-
parallel group) equal one process on the whole batch: losses, gradient norms, every weight after
the steps in Hugging Face layout; the ep2 model saved in HF layout loads into tp2
(booster.load_model) and through from_pretrained with the one-process logits, V2's tp2 model into
ep2 and through from_pretrained.
"""
from __future__ import annotations

import pytest
import torch

from deepseek_workers import EXPERTS, ROWS, SEQ, VARIANTS, build, deepseek_config, layout_steps, load_elsewhere
from phalanx.models import FAMILIES, family_of, spec_from_config
from phalanx.models.deepseek import BiasBalancer
from phalanx.testing import check, rounding_rtol
from spawn_batch import spawn_suites

FP32_RTOL = rounding_rtol(torch.float32, ROWS * SEQ)  # 8·eps·√128 = 1.1e-5
UPDATE_RTOL = 1e-5  # two SGD steps, as test_expert_parallel_plugin.py
BALANCE = 0.02  # V3's bias update rate in the ep2 run (large, so that the second step routes differently)

CASES = {  # (version, overrides)
    "v3": (3, {}),
    "v3-no-q-lora-biases": (3, dict(q_lora_rank=None, attention_bias=True, first_k_dense_replace=0)),
    "v2-lite": (2, {}),
    "v2-biases-groups": (2, dict(q_lora_rank=24, attention_bias=True, mlp_bias=True, topk_method="group_limited_greedy",
                                 n_group=4, topk_group=2, first_k_dense_replace=2, num_hidden_layers=4)),
}


def _config(case: str):
    version, overrides = CASES[case]
    return deepseek_config(version, **overrides)


def _meta_model(config):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_counts_equal_transformers(case):
    config = _config(case)
    spec = spec_from_config(config)
    model = _meta_model(config)
    assert spec.family == config.model_type and spec.mla
    assert spec.total_params() == sum(p.numel() for p in model.parameters()), case
    # active: the total less the routed experts a token skips in each sparse layer
    sparse = sum(spec.sparse_layers)
    assert sparse == config.num_hidden_layers - config.first_k_dense_replace
    assert spec.total_params() - spec.active_params() == sparse * (EXPERTS - 2) * 3 * 32 * 16
    # and counted again from the modules: one sparse layer's active share, by hand
    layer = model.model.layers[config.num_hidden_layers - 1]
    attn = sum(p.numel() for p in layer.self_attn.parameters())
    mlp = layer.mlp
    active = (attn + mlp.gate.weight.numel() + 2 * 3 * 32 * 16 + sum(p.numel() for p in mlp.shared_experts.parameters())
              + 2 * 32)
    assert spec.layer_params(config.num_hidden_layers - 1, active=True) == active


def test_spec_reads_mla_and_expert_fields():
    v3 = spec_from_config(_config("v3"))
    mla = (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim)
    assert mla == (24, 16, 8, 4, 8)
    assert (v3.num_heads, v3.num_kv_heads, v3.head_dim) == (4, 4, 12)
    assert v3.sparse_layers == (False, True, True) and v3.norm_topk_prob
    assert (v3.num_experts, v3.experts_per_token, v3.expert_size, v3.shared_expert_size) == (8, 2, 16, 16)
    v2 = spec_from_config(_config("v2-biases-groups"))
    assert v2.sparse_layers == (False, False, True, True) and not v2.norm_topk_prob  # V2 never renormalises
    assert v2.shared_expert_size == 32 and v2.shared_expert_bias and v2.o_bias and v2.mlp_bias
    assert spec_from_config(_config("v2-lite")).q_lora_rank == 0
    # a bare config.json dict must name the MLA and expert keys (no silent class defaults)
    config = {k: v for k, v in _config("v3").to_dict().items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="lacks kv_lora_rank"):
        spec_from_config(config)
    assert spec_from_config(_config("v3").to_dict()).total_params() == v3.total_params()


def test_mla_with_grouped_kv_heads_is_refused():
    with pytest.raises(ValueError, match="num_key_value_heads=2 differs from num_attention_heads=4"):
        spec_from_config(deepseek_config(3, num_key_value_heads=2))


@pytest.mark.parametrize("case", list(CASES))
def test_shard_policy_places_every_parameter(case):
    """The per-head projections are split, the low-rank ones replicated with partial gradients,
    o_proj row parallel, dense MLPs / shared experts split, router and experts whole."""
    config = _config(case)
    model = _meta_model(config)
    policy = family_of(config).policy
    split, kinds = set(), {}
    for layer in policy.decoder_layers(model):
        for path in policy.split_paths():
            if policy.layer_module(layer, path) is not None:
                split.add(path)
    want = {"self_attn.kv_b_proj", "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
            "mlp.shared_experts.down_proj", "self_attn.q_b_proj" if config.q_lora_rank else "self_attn.q_proj"}
    if config.first_k_dense_replace:
        want |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert split == want, case
    for name, _ in model.named_parameters():
        if name.startswith("model.layers."):
            local = name.split(".", 3)[3]
            module = local.rpartition(".")[0]
            kinds[local] = ("split" if module in split else "partial" if local in policy.per_head_params
                            else "whole" if module in policy.replicated or module.startswith("mlp.experts")
                            else None)
    assert None not in kinds.values(), {k: v for k, v in kinds.items() if v is None}
    low_rank = {k for k, v in kinds.items() if v == "partial"}
    assert {k.rpartition(".")[0] for k in low_rank} == (
        {"self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm"}
        | ({"self_attn.q_a_proj", "self_attn.q_a_layernorm"} if config.q_lora_rank else set()))


def test_families_are_listed():
    assert {"deepseek_v2", "deepseek_v3"} <= set(FAMILIES)  # what the engine runs of them: test_inference_deepseek.py


def test_bias_balancer_moves_the_correction_bias_against_the_load():
    """BiasBalancer records each router's top-k choices (transformers' router, hooked) and moves
    e_score_correction_bias by rate · sign(mean load − load): the loads are the bincount of the
    routers' own choices over every forward since the last step."""
    model = build("v3")
    balancer = BiasBalancer.attach(model, rate=0.01)
    routers = {n: m for n, m in model.named_modules() if n.endswith("mlp.gate")}
    choices = {n: [] for n in routers}
    for name, router in routers.items():
        router.register_forward_hook(lambda m, a, out, name=name: choices[name].append(out[2].reshape(-1)))
    before = {n: r.e_score_correction_bias.clone() for n, r in routers.items()}
    data = torch.randint(5, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=data[:2])
        model(input_ids=data[2:])
    loads = balancer.step()
    assert set(loads) == set(routers) == {"model.layers.1.mlp.gate", "model.layers.2.mlp.gate"}
    for name, router in routers.items():
        load = torch.bincount(torch.cat(choices[name]), minlength=EXPERTS)
        assert torch.equal(loads[name], load) and load.sum() == 4 * 16 * 2
        moved = router.e_score_correction_bias - before[name]
        assert torch.allclose(moved, 0.01 * torch.sign(load.float().mean() - load.float())), name
        assert (moved[load == load.max()] < 0).all() and (moved[load == load.min()] > 0).all()
    with pytest.raises(RuntimeError, match="run a forward"):
        balancer.step()
    with pytest.raises(ValueError, match="no router with e_score_correction_bias"):
        BiasBalancer.attach(build("v2"))


# ---------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    tp = {"tp2": {"tp_size": 2},
          "tp2 zero1 sp": {"tp_size": 2, "zero_stage": 1, "sequence_parallelism": "split_gather"}}
    suites = {"test_tp2_equals_one_process[v3]": (layout_steps, ("v3", tp), {}),
              "test_tp2_equals_one_process[v2]": (layout_steps, ("v2", {**tp, "ep2": {"ep_size": 2}}),
                                                 {"save": str(root / "tp2")}),
              "test_tp2_equals_one_process[v2]:load": (load_elsewhere, ("v2", str(root / "tp2"), {"ep_size": 2}), {}),
              "test_ep2_v3_equals_one_process_and_saves_hf_layout:steps":
                  (layout_steps, ("v3", {"ep2 zero1": {"ep_size": 2, "zero_stage": 1}}),
                   {"balance": BALANCE, "save": str(root / "ep2")}),
              "test_ep2_v3_equals_one_process_and_saves_hf_layout:load":
                  (load_elsewhere, ("v3", str(root / "ep2"), {"tp_size": 2}), {"balance": BALANCE})}
    return spawn_suites(request, 2, suites, timeout=600)


def _check(ranks: list[dict]) -> None:
    for rank, layouts in enumerate(ranks):
        for name, got in layouts.items():
            what = f"{name} rank {rank}"
            check(got["losses"], FP32_RTOL, f"{what} losses")
            check(got["norms"], FP32_RTOL, f"{what} gradient norms")
            local_experts = [(EXPERTS // 2, 32, 32)] if "ep2" in name else None  # [experts, 2·width, hidden]
            assert got["local_experts"] == local_experts, (what, got["local_experts"])
            if got["biases"] is not None:
                check(got["biases"], FP32_RTOL, f"{what} correction biases after the balancer's updates")
            if rank == 0:
                assert got["names"] == [], (what, got["names"])
                check(got["update"], UPDATE_RTOL, f"{what} weights after the steps")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_equals_one_process(two_ranks, variant):
    """tp2, and tp2 + ZeRO-1 + split-gather sequence parallelism, on 2 ranks: V3 (q_lora_rank, sigmoid
    group-limited routing) and V2 (no q_lora_rank, attention and MLP biases, softmax group-limited
    routing; also ep2 without ZeRO); the first layer dense (its MLP split), the others expert blocks.
    V2's tp2 model saved in HF layout loads into ep2 and through from_pretrained."""
    _check(two_ranks.get(f"test_tp2_equals_one_process[{variant}]"))
    if variant == "v2":
        for rank, got in enumerate(two_ranks.get("test_tp2_equals_one_process[v2]:load")):
            check(got["logits"], FP32_RTOL, f"logits of the tp2 save under ep2, rank {rank}")
            if rank == 0:
                check(got["from_pretrained"], FP32_RTOL, "logits of from_pretrained (tp2 save)")


def test_ep2_v3_equals_one_process_and_saves_hf_layout(two_ranks):
    """ep2 ZeRO-1 on 2 ranks (4 of the 8 experts each, each rank half the batch), V3's correction
    bias updated after each step from the loads of both ranks; the model saved in HF layout
    (correction biases included) loads into tp2 and through from_pretrained."""
    _check(two_ranks.get("test_ep2_v3_equals_one_process_and_saves_hf_layout:steps"))
    for rank, got in enumerate(two_ranks.get("test_ep2_v3_equals_one_process_and_saves_hf_layout:load")):
        check(got["logits"], FP32_RTOL, f"logits under tp2, rank {rank}")
        if rank == 0:
            check(got["from_pretrained"], FP32_RTOL, "logits of from_pretrained")


# ---------------------------------------------------------------------------- four ranks
AUX_LOSS = 0.1  # DeepSeek's balance loss coefficient in the ep2 x tp2 runs (large: its gradients count)
DENSE_STAGE = {"num_hidden_layers": 4, "first_k_dense_replace": 2}  # pp2: the first stage holds dense layers only


@pytest.fixture(scope="module")
def four_ranks(request):
    pp = {"ep_size": 2, "pp_size": 2, "num_microbatches": 2}
    suites = {"test_ep2_with_tp2_and_pp2_equals_one_process[v3]:tp":
                  (layout_steps, ("v3", {"ep2 tp2 zero2": {"ep_size": 2, "tp_size": 2, "zero_stage": 2}}),
                   {"balance": BALANCE, "aux_loss": AUX_LOSS}),
              "test_ep2_with_tp2_and_pp2_equals_one_process[v3]:pp":
                  (layout_steps, ("v3", {"ep2 pp2 zero1": {**pp, "zero_stage": 1}}), {"balance": BALANCE, **DENSE_STAGE}),
              "test_ep2_with_tp2_and_pp2_equals_one_process[v2]:tp":
                  (layout_steps, ("v2", {"ep2 tp2": {"ep_size": 2, "tp_size": 2}}), {"aux_loss": AUX_LOSS}),
              "test_ep2_with_tp2_and_pp2_equals_one_process[v2]:pp": (layout_steps, ("v2", {"ep2 pp2": pp}), {})}
    return spawn_suites(request, 4, suites, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ep2_with_tp2_and_pp2_equals_one_process(four_ranks, variant):
    """4 ranks, each dp rank half the batch. ep2 x tp2 (V3 ZeRO-2, V2 ZeRO-0): MLA split by heads,
    experts over ep, cross-entropy + 0.1 · DeepSeek's balance loss (V3 per sequence, V2 over the
    batch) and V3's correction bias updated by BiasBalancer. ep2 x pp2 (1F1B, 2 microbatches; the
    pipeline trains the cross-entropy): V3 with 4 layers of which the first 2 dense, so the first
    stage holds no expert (it keeps no expert plan; its weights are dense), V2's 3 layers split
    with the dense layer and an expert block on the first stage."""
    for part in ("tp", "pp"):
        ranks = four_ranks.get(f"test_ep2_with_tp2_and_pp2_equals_one_process[{variant}]:{part}")
        stages = set()
        for rank, layouts in enumerate(ranks):
            for name, got in layouts.items():
                what = f"{variant} {name} rank {rank}"
                check(got["losses"], FP32_RTOL, f"{what} losses")
                check(got["norms"], FP32_RTOL, f"{what} gradient norms")
                experts = got["local_experts"]
                stages.add(experts is not None)
                assert experts in ([(EXPERTS // 2, 32, 32)], None), (what, experts)
                if variant == "v3":  # a rank holds correction biases exactly where it holds experts
                    assert bool(got["bias_names"]) == (experts is not None), (what, got["bias_names"])
                    if got["biases"] is not None:  # (under pp the stages' names differ: the saved ones below)
                        check(got["biases"], FP32_RTOL, f"{what} correction biases after the balancer's updates")
                if rank == 0:
                    assert got["names"] == [], (what, got["names"])
                    check(got["update"], UPDATE_RTOL, f"{what} weights after the steps")
                    if variant == "v3":  # every stage's biases, as saved: the balancer's loads are the steps'
                        check(got["saved_biases"], FP32_RTOL, f"{what} saved correction biases")
        # every rank holds experts, but for V3's dense first stage under pp
        assert stages == ({True, False} if (variant, part) == ("v3", "pp") else {True}), (variant, part, stages)
