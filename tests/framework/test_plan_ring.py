"""phalanx.plan with ring attention (docs/plan.md): HybridParallelPlugin runs
`sequence_parallelism="ring"` (phalanx.sequence.ring: the sequence split into 2·sp zigzag chunks,
key/value blocks passed around the sp ranks), and the planner lists it beside Ulysses wherever the
plugin builds it (with tp, with ep, ZeRO-1/2, never with pp), refuses what the plugin refuses
(a sequence not divisible by 2·sp, attention dropout, a sliding window shorter than the sequence)
and counts ring's own terms: o_proj's copied input among the activations, the backward's fp32
gradient accumulators and key/value blocks in flight, the key/value and gradient hops in the step
time. Checked against the plugin on 4 gloo ranks (every listed ring layout builds and trains) and
against the measured peak of a ring layout."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from phalanx.plan import Layout, load_spec, plan
from phalanx.plan.layout import candidate_layouts, structural_problem
from phalanx.plan.memory import estimate_memory, layer_activation_bytes_per_token, ring_buffer_bytes_per_token
from phalanx.plan.timing import estimate_time
from phalanx.plan.workload import Hardware, Workload
from plan_measured import build_every_layout, measure
from spawn_batch import spawn_suites

torch.set_num_threads(1)

LLAMA_HAND = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
FAST = Hardware(device_memory=2**40, peak_flops=1e30, efficiency=1.0, bandwidth=1e9)  # compute ≈ 0: comm shows


def _ring(layouts):
    return [l for l in layouts if l.sp_mode == "ring"]


# ---------------------------------------------------------------------------- the candidates
def test_ring_is_listed_where_ulysses_is_refused_for_heads():
    """28 query heads / 4 KV heads on 8 ranks at 128k tokens (Qwen2.5-7B's heads): Ulysses with sp 8
    (or sp 4 under tp 2: 14 heads per rank) is refused, naming ring as the fix; ring with the same sp
    is listed and buildable, and ranks first in a plan where only sp 8 fits. Catches: ring left out
    of the candidates, Ulysses' head rule applied to ring."""
    spec = load_spec(dict(LLAMA_HAND, hidden_size=28 * 16, num_attention_heads=28, num_key_value_heads=4))
    seq = 131072
    rows = candidate_layouts(8, spec, seq=seq)
    ulysses8 = Layout("hybrid", 8, sp=8, sp_mode="ulysses")
    assert "heads per tp rank divisible by sp=8: use ring attention" in structural_problem(ulysses8, spec, seq)
    assert "divisible by sp=4" in structural_problem(Layout("hybrid", 8, tp=2, sp=4, sp_mode="ulysses"), spec, seq)
    ring = _ring(rows)
    assert {(l.tp, l.sp) for l in ring} == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    assert all(structural_problem(l, spec, seq) is None for l in ring)
    assert all(l.pp == 1 and l.plugin_options()["sequence_parallelism"] == "ring" for l in ring)
    assert {l.zero_stage for l in ring} == {1, 2} and {l.checkpointing for l in ring} == {False, True}
    assert Layout("hybrid", 8, zero_stage=1, tp=2, sp=4, sp_mode="ring").name() == "hybrid tp2+sp4 ring zero1"
    # 128k tokens of a 28-head model on 8 devices of 600 MiB: only sp 8 fits (ring sp8 ZeRO-2 451 MiB; the
    # best sp 4, tp2 × ring sp4, 696), and Ulysses' sp 8 is refused, so every fitting layout is ring sp 8
    ranked = plan(dict(LLAMA_HAND, hidden_size=28 * 16, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=1024), 8, "600MiB", seq=seq, reserve=0)
    fitting = [e for e in ranked if e.fits]
    assert fitting and all(e.layout.sp_mode == "ring" and e.layout.sp == 8 for e in fitting), \
        [e.name for e in fitting][:5]
    assert any(e.layout.sp == 8 and "heads" in (e.reason or "") and e.layout.sp_mode == "ulysses" for e in ranked)


def test_ring_refusals_mirror_the_plugin():
    """What HybridParallelPlugin refuses for ring, the planner refuses with one line saying why:
    pp > 1, a sequence not divisible into 2·sp chunks (the zigzag), attention dropout, a sliding
    window shorter than the sequence (Ulysses too); ep divides dp × sp under ring as under Ulysses.
    Catches: a ring layout listed with pp, the 2·sp divisibility checked as sp (12 tokens on sp 4
    pass an sp check but not ring's 8 chunks), dropout or the window left out."""
    spec = load_spec(LLAMA_HAND)
    ring4 = Layout("hybrid", 4, sp=4, sp_mode="ring")
    assert structural_problem(ring4, spec, 16) is None
    assert "2 × sp = 8 chunks" in structural_problem(ring4, spec, 12)
    assert structural_problem(Layout("hybrid", 4, sp=4, sp_mode="ulysses"), spec, 12) is None
    assert "not combined with pp=2" in structural_problem(Layout("hybrid", 4, pp=2, sp=2, sp_mode="ring"), spec, 16)
    dropout = load_spec(dict(LLAMA_HAND, attention_dropout=0.1))
    assert "attention dropout" in structural_problem(ring4, dropout, 16)
    assert structural_problem(Layout("hybrid", 4, sp=4, sp_mode="ulysses"), dropout, 16) is None
    mistral = load_spec(dict(LLAMA_HAND, model_type="mistral", sliding_window=8))
    for mode in ("ring", "ulysses"):
        assert "sliding window 8" in structural_problem(Layout("hybrid", 4, sp=2, sp_mode=mode), mistral, 16)
        assert structural_problem(Layout("hybrid", 4, sp=2, sp_mode=mode), mistral, 8) is None
    moe = load_spec(dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=2))
    assert structural_problem(Layout("hybrid", 4, sp=2, sp_mode="ring", ep=4), moe, 16) is None  # dp 2 × sp 2
    assert "must divide" in structural_problem(Layout("hybrid", 4, tp=2, sp=2, sp_mode="ring", ep=4), moe, 16)
    assert any(l.sp_mode == "ring" and l.ep > 1 for l in candidate_layouts(4, moe, seq=16))


# ---------------------------------------------------------------------------- the estimates by hand
def test_ring_memory_and_time_by_hand():
    """hybrid sp2 ring ZeRO-2 on 4 ranks (dp 2 × sp 2) against sp2 Ulysses, bf16, seq 4096 (2048
    tokens per rank), the hand Llama (hidden 64, 4 heads / 2 KV heads of 16: q 64, kv 32):
    the same parameters, ZeRO shard and per-token activations (both keep o_proj's copied input,
    p·q = 128 bytes per token and layer more than a layout without sp); backward's buffers add ring's fp32 accumulators and the
    key/value block in flight: 4·64 + 2·4·2·32 + 1·2·2·32 = 896 bytes per token (one layer);
    with sp 4 two blocks are in flight. Time: the forward hops (sp − 1) · T · kv · p hidden behind
    attention step by step (each of the sp steps against 1/sp of the pass's attention); the fp32
    gradient hops sp · T · kv · 4 always counted.
    Catches: ring's buffers or o_proj's copy left out, the buffers over the whole sequence,
    the gradient hops in the compute dtype or not counted, the forward hops counted in full
    against enough compute to hide them, or hidden behind the whole pass's attention instead of
    one step's."""
    spec = load_spec(LLAMA_HAND)
    work = Workload(seq=4096, micro_batch=1, dtype="bf16")
    ring = Layout("hybrid", 4, zero_stage=2, sp=2, sp_mode="ring")
    uly = dataclasses.replace(ring, sp_mode="ulysses")
    tokens = 2048
    plain = Layout("hybrid", 4, zero_stage=2)
    assert (layer_activation_bytes_per_token(spec, ring, 2) - layer_activation_bytes_per_token(spec, plain, 2)
            == 2 * 64 == layer_activation_bytes_per_token(spec, uly, 2) - layer_activation_bytes_per_token(spec, plain, 2))
    assert ring_buffer_bytes_per_token(spec, ring, 2) == 4 * 64 + 2 * 4 * 64 + 1 * 2 * 64 == 896
    assert ring_buffer_bytes_per_token(spec, dataclasses.replace(ring, world=8, sp=4), 2) == 896 + 2 * 64
    mem, ref = estimate_memory(spec, ring, work), estimate_memory(spec, uly, work)
    assert mem.device["parameters"] == ref.device["parameters"] and mem.device["optimizer"] == ref.device["optimizer"]
    assert mem.activations == ref.activations  # (the copy: both; test_plan_ulysses.py)
    assert mem.device["buffers"] - ref.device["buffers"] == tokens * 896
    # time: with compute ≈ 0 every byte shows; per layer forward 1 hop of 2048 · 64 · 2 bytes, backward
    # the same hop + 2 fp32 gradient hops of 2048 · 64 · 4 bytes; 2 layers
    t = estimate_time(spec, ring, work, FAST, 1)
    fwd, grads = tokens * 64 * 2 / 1e9, 2 * tokens * 64 * 4 / 1e9
    assert math.isclose(t.tp_comm, 2 * (fwd + fwd + grads))
    ckpt = estimate_time(spec, dataclasses.replace(ring, checkpointing=True), work, FAST, 1)
    assert math.isclose(ckpt.tp_comm, 2 * (2 * fwd + fwd + grads))  # the recomputed forward hops again
    # at 1 TFLOP/s each of a pass's 2 steps (half a layer's forward attention, 2 · 4096 · 64 · 2048 / 2
    # FLOPs ≈ 0.54 ms) hides its hop (0.26 ms); the gradient hops (1.05 ms per layer) stay
    slow = dataclasses.replace(FAST, peak_flops=1e12)
    assert math.isclose(estimate_time(spec, ring, work, slow, 1).tp_comm, 2 * grads)
    # at 4 TFLOP/s a forward step (0.134 ms) hides only part of its hop, backward's (0.268 ms) all of it
    step = 2 * 4096 * 64 * tokens / 4e12 / 2
    assert math.isclose(estimate_time(spec, ring, work, dataclasses.replace(FAST, peak_flops=4e12), 1).tp_comm,
                        2 * (fwd - step + grads))


# ---------------------------------------------------------------------------- against the plugin and a run
BUILD_MODEL = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=False)
BUILD_SEQ = 16      # divides into 2 × sp chunks for sp 2 and 4
REFUSED_SEQ = 12    # 12 % 8: sp 4 refused by the zigzag, sp 2 accepted
# A Llama for the measured peak: attention-heavy (4 heads of 128 over hidden 256, a narrow MLP, a small
# vocabulary, 2 layers), so that ring's backward buffers are a large share of the peak (28 of 127 MiB)
MEASURED = dict(vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, head_dim=128, max_position_embeddings=1024,
                tie_word_embeddings=False)
MEASURED_CASES = {  # name: (make_plugin kwargs, seq, micro batch per data rank)
    "hybrid sp2 ring zero1": (dict(name="hybrid", sp_size=2, sequence_parallelism="ring", zero_stage=1,
                                   reduce_bucket_mb=1), 256, 16),
}
# A tiny Mixtral for ring × expert parallelism (4 experts of 32, top-2)
BUILD_MOE = dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=64, tie_word_embeddings=False)


def _listed(model: dict, seq: int) -> list[tuple[str, dict, str | None]]:
    """Every ring layout listed for 4 ranks (for the Mixtral: those with ep > 1, without checkpointing:
    the rest are the dense model's rows again)."""
    spec = load_spec(model)
    rows = _ring(candidate_layouts(4, spec, seq=BUILD_SEQ))
    if spec.is_moe:
        rows = [l for l in rows if l.ep > 1 and not l.checkpointing]
    return [(l.name(), l.plugin_options(), structural_problem(l, spec, seq)) for l in rows]


BUILD_JOBS = {"seq 16": (BUILD_MODEL, BUILD_SEQ), "seq 12": (BUILD_MODEL, REFUSED_SEQ),
              "attention dropout": (dict(BUILD_MODEL, attention_dropout=0.1), BUILD_SEQ),
              "mixtral ep": (BUILD_MOE, BUILD_SEQ)}


def _jobs():
    return {label: (model, seq, _listed(model, seq)) for label, (model, seq) in BUILD_JOBS.items()}


@pytest.fixture(scope="module")
def four_ranks(request):
    cases = [(dict(kw, precision="fp32"), MEASURED, seq, mb) for kw, seq, mb in MEASURED_CASES.values()]
    suites = {"test_ring_estimate_within_15_percent_of_measured_peak": (measure, (cases,), {}),
              "test_every_listed_ring_layout_builds_and_trains": (build_every_layout, (_jobs(),), {})}
    return spawn_suites(request, 4, suites, timeout=600)


@pytest.mark.slow
def test_every_listed_ring_layout_builds_and_trains(four_ranks):
    """Every ring layout the planner lists for 4 ranks (sp 2 and 4, tp2 × sp2, ZeRO 1/2, with and
    without checkpointing: 12; on a tiny Mixtral also the 10 with ep 2 or 4 dividing dp × sp, without
    checkpointing) is given to HybridParallelPlugin by `Layout.plugin_options()`: on 16
    tokens all build and train two steps as the plugin's describe() says (dp, sp, tp, ring), every
    rank reporting the same loss; on 12 tokens the planner refuses the sp 4 layouts (12 % 8) and so
    does the plugin, at the first batch, and the sp 2 ones train; with attention dropout the planner
    refuses every ring layout and so does the plugin. Catches: a listed ring layout the plugin
    refuses, the zigzag's 2·sp or the dropout check left out of the planner (it would call them
    buildable)."""
    ranks = four_ranks.get("test_every_listed_ring_layout_builds_and_trains")
    jobs = _jobs()
    assert len(jobs["seq 16"][2]) == 12 and all(p is None for *_, p in jobs["seq 16"][2])
    assert sum(p is None for *_, p in jobs["seq 12"][2]) == 8  # sp2 and tp2 × sp2
    assert all(p is not None for *_, p in jobs["attention dropout"][2])
    moe = {name for name, _, p in jobs["mixtral ep"][2] if p is None}
    assert len(jobs["mixtral ep"][2]) == len(moe) == 10, jobs["mixtral ep"][2]  # (sp, ep) 2·2, 2·4, 4·2, 4·4, tp2 2·2
    assert {"hybrid sp4+ep4 ring zero2", "hybrid tp2+sp2+ep2 ring zero1"} <= moe
    for label, (model, seq, listed) in jobs.items():
        for name, options, problem in listed:
            kind, value = ranks[0][label][name]
            if problem is None:
                assert kind == "trained", (label, name, kind, value)
                losses, described = value
                assert losses[1] < losses[0], (label, name, losses)
                dp = 4 // (options["sp_size"] * options["tp_size"])
                ep = f"ep={options['ep_size']}, " if "ep_size" in options else ""
                assert (f"dp={dp}, {ep}sp={options['sp_size']}, tp={options['tp_size']}" in described
                        and "sp_mode=ring" in described), (name, described)
                for rank, got in enumerate(ranks[1:], 1):
                    assert got[label][name][1][0] == losses, (label, name, rank, got[label][name])
            else:
                assert kind == "refused", (label, name, problem, kind, value)
                want = "not divisible into 2 × sp" if label == "seq 12" else "attention dropout"
                assert want in value, (label, name, value)


def _ring_errors(ranks):
    from plan_measured import estimate_errors

    def is_ring(name, est):
        assert est.name == name and est.layout.sp_mode == "ring"

    return estimate_errors(dict(MEASURED), MEASURED_CASES, ranks, 4, check=is_ring)


@pytest.mark.slow
def test_ring_estimate_within_15_percent_of_measured_peak(four_ranks, monkeypatch):
    """4 gloo ranks (dp 2 × ring sp 2, ZeRO-1), 3 fp32 AdamW steps of an attention-heavy Llama
    (hidden 256, 4 heads of 128, MLP 128, vocabulary 256, 2 layers), 16 × 128 tokens per rank: the
    worst rank's peak above its baseline against the plan, within the 15% of the planner's other
    measured tests (not loosened). Measured 2026-12-06: 126.7 MiB estimated, 129.7 measured (−2.3%).
    The mutant check: the same estimate without ring's backward buffers (`ring_buffer_bytes_per_token`
    → 0) misses by more than 15% (98.7 MiB, −24%)."""
    ranks = four_ranks.get("test_ring_estimate_within_15_percent_of_measured_peak")
    if "skip" in ranks[0][0]:
        pytest.skip(ranks[0][0]["skip"])
    errors = _ring_errors(ranks)
    assert all(abs(e) <= 0.15 for e in errors.values()), errors
    import phalanx.plan.memory as memory

    monkeypatch.setattr(memory, "ring_buffer_bytes_per_token", lambda *a: 0.0)
    dropped = _ring_errors(ranks)
    print("  without ring's buffers:", dropped)
    assert all(abs(e) > 0.15 for e in dropped.values()), dropped
