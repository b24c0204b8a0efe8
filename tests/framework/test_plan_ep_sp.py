"""phalanx.plan for expert × sequence parallelism (docs/plan.md): HybridParallelPlugin trains a
mixture of experts with ep_size dividing dp × sp under Ulysses (each sequence shard routes its own
tokens; tests/framework/test_expert_parallel_sp.py), and the planner lists those layouts, counts
them (experts over ep and sharded over dp × sp / ep, activations and all-to-alls per sequence
shard, Ulysses' exchanges) and only lists what the plugin builds; the estimate of ep2 × sp2 against
the measured peak of a tiny Mixtral on 4 gloo ranks. The ring-attention rows (ep × ring sp too) are
test_plan_ring.py's."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from phalanx.plan import Layout, load_spec, plan
from phalanx.plan.layout import candidate_layouts, structural_problem
from phalanx.plan.memory import estimate_memory, layer_activation_bytes_per_token, local_model, zero_shard
from phalanx.plan.timing import estimate_time
from phalanx.plan.workload import Hardware, Workload
from plan_measured import build_every_layout, measure
from spawn_batch import spawn_suites

torch.set_num_threads(1)

# test_plan_moe's hand-sized Mixtral: vocab 1000, hidden 64, 2 layers, 4 heads (MHA), 4 experts of width 32, top-2
MOE_HAND = dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                tie_word_embeddings=False)
LLAMA_HAND = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
FAST = Hardware(device_memory=2**40, peak_flops=1e30, efficiency=1.0, bandwidth=1e9)  # compute ≈ 0: comm shows


def _ep_sp(layouts):
    """The ep × Ulysses sp rows (ep × ring: test_plan_ring.py)."""
    return [l for l in layouts if l.ep > 1 and l.sp > 1 and l.sp_mode == "ulysses"]


# ---------------------------------------------------------------------------- the candidates
def test_candidates_hold_ep_x_sp_for_a_moe_at_long_seq_and_none_for_a_dense_model():
    """8 ranks, seq 32k: ep (2 or 4, dividing the 4 experts and dp × sp) with Ulysses sp 2/4/8,
    alone or with tp; never with pp (Ulysses does not compose with it), never with split-gather;
    a dense model gets none. Catches: ep dropped where sp > 1 (the list before 2026-12-06); ep
    required to divide dp instead of dp × sp (sp8 × ep4 on dp 1 would vanish)."""
    spec = load_spec(MOE_HAND)
    rows = _ep_sp(candidate_layouts(8, spec, seq=32768))
    dims = {(l.tp, l.sp, l.ep) for l in rows}
    assert {(1, 2, 2), (1, 2, 4), (1, 4, 4), (1, 8, 2), (1, 8, 4), (2, 2, 4), (2, 4, 2), (4, 2, 2)} <= dims, dims
    assert all(l.pp == 1 and l.sp_mode == "ulysses" and (l.dp * l.sp) % l.ep == 0 and 4 % l.ep == 0
               for l in rows)
    assert {l.zero_stage for l in rows} == {1, 2} and {l.checkpointing for l in rows} == {False, True}
    assert not _ep_sp(candidate_layouts(8, load_spec(LLAMA_HAND), seq=32768))
    assert "not combined with pp=2" in structural_problem(Layout("hybrid", 8, pp=2, sp=2, sp_mode="ulysses", ep=2),
                                                          spec, 32768)
    assert Layout("hybrid", 8, sp=4, sp_mode="ulysses", ep=4).name() == "hybrid sp4+ep4 ulysses"
    # the plan estimates them: at a long sequence on small devices an ep x sp layout is the only kind that fits
    # (8 experts of 512, hidden 256, 8 heads: the best without ep needs 80.6 MiB, sp8+ep8 63.6 MiB)
    wide = dict(MOE_HAND, num_local_experts=8, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                num_key_value_heads=8)
    ranked = plan(wide, 8, "72MiB", seq=16384, reserve=0)
    fitting = [e for e in ranked if e.fits]
    assert fitting and all(e.layout.ep > 1 and e.layout.sp > 1 for e in fitting), [e.name for e in fitting]


def test_deepseek_balance_loss_refuses_sequence_parallelism_as_the_plugin_does():
    """HybridParallelPlugin refuses sp for a DeepSeek config asking for its balance loss
    (config.output_router_logits=True): the planner says so instead of listing a layout that fails
    at boost. Catches: the check left out (the layout would read as buildable)."""
    ds = dict(model_type="deepseek_v2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              n_shared_experts=1, first_k_dense_replace=1)
    ulysses = Layout("hybrid", 4, sp=2, sp_mode="ulysses", ep=2)
    balanced = load_spec(dict(ds, output_router_logits=True, aux_loss_alpha=1e-3))
    assert "config.output_router_logits=False" in structural_problem(ulysses, balanced, 64)
    assert "config.output_router_logits=False" in structural_problem(
        Layout("hybrid", 4, tp=2, sp_mode="split_gather"), balanced, 64)
    assert structural_problem(Layout("hybrid", 4, ep=2), balanced, 64) is None
    assert structural_problem(ulysses, load_spec(ds), 64) is None



def test_router_loss_refuses_split_gather_as_the_plugin_does():
    """Mixtral with config.output_router_logits=True: HybridParallelPlugin refuses split-gather (each tp
    rank routes its own tokens), so the planner never lists it; Ulysses stays. Catches: the check left out."""
    mixtral = dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2)
    split, balanced = Layout("hybrid", 4, tp=2, sp_mode="split_gather"), load_spec(dict(mixtral, output_router_logits=True))
    assert "config.output_router_logits=False" in structural_problem(split, balanced, 64)
    assert structural_problem(split, load_spec(mixtral), 64) is None
    assert structural_problem(Layout("hybrid", 4, sp=2, sp_mode="ulysses"), balanced, 64) is None


# ---------------------------------------------------------------------------- the estimates by hand
def test_ep2_x_sp2_memory_and_time_by_hand():
    """hybrid sp2+ep2 ZeRO-2 on 4 ranks (dp 2 × sp 2, two EP groups of 2) against hybrid ep2 on dp 4:
    the same parameters (2 of 4 experts per rank) and ZeRO shard (dense over dp × sp = 4, experts
    over their 4 / 2 = 2 replicas); with seq 4096 each rank holds 2048 tokens, so its activations,
    its EP buffers and its EP all-to-alls equal ep2's at seq 2048; Ulysses adds its own exchanges.
    Catches: activations over the whole sequence (not / sp), expert state not / ep, the experts'
    shard over dp × sp instead of dp × sp / ep, the EP all-to-alls or their buffers over the whole
    sequence, Ulysses' exchanges not repeated by the recomputed forward."""
    spec = load_spec(MOE_HAND)
    epsp = Layout("hybrid", 4, zero_stage=2, sp=2, sp_mode="ulysses", ep=2)
    ep = Layout("hybrid", 4, zero_stage=2, ep=2)
    long, half = Workload(seq=4096, micro_batch=1, dtype="bf16"), Workload(seq=2048, micro_batch=1, dtype="bf16")
    tokens = 2048  # per rank
    local = local_model(spec, epsp)
    assert (local.params, local.experts) == (210_752 - 2 * 12_288, 2 * 12_288)  # 2 experts of 3·64·32 per layer
    assert zero_shard(local, epsp) == math.ceil((186_176 - 24_576) / 4) + 24_576 // 2 == 52_688
    mem, ref = estimate_memory(spec, epsp, long), estimate_memory(spec, ep, half)
    assert mem.phase == "backward"
    assert mem.device["parameters"] == 2 * 186_176
    assert mem.device["optimizer"] == 12 * 52_688  # fp32 master + two moments of the bf16 model
    # per token: 2 layers × 2,836 + 588 outside the layers. A layer: two norms 2·(4·64 + 4 + 2·2·64) =
    # 1,032, attention 2·(2·64 + 2·64) + 4·4 = 528, Ulysses' o_proj input copy 2·64 = 128
    # (test_plan_ulysses.py; ep2 alone has none), the expert block 1,116 + the EP gathers' int64
    # indices 2·2·8 = 32. Outside: final norm 516, ids 8, RoPE's cos and sin 2·2·16 = 64.
    assert layer_activation_bytes_per_token(spec, epsp, 2) == 1_032 + 528 + 128 + 1_116 + 32
    assert mem.activations == tokens * (2 * 2_836 + 588) == ref.activations + tokens * 2 * 128
    # backward's buffers: ZeRO-2's bucket (the whole bf16 model here) + autograd's .grad of the
    # largest tensor (the 64,000-element embedding) + one EP all-to-all's send and receive buffers,
    # 2 × 2048 tokens × top-2 × 64 × 2 bytes
    assert mem.device["buffers"] == 2 * 186_176 + 2 * 64_000 + 2 * tokens * 2 * 64 * 2
    assert {k: v for k, v in mem.device.items() if k != "activations"} == \
        {k: v for k, v in ref.device.items() if k != "activations"}
    t, t_ref = estimate_time(spec, epsp, long, FAST, 1), estimate_time(spec, ep, half, FAST, 1)
    # 2 sparse layers × 4 exchanges × 2048 tokens × top-2 × hidden 64 × 2 bytes × (ep − 1)/ep
    assert math.isclose(t.ep_comm, 2 * 4 * tokens * 2 * 64 * 2 * 0.5 / 1e9) and t.ep_comm == t_ref.ep_comm
    # Ulysses: per layer q, k, v out and the output back (2·64 + 2·64) of 2048 tokens × 2 bytes,
    # forward and backward, ring factor 1/2, 2 layers
    assert math.isclose(t.tp_comm, 2 * 2 * 0.5 * (2 * 64 + 2 * 64) * tokens * 2 / 1e9) and t_ref.tp_comm == 0
    assert t.dp_comm == t_ref.dp_comm  # the same ZeRO groups: dense over 4, experts over 2
    ckpt = estimate_time(spec, dataclasses.replace(epsp, checkpointing=True), long, FAST, 1)
    assert math.isclose(ckpt.ep_comm, t.ep_comm * 6 / 4) and math.isclose(ckpt.tp_comm, t.tp_comm * 3 / 2)
    # with tp2 on 8 ranks (tp2 × sp2 × dp2 against tp2 × dp4): tp's all-reduces and their buffers are
    # of the rank's 2048 tokens too; Ulysses moves the rank's heads, (2·64 + 2·64) / 2 per token
    tp_epsp = Layout("hybrid", 8, zero_stage=2, tp=2, sp=2, sp_mode="ulysses", ep=2)
    tp_ep = Layout("hybrid", 8, zero_stage=2, tp=2, ep=2)
    tp_mem, tp_ref = estimate_memory(spec, tp_epsp, long), estimate_memory(spec, tp_ep, half)
    assert tp_mem.activations - tp_ref.activations == tokens * 2 * 64  # o_proj's copy: 2 layers × 64 / tp2 × 2 bytes
    assert {k: v for k, v in tp_mem.device.items() if k != "activations"} == \
        {k: v for k, v in tp_ref.device.items() if k != "activations"}
    t2, t2_ref = estimate_time(spec, tp_epsp, long, FAST, 1), estimate_time(spec, tp_ep, half, FAST, 1)
    ulysses = 2 * 2 * 0.5 * (2 * 64 + 2 * 64) / 2 * tokens * 2 / 1e9
    assert math.isclose(t2.tp_comm, t2_ref.tp_comm + ulysses) and t2.ep_comm == t2_ref.ep_comm


# ---------------------------------------------------------------------------- against the plugin and a run
# Tiny Mixtrals for building every listed layout: 4 experts of 32, top-2, 2 key/value heads; with 4
# query heads every listed ep × sp layout on 4 ranks passes the planner's checks, with 2 the ones
# with sp4 or tp2 × sp2 do not (Ulysses needs the heads per tp rank divisible by sp).
BUILD_MODEL = dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64, tie_word_embeddings=False)
BUILD_MODELS = {"4 heads": BUILD_MODEL, "2 heads": dict(BUILD_MODEL, num_attention_heads=2)}
BUILD_SEQ = 16
# test_plan_moe's measured Mixtral (15.5M parameters: 8 experts of 512, top-2, 4 heads, 2 KV heads)
MEASURED_MOE = dict(model_type="mixtral", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=1024, tie_word_embeddings=False)
ULYSSES2 = dict(name="hybrid", ep_size=2, sp_size=2, sequence_parallelism="ulysses", reduce_bucket_mb=1)
MEASURED_CASES = {  # name: (make_plugin kwargs, seq, micro batch per data rank)
    "hybrid sp2+ep2 ulysses zero1": (dict(ULYSSES2, zero_stage=1), 256, 2),
    "hybrid sp2+ep2 ulysses zero2, 1024 tokens per rank": (dict(ULYSSES2, zero_stage=2), 1024, 2),
}


def _listed_layouts(model: dict) -> list[tuple[str, dict, str | None]]:
    """(name, plugin_options(), the planner's refusal or None) of every ep × sp layout listed for 4 ranks."""
    spec = load_spec(model)
    return [(l.name(), l.plugin_options(), structural_problem(l, spec, BUILD_SEQ))
            for l in _ep_sp(candidate_layouts(4, spec, seq=BUILD_SEQ))]


@pytest.fixture(scope="module")
def four_ranks(request):
    cases = [(dict(kw, precision="fp32"), MEASURED_MOE, seq, mb) for kw, seq, mb in MEASURED_CASES.values()]
    suites = {"test_ep2_sp2_estimate_within_15_percent_of_measured_peak": (measure, (cases,), {}),
              "test_every_listed_ep_sp_layout_builds_and_trains": (
                  build_every_layout, ({k: (m, BUILD_SEQ, _listed_layouts(m)) for k, m in BUILD_MODELS.items()},), {})}
    return spawn_suites(request, 4, suites, timeout=600)


@pytest.mark.slow
def test_every_listed_ep_sp_layout_builds_and_trains(four_ranks):
    """Every ep × sp layout the planner lists for 4 ranks is given to HybridParallelPlugin through
    `Layout.plugin_options()` and meets the plugin's own checks (ep divides dp × sp, Ulysses' heads,
    not with split-gather or pp): the ones the planner accepts build and train two steps (the loss
    falling, every rank reporting the same loss), the ones it refuses the plugin refuses too.
    Catches: the planner's Ulysses heads check left out (it would call sp4 buildable on 2 heads), a
    listed layout the plugin refuses (e.g. split-gather or pp with ep × sp, ep not dividing dp × sp)."""
    ranks = four_ranks.get("test_every_listed_ep_sp_layout_builds_and_trains")
    for label, model in BUILD_MODELS.items():
        listed = _listed_layouts(model)
        accepted = [name for name, _, problem in listed if problem is None]
        if label == "4 heads":
            assert len(listed) == len(accepted) == 20, listed
            assert {"hybrid sp4+ep4 ulysses zero2 ckpt", "hybrid tp2+sp2+ep2 ulysses zero1"} <= set(accepted)
        else:
            assert len(accepted) == 8 and len(listed) == 20, listed  # sp2 only (ep 2 or 4, ZeRO 1 or 2, ckpt)
        for name, _, problem in listed:
            kind, value = ranks[0][label][name]
            if problem is None:
                assert kind == "trained", (label, name, kind, value)
                losses, described = value
                assert losses[1] < losses[0], (label, name, losses)
                layout = next(l for l in candidate_layouts(4, load_spec(model), seq=BUILD_SEQ) if l.name() == name)
                # the plugin runs the planner's layout (describe(): "hybrid(precision=fp32, dp=2, ep=2, sp=2, ...")
                assert f"dp={layout.dp}, ep={layout.ep}, sp={layout.sp}, tp={layout.tp}" in described, (name, described)
                for rank, got in enumerate(ranks[1:], 1):  # every rank reports the same (all-reduced) loss
                    assert got[label][name][1][0] == losses, (label, name, rank, got[label][name])
            else:
                assert kind == "refused" and "heads" in value, (label, name, problem, kind, value)


@pytest.mark.slow
def test_ep2_sp2_estimate_within_15_percent_of_measured_peak(four_ranks):
    """4 gloo ranks (dp 2 × Ulysses sp 2, ep2), 3 fp32 AdamW steps of test_plan_moe's 15.5M-parameter
    Mixtral: ZeRO-1 with 256 tokens per rank and ZeRO-2 with 1024; the worst rank's peak resident
    memory above its baseline against the plan. 15%: the tolerance of the planner's other measured
    tests (test_plan.py, test_plan_moe.py), not loosened. Measured 2026-12-06 over four runs (load
    1-20): -9.4% to -10.6% and -10.0% to -11.6% (docs/plan.md, Validation: the gap is not located).
    Catches activations counted over the whole sequence and routed experts not split over ep."""
    from plan_measured import estimate_errors

    ranks = four_ranks.get("test_ep2_sp2_estimate_within_15_percent_of_measured_peak")
    if "skip" in ranks[0][0]:
        pytest.skip(ranks[0][0]["skip"])
    def is_ep2_sp2(name, est):
        assert est.name == name.split(",")[0] and est.layout.ep == 2 and est.layout.sp == 2

    errors = estimate_errors(MEASURED_MOE, MEASURED_CASES, ranks, 4, check=is_ep2_sp2)
    assert all(abs(e) <= 0.15 for e in errors.values()), errors
