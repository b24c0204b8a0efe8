"""phalanx.models: every family described once and checked against transformers on tiny configs.

For each family: the planner's parameter count equals the HF model's, its shard policy names
every parameter (split or explicitly replicated), and its weight-name table places every
checkpoint tensor. The tensor-parallel head rule is one rule: training, the planner and the
inference engine accept and refuse the same tp sizes with the same message. Greedy decoding
against transformers is in test_inference_engine.py (llama, qwen2, mistral) and
test_inference_families.py (qwen3, gpt2, opt), test_inference_moe.py (mixtral, qwen2_moe,
qwen3_moe); the engine does not serve DeepSeek (multi-head latent attention) yet, whose
variants and training are in test_deepseek_family.py; replicated key/value heads under TP in
test_inference_tp.py. The mixtures of experts also count active parameters (checked by hand here).
"""
from __future__ import annotations

import pytest
import torch

import deepseek_workers
import inference_models as im
import moe_models
from phalanx.models import FAMILIES, SUPPORTED, ModelSpec, family_of, spec_from_config
from phalanx.models.heads import HeadCounts, first_kv_head, head_problem, kv_replicated, local_heads

# Each family at its tiny test size, plus the variants that change the parameter count.
CONFIGS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gpt2": {}, "opt": {},
    "llama-biases": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "opt-projected": dict(word_embed_proj_dim=32),
    "opt-no-final-norm": dict(_remove_final_layer_norm=True),
    "gpt2-inner": dict(n_inner=None),
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {},
    "qwen3_moe-dense-layers": dict(mlp_only_layers=[0], num_hidden_layers=3),
    "qwen2_moe-sparse-step": dict(decoder_sparse_step=2, num_hidden_layers=4, tie_word_embeddings=True),
    "mixtral-top1": dict(num_experts_per_tok=1, num_local_experts=3),
    "deepseek_v2": {}, "deepseek_v3": {},  # more DeepSeek variants in test_deepseek_family.py
}
SERVED = [case for case in CONFIGS if not case.startswith("deepseek")]  # the engine runs no MLA yet


def _config(case: str):
    family = case.split("-")[0]
    if family.startswith("deepseek"):
        return deepseek_workers.deepseek_config(int(family[-1]), **CONFIGS[case])
    if family in moe_models.MOE_FAMILIES:
        return moe_models.moe_config(family, **CONFIGS[case])
    return im.model_config(family, **CONFIGS[case])


def _meta_model(config):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_every_family_is_described_once():
    assert SUPPORTED == ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "mixtral", "qwen2_moe", "qwen3_moe",
                         "deepseek_v2", "deepseek_v3")
    for name, family in FAMILIES.items():
        assert family.name == family.policy.family == name
        assert family_of(_config(name)) is family


@pytest.mark.parametrize("case", list(CONFIGS))
def test_planner_parameter_count_equals_transformers(case):
    config = _config(case)
    spec = spec_from_config(config)
    assert isinstance(spec, ModelSpec) and spec.family == case.split("-")[0]
    assert spec.total_params() == sum(p.numel() for p in _meta_model(config).parameters()), case


def test_planner_reads_an_opt_config_json(tmp_path):
    """The planner gains OPT from its family file: config.json in, the exact count out."""
    from phalanx.plan import load_spec
    config = _config("opt-projected")
    config.save_pretrained(tmp_path)
    assert load_spec(tmp_path).total_params() == sum(p.numel() for p in _meta_model(config).parameters())


@pytest.mark.parametrize("case", list(CONFIGS))
def test_shard_policy_names_every_parameter(case):
    """Every parameter of the HF model is one the policy splits (q/k/v or fused qkv, out_proj,
    MLP) or keeps whole on purpose (embeddings, norms, per-head norms, extras); and every path it
    names exists (an `optional` one in some layer: DeepSeek's dense and expert layers differ)."""
    config = _config(case)
    model = _meta_model(config)
    policy = family_of(config).policy
    top = (policy.embedding, policy.head, policy.final_norm, *policy.position_embeddings, *policy.input_extras,
           *policy.output_extras)
    in_layer = (*policy.split_paths(), *policy.replicated)
    prefix = policy.layers + "."
    for name, _ in model.named_parameters():
        module = name.rpartition(".")[0]
        if name.startswith(prefix):
            local = name[len(prefix):].split(".", 1)[1]
            module = local.rpartition(".")[0]
            whole = any(module.startswith(path + ".") for path in policy.replicated)  # an MoE block
            assert module in in_layer or local in policy.per_head_params or whole, (case, name)
        else:
            assert module in top, (case, name)
    for path in in_layer:
        found = [policy.layer_module(layer, path) is not None for layer in policy.decoder_layers(model)]
        if path not in policy.optional:
            assert all(found), (case, path)
        elif path not in ("self_attn.q_proj", "self_attn.q_b_proj"):  # one of the two, by q_lora_rank
            assert any(found), (case, path)


# ---------------------------------------------------------------------------- mixtures of experts
def test_moe_spec_reads_the_expert_fields():
    mixtral = spec_from_config(_config("mixtral"))
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_size) == (4, 2, 32)
    assert mixtral.norm_topk_prob and mixtral.shared_expert_size == 0 and mixtral.sparse_layers == (True, True)
    qwen2 = spec_from_config(_config("qwen2_moe-sparse-step"))
    assert qwen2.sparse_layers == (False, True, False, True)  # (i + 1) % 2 == 0
    assert (qwen2.shared_expert_size, qwen2.shared_expert_gate, qwen2.norm_topk_prob) == (48, True, False)
    qwen3 = spec_from_config(_config("qwen3_moe-dense-layers"))
    assert qwen3.sparse_layers == (False, True, True) and qwen3.norm_topk_prob and qwen3.expert_size == 32
    dense = spec_from_config(_config("llama"))
    assert not dense.is_moe and dense.active_params() == dense.total_params()


def test_moe_active_parameters_by_hand():
    """Active = total less the routed experts a token skips. Mixtral: h 64, 4 experts of width 32,
    top-2: each layer skips 2 · 3·64·32 = 12288 of its expert parameters. Qwen2-MoE (shared expert
    of 48 + its [1, 64] gate; every layer sparse): the same 12288 per layer, the shared expert
    always active."""
    mixtral = spec_from_config(_config("mixtral"))
    assert mixtral.expert_params() == 3 * 64 * 32 == 6144
    assert mixtral.total_params() - mixtral.active_params() == 2 * (4 - 2) * 6144
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v (2 kv heads of 16), o
    layer_active = attention + 4 * 64 + 2 * 6144 + 2 * 64  # + router + 2 experts + 2 norms
    assert mixtral.layer_params(0, active=True) == layer_active
    assert mixtral.active_params() == 384 * 64 * 2 + 64 + 2 * layer_active  # embed, head, final norm
    qwen2 = spec_from_config(_config("qwen2_moe"))
    assert qwen2.shared_expert_params() == 3 * 64 * 48 + 64
    assert qwen2.total_params() - qwen2.active_params() == 2 * 2 * 6144
    qwen3 = spec_from_config(_config("qwen3_moe-dense-layers"))  # layer 0 dense: nothing skipped there
    assert qwen3.layer_params(0, active=True) == qwen3.layer_params(0)
    assert qwen3.total_params() - qwen3.active_params() == 2 * 2 * 6144
    assert qwen3.matmul_params() == qwen3.layers_params(active=True) + 384 * 64


def test_moe_config_dict_names_the_missing_expert_key():
    config = {k: v for k, v in _config("qwen2_moe").to_dict().items() if k != "shared_expert_intermediate_size"}
    with pytest.raises(ValueError, match="lacks shared_expert_intermediate_size"):
        spec_from_config(config)
    full = _config("qwen3_moe-dense-layers")
    assert spec_from_config(full.to_dict()).total_params() == spec_from_config(full).total_params()


@pytest.mark.parametrize("case", SERVED)
def test_weight_name_table_places_every_checkpoint_tensor(case):
    """The inference engine's table knows every tensor of the checkpoint (buffers excepted; for
    the mixtures of experts transformers' fused expert tensors stand for the per-expert ones)."""
    from phalanx.inference.llama import DecoderModel, spec_for_inference
    config = _config(case)
    spec = spec_for_inference(config)
    with torch.device("meta"):
        engine = DecoderModel(spec)
    state = _meta_model(config).state_dict()
    for name in state:
        if not name.endswith(family_of(config).names.ignored):
            assert engine.weight_targets(name) or spec.tie_word_embeddings and name == "lm_head.weight", name
    covered = set(state) | {n for name in state for n in engine.covered_weight_names(name)}
    assert engine.expected_weight_names() <= covered | {"lm_head.weight"}


# ---------------------------------------------------------------------------- the head rule
def test_head_rule_splits_or_replicates_key_value_heads():
    h = HeadCounts(8, 2, 16)
    assert local_heads(h, 2) == HeadCounts(4, 1, 16) and not kv_replicated(h, 2)
    assert local_heads(h, 4) == HeadCounts(2, 1, 16) and kv_replicated(h, 4)
    assert [first_kv_head(h, 4, r) for r in range(4)] == [0, 0, 1, 1]  # q heads 0-3 read kv 0, 4-7 kv 1
    assert [first_kv_head(h, 8, r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [first_kv_head(HeadCounts(8, 4, 16), 2, r) for r in range(2)] == [0, 2]
    for tp in (1, 2, 4, 8):
        assert head_problem(h, tp) is None
    assert "num_attention_heads=8 (8 % 3 = 2)" in head_problem(h, 3)
    assert "(4 % 3 = 1)" in head_problem(HeadCounts(12, 3, 16), 4)


@pytest.mark.parametrize("tp", [3, 4])
def test_training_planner_and_engine_refuse_with_one_message(tp):
    """tp 3 does not divide 8 query heads; tp 4 neither divides 3 key/value heads nor is a multiple
    of them: training, the inference engine and the planner refuse with the same words."""
    from phalanx.inference.llama import check_tp
    from phalanx.mesh import LayoutError
    from phalanx.plan import Layout
    from phalanx.plan.layout import structural_problem
    from phalanx.shard import check_heads
    heads = HeadCounts(12, 3, 8) if tp == 4 else HeadCounts(8, 2, 8)
    want = head_problem(heads, tp)
    assert want
    with pytest.raises(LayoutError) as trained:
        check_heads(heads, tp)
    spec = ModelSpec("llama", 64, heads.heads * heads.head_dim, 12 * tp, 2, heads.heads, heads.kv_heads,
                     heads.head_dim, False)
    with pytest.raises(ValueError) as served:
        check_tp(spec, tp)
    planned = structural_problem(Layout("hybrid", tp, tp=tp), spec, seq=64)
    assert str(trained.value) == str(served.value) == planned == want
