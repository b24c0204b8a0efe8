"""The ZeRO optimizer and ZeroPlugin against plain single-process torch, on 2 and 4 gloo ranks.

Three spawns do all the multi-rank work (2 ranks, then 1 rank resuming the 2-rank checkpoint,
then 4 ranks); the tests below assert on their results. See zero_workers.py for the runs and
docs/zero.md for the tolerances (the measures and their units are in phalanx.testing), which are
stated here with the values measured on AVX-512 and AVX2 kernels.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch

import zero_workers as zw
from phalanx.testing import (ADAMW_UPDATE_RTOL, LOW_PRECISION_RTOL, Diff, check, rel_diff, rounding_rtol, spawn,
                             update_diff)
from phalanx.zero.flat_group import FlatParamGroup
from phalanx.zero.partition import FlatLayout, bucket_slots

TOKENS = zw.GLOBAL_BATCH * zw.SEQ  # the longest reduction behind a loss or a weight gradient
# fp32, the same computation in another reduction order (measured on 2/4 ranks, AVX-512 | AVX2
# kernels). Losses and gradient norms, rel: rounding_rtol, 8·eps·√128 = 1.1e-5 (≤ 2.2e-7 | 2.2e-7
# and ≤ 4.3e-7 | 5.1e-7). Parameters after 5 AdamW steps, update measure: ADAMW_UPDATE_RTOL,
# 1e-4 (≤ 4.3e-7 | 7e-6, the largest with clipping).
FP32_LOSS_RTOL = FP32_NORM_RTOL = rounding_rtol(torch.float32, TOKENS)
FP32_UPDATE_RTOL = ADAMW_UPDATE_RTOL
# bf16/fp16 against the same recipe on one process (low-precision model, fp32 masters):
# phalanx.testing.LOW_PRECISION_RTOL, measured here.
LOW_PRECISION = {"bf16": LOW_PRECISION_RTOL[torch.bfloat16], "fp16": LOW_PRECISION_RTOL[torch.float16]}

TWO_RANK_CONFIGS = list(zw.CONFIGS) + [f"bug:{name}" for name in zw.BUGS]
FOUR_RANK_CONFIGS = ["s1_fp32", "s2_fp32", "s2_bf16", "s2_fp16", "s2_accum"]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero-ckpt")
    return str(root / "zero2-2ranks"), str(root / "ddp-1rank")


@pytest.fixture(scope="module")
def references():
    refs = {p: zw.reference(p) for p in ("fp32", "bf16", "fp16")}
    refs["clip"] = zw.reference("fp32", max_norm=0.5)
    refs["sgd"] = zw.reference("fp32", kind="sgd")
    refs["clip_sgd"] = zw.reference("fp32", max_norm=0.5, kind="sgd")
    refs["adagrad"] = zw.reference("fp32", kind="adagrad")
    return refs


@pytest.fixture(scope="module")
def two_ranks(checkpoint_dirs):
    """Per-rank results of the 2-rank suite (parameters on rank 0 only)."""
    return spawn(zw.two_rank_suite, 2, TWO_RANK_CONFIGS, checkpoint_dirs[0], timeout=300)


@pytest.fixture(scope="module")
def one_rank(two_ranks, checkpoint_dirs):
    return spawn(zw.one_rank_suite, 1, *checkpoint_dirs)[0]


@pytest.fixture(scope="module")
def four_ranks(one_rank, checkpoint_dirs):
    return spawn(zw.four_rank_suite, 4, FOUR_RANK_CONFIGS, *checkpoint_dirs, timeout=300)[0]


def _results(request, world: int) -> dict:
    return request.getfixturevalue("two_ranks")[0] if world == 2 else request.getfixturevalue("four_ranks")


# ---------------------------------------------------------------------------- comparisons
def _fp32_checks(result: dict, ref: dict) -> dict[str, tuple[Diff, float]]:
    """name: (measured difference, tolerance) of a 5-step fp32 run against the reference."""
    return {"losses": (rel_diff(result["losses"], ref["losses"]), FP32_LOSS_RTOL),
            "gradient norms": (rel_diff(result["norms"], ref["norms"]), FP32_NORM_RTOL),
            "parameters": (update_diff(result["params"], ref["params"], zw.initial_params()), FP32_UPDATE_RTOL)}


def _assert_fp32_match(result: dict, ref: dict, what: str = "") -> None:
    assert not any(result["skipped"]), f"{what}: steps skipped {result['skipped']}"
    for name, (diff, tol) in _fp32_checks(result, ref).items():
        check(diff, tol, f"{what} {name}".strip())


# ---------------------------------------------------------------------------- partitioning (no ranks)
def test_flat_layout_pads_and_partitions_contiguously():
    layout = FlatLayout.build([5, 3, 6], world_size=4)  # 14 elements -> padded to 16, 4 per rank
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (14, 16, 4)
    assert [layout.rank_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    # param 0 (flat 0..5) straddles ranks 0 and 1; param 2 (flat 8..14) straddles ranks 2 and 3
    assert layout.owned_part(layout.slots[0], 0) == (0, 4) and layout.owned_part(layout.slots[0], 1) == (4, 5)
    assert layout.owned_part(layout.slots[1], 2) is None
    assert layout.owned_part(layout.slots[2], 3) == (4, 6)
    covered = {s.index: [] for s in layout.slots}
    for r in range(4):
        for slot, a, b in layout.owned_slots(r):
            covered[slot.index].append((a, b))
    for slot in layout.slots:  # every element of every parameter is owned exactly once
        ranges = sorted(covered[slot.index])
        assert ranges[0][0] == 0 and ranges[-1][1] == slot.numel
        assert all(x[1] == y[0] for x, y in itertools.pairwise(ranges))
    parts = layout.split_by_rank(3, 9)
    assert parts == [(3, 4), (4, 8), (8, 9), (9, 9)]
    assert FlatLayout.build([1], world_size=4).padded_numel == 4  # at least one element per rank


def test_buckets_follow_reverse_model_order_with_whole_parameters():
    layout = FlatLayout.build([4, 4, 10, 2, 2], world_size=2)
    buckets = bucket_slots(layout, bucket_numel=8)
    assert [[s.index for s in b] for b in buckets] == [[3, 4], [2], [0, 1]]
    for b in buckets:  # contiguous flat ranges
        assert all(x.end == y.offset for x, y in itertools.pairwise(b))


@pytest.mark.parametrize("world, sizes, bucket, exchanged", [
    (2, [4, 4, 10, 2, 2], 8, [True, True, True]),  # 2 ranks: a receive buffer is at most 2 x bucket
    # 4 ranks, 24 elements (6 per rank): [0..8) splits 6+2 (4 x 6 > 2 x 8: all-reduce), [8..18)
    # 4+6 (4 x 6 > 20: all-reduce), [18..24) lies in rank 3 (all-reduce)
    (4, [4, 4, 10, 2, 2, 2], 10, [False, False, False]),
    # 4 ranks, 16 elements of one parameter: split 4+4+4+4 (4 x 4 <= 2 x 16: all-to-all)
    (4, [16], 16, [True]),
    # 4 ranks, 24 elements: [0..16) splits 6+6+4 (4 x 6 <= 32: all-to-all), [16..24) 2+6 (24 > 16)
    (4, [16, 4, 4], 16, [True, False]),
])
def test_all_to_all_only_where_its_receive_buffer_fits(world, sizes, bucket, exchanged):
    """gloo's reduction is an all-to-all (the bytes of a reduce-scatter), but a rank receives
    world copies of its part of a bucket: a bucket lying mostly in one rank's range is
    all-reduced in place instead, so no receive buffer exceeds twice the bucket."""
    from phalanx.zero.reducer import GradReducer

    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    group = FlatParamGroup(params, rank=0, world_size=world, process_group=None)
    reducer = GradReducer([group], stage=2, bucket_numel=bucket, overlap=False, process_group=None, rank=0,
                          world_size=world, collective="all_to_all")
    got = [b.exchange for b in sorted(reducer.buckets, key=lambda b: b.lo)]
    assert got == exchanged
    for b in reducer.buckets:
        if b.exchange:
            assert world * max(hi - lo for lo, hi in group.layout.split_by_rank(b.lo, b.hi)) <= 2 * (b.hi - b.lo)


@pytest.mark.parametrize("world", [2, 4])
def test_own_part_exchange_sums_to_the_reduce_scatter(world):
    """gloo's reduce-scatter as an all-to-all (`zero.comm.OwnPartExchange`), with uneven and
    empty parts: the copies left on each rank sum to its part of the reduction; a rank whose part
    lies at an end of the tensor keeps it out of the exchange (no copy to itself, a receive
    buffer one part smaller), one in the middle receives its own copy too."""
    for rank, result in enumerate(spawn(zw.own_part_exchange_suite, world)):
        for sizes, r in result.items():
            assert r["equal"], (world, rank, sizes)
            assert r["kept_out"] == r["at_an_end"], (world, rank, sizes, r)
            part = json.loads(sizes)[rank]
            assert r["copies"] == (world if part else 0)
            assert r["received"] == part * (world - 1 if r["kept_out"] else world)


@pytest.mark.parametrize("copies", [1, 2, 4])
def test_sum_into_widens_low_precision_copies_when_asked(copies):
    """`zero.comm.sum_into`: with `widen=True` (FSDPPlugin's bf16 exchange) bf16 copies summed into
    an fp32 output give the fp32 sum of their values; by default (ZeRO, whose CPU-offload path sums
    on the device in the communication dtype and must give the same numbers) the first two are
    added in bf16, as `torch.add` does (1 + 2^-9 -> 1); fp32 copies give the fp32 sum either way."""
    from phalanx.zero.comm import sum_into

    g = torch.Generator().manual_seed(copies)
    values = [torch.randn(1000, generator=g).bfloat16() for _ in range(copies)]
    for v in values[1:-1]:
        v[0] = 0.0
    values[0][0], values[-1][0] = 1.0, 2.0 ** -9 if copies > 1 else 1.0
    want = torch.zeros(1000)
    for v in values:
        want += v.float()
    got = sum_into(torch.full((1000,), float("nan")), values, widen=True)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    rounded = sum_into(torch.full((1000,), float("nan")), values)
    if copies > 1:
        assert got[0].item() == 1.0 + 2.0 ** -9
    if copies == 2:  # the pair torch.add sums in bf16 (with more copies the rest are added in fp32)
        assert rounded[0].item() == 1.0
    assert torch.equal(sum_into(torch.empty(1000), [v.float() for v in values]), want)


# ---------------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize("factory", [
    lambda ps: torch.optim.LBFGS(ps),
    lambda ps: torch.optim.Adafactor(ps),
    lambda ps: torch.optim.SparseAdam(ps),
], ids=["LBFGS", "Adafactor", "SparseAdam"])
def test_unsupported_optimizer_is_refused_with_the_supported_list(factory):
    from phalanx.zero import ZeroOptimizer

    model = torch.nn.Linear(3, 2)
    optimizer = factory(list(model.parameters()))
    with pytest.raises(ValueError) as err:
        ZeroOptimizer(optimizer)
    text = str(err.value)
    assert type(optimizer).__name__ in text
    for name in ("Adam", "AdamW", "SGD"):
        assert name in text


def test_plugin_options_are_validated():
    from phalanx.booster.plugins import make_plugin
    from phalanx.booster.plugins.zero import ZeroPlugin

    assert make_plugin("zero1").config.stage == 1 and make_plugin("zero2", precision="bf16").precision.name == "bf16"
    with pytest.raises(ValueError, match="stage 3 shards parameters"):
        ZeroPlugin(stage=3)
    with pytest.raises(ValueError, match="reduce_bucket_mb"):
        ZeroPlugin(reduce_bucket_mb=0)
    with pytest.raises(ValueError, match="grad_collective='allreduce'"):
        make_plugin("zero2", grad_collective="allreduce")
    with pytest.raises(ValueError, match="grad_collective='allreduce'.*all_to_all"):  # FSDPPlugin's own choice
        make_plugin("fsdp", grad_collective="allreduce")


# ---------------------------------------------------------------------------- equivalence (core)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_matches_single_process(world, stage, references, request):
    _assert_fp32_match(_results(request, world)[f"s{stage}_fp32"], references["fp32"], f"{world} ranks s{stage}")


@pytest.mark.parametrize("config", ["s2_fp32_no_overlap", "s2_fp32_one_bucket", "s2_fp32_prefetch",
                                    "s1_fp32_reduce_scatter", "s2_fp32_reduce_scatter",
                                    "s1_fp32_all_reduce", "s2_fp32_all_reduce",
                                    "s2_accum_every_microstep_reduce_scatter"])
def test_fp32_matches_without_overlap_and_with_one_bucket(config, references, two_ranks):
    """(s2_fp32_prefetch: parameters published during the next forward; the losses, compared
    at every step, would differ if a forward ran on stale weights.)"""
    _assert_fp32_match(two_ranks[0][config], references["fp32"], config)


@pytest.mark.parametrize("bug, caught_by", [  # measured: losses, gradient norms, update
    ("rank1_gradient_dropped", ("losses", "gradient norms", "parameters")),  # 1.2e-3, 0.30, 0.96
    # AdamW divides by the gradient's own scale: a doubled gradient moves the update only through
    # Adam's eps (4.6e-4, 4.6x the tolerance); the gradient norm shows it plainly (1.0, losses 4.4e-7)
    ("gradients_summed", ("gradient norms",)),
    ("lr_3pct_high", ("losses", "parameters")),  # 1.5e-4, 3.9e-3, 4.4e-2
])
def test_the_fp32_comparison_rejects_broken_runs(bug, caught_by, references, two_ranks):
    """The comparison that passes the correct run (ZeRO-2, fp32, 2 ranks) fails each deliberately
    broken variant of it (zero_workers.BUGS), by at least 10× its tolerance on the measures that
    should see the bug."""
    _assert_fp32_match(two_ranks[0]["s2_fp32"], references["fp32"], "the correct run")
    result = two_ranks[0][f"bug:{bug}"]
    with pytest.raises(AssertionError):
        _assert_fp32_match(result, references["fp32"], bug)
    checks = _fp32_checks(result, references["fp32"])
    for name in caught_by:
        diff, tol = checks[name]
        assert diff.value > 10 * (tol + diff.floor), f"{bug}: {name} {diff.value:.3g} is not far outside {tol:.3g}"


@pytest.mark.parametrize("config,world", [("s1_bf16", 2), ("s2_bf16", 2), ("s1_fp16", 2), ("s2_fp16", 2),
                                          ("s2_bf16", 4), ("s2_fp16", 4), ("s1_bf16_prefetch", 2),
                                          ("s2_bf16_reduce_scatter", 2)])
def test_low_precision_matches_single_process(config, world, references, request):
    precision = config.split("_")[1]
    loss_rtol, norm_rtol, update_rtol = LOW_PRECISION[precision]
    result, ref = _results(request, world)[config], references[precision]
    assert not any(result["skipped"])
    where = f"{world} ranks {config}"
    check(rel_diff(result["losses"], ref["losses"]), loss_rtol, f"{where} losses")
    check(rel_diff(result["norms"], ref["norms"]), norm_rtol, f"{where} gradient norms")
    check(update_diff(result["params"], ref["params"], zw.initial_params(precision)), update_rtol,
          f"{where} parameters")


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_matches_torch_clip_grad_norm(stage, references, two_ranks):
    ref = references["clip_sgd"]
    assert min(ref["norms"]) > 0.5  # max_norm 0.5 clips every step
    _assert_fp32_match(two_ranks[0][f"s{stage}_clip_sgd"], ref, f"s{stage} clip sgd")
    # SGD is linear in the gradient: the clipped run is far from the unclipped one
    unclipped = update_diff(two_ranks[0][f"s{stage}_clip_sgd"]["params"], references["sgd"]["params"],
                            zw.initial_params())
    assert unclipped.value > 0.1, f"clipping changed the SGD update by only {unclipped.value:.3g}"
    _assert_fp32_match(two_ranks[0][f"s{stage}_clip"], references["clip"], f"s{stage} clip adamw")


def test_another_elementwise_optimizer_with_eager_state(references, two_ranks):
    """Adagrad creates its state at construction; the wrapper drops it and it is rebuilt on the shards."""
    _assert_fp32_match(two_ranks[0]["s2_adagrad"], references["adagrad"], "adagrad")


@pytest.mark.parametrize("config,world", [("s1_accum", 2), ("s2_accum", 2), ("s1_accum_every_microstep", 2),
                                          ("s2_accum_every_microstep", 2), ("s2_accum", 4)])
def test_gradient_accumulation_matches_the_big_batch(config, world, references, request):
    """Two micro-batches per rank under booster.no_sync (reduce once), or without it (reduce
    each micro-step and add up in the fp32 shard), equal one step on the whole batch."""
    _assert_fp32_match(_results(request, world)[config], references["fp32"], f"{world} ranks {config}")


@pytest.mark.parametrize("world", [2, 4])
def test_padded_layout_one_param_buckets_and_unused_parameters(world, request):
    toy = _results(request, world)["toy"]
    assert toy["padding"] > 0 and toy["launched_at_flush"] > 0
    check(update_diff(toy["params"], toy["ref"], toy["start"]), FP32_UPDATE_RTOL, f"{world} ranks toy parameters")


# ---------------------------------------------------------------------------- memory and overlap
def test_zero2_shards_optimizer_state_and_gradients(two_ranks):
    mem = two_ranks[0]["memory"]
    for stage in ("s1", "s2"):
        info = mem[stage]
        assert info["state_keys"] == ["exp_avg", "exp_avg_sq"]
        slack = info["padding"] * len(info["state_keys"]) * 4  # padded elements hold state too
        assert 0 <= 2 * info["state_bytes"] - mem["full_state_bytes"] <= slack
        assert info["grad_shard_numel"] * 2 == mem["numel"] + info["padding"]
        assert info["grads_left_on_params"] == 0  # hooks moved every gradient into a bucket
        # the user's optimizer now holds one flat fp32 shard per param group
        assert [len(g) for g in info["shard_per_group"]] == [1, 1]
        assert sum(g[0][0] for g in info["shard_per_group"]) == info["grad_shard_numel"]
    assert mem["s1"]["persistent_grad_numel"] == mem["numel"]  # ZeRO-1 keeps the full gradient
    assert mem["s2"]["persistent_grad_numel"] == 0  # ZeRO-2 keeps only its fp32 shard


def test_every_bucket_is_reduced_during_backward(two_ranks):
    for stage in ("s1", "s2"):
        info = two_ranks[0]["memory"][stage]
        assert info["buckets"] > 1
        assert info["launched_in_backward"] == 3 * info["buckets"]  # 3 steps, all from the hooks
        assert info["launched_at_flush"] == 0


# ---------------------------------------------------------------------------- optimizer kernel and step phases
def test_the_step_runs_torchs_fused_adamw_over_the_flat_shard(two_ranks):
    """One fused-kernel call per step over the single flat shard (the single-tensor loop makes
    ~8 passes over it); the user's `fused`/`foreach` stay as built, in the live param groups and
    in the checkpoint, so the checkpoint loads into DDP/FSDP unchanged."""
    for rank in two_ranks:
        default = rank["kernels"]["default"]
        assert default["fused_calls"] == [1, 1]  # 2 steps x 1 group, one tensor (the shard) each
        assert default["group_after"] == {"fused": None, "foreach": None}
        assert default["saved"] == {"fused": None, "foreach": None}


def test_a_users_kernel_choice_is_kept(two_ranks):
    for label, expected in (("user_fused_false", {"fused": False, "foreach": None}),
                            ("user_foreach_true", {"fused": None, "foreach": True})):
        result = two_ranks[0]["kernels"][label]
        assert result["fused_calls"] == [], label
        assert result["group_after"] == expected and result["saved"] == expected, label


def test_step_reports_its_phases(two_ranks):
    phases = two_ranks[0]["kernels"]["default"]["phases"]
    assert set(phases) == {"reduce", "norm", "optimizer", "gather"}
    assert all(0 <= v < 60 for v in phases.values())
    assert phases["optimizer"] > 0 and phases["gather"] > 0


def test_fsdp_plugin_steps_adamw_with_the_fused_kernel(two_ranks):
    """FSDPPlugin: one fused call over all its (DTensor) parameters per step, group unchanged.
    Its equivalence with one process is tests/framework/test_plugins.py."""
    fsdp = two_ranks[0]["kernels"]["fsdp"]
    assert fsdp["fused_calls"] == [fsdp["params"]] and fsdp["group_after"] is None


def test_prefetch_defers_the_publication_until_forward_or_wait(two_ranks):
    for rank in two_ranks:
        result = rank["prefetch"]
        assert result["chunks"] > 1 and result["pending_after_step"] == result["chunks"]
        assert result["hooked_modules"] > 0
        assert result["params_equal_masters"]


# ---------------------------------------------------------------------------- fp16 overflow
def test_fp16_overflow_skips_the_step_on_every_rank(two_ranks):
    for rank in two_ranks:
        result = rank["overflow"]
        assert result["everywhere"] == {"skipped": True, "scale": 2.0**39, "no_state": True,
                                        "params_unchanged": True}
        assert result["next_step_ok"]
        # an inf in rank 0's shard only: both ranks skip and halve the scale
        assert result["one_rank"] == {"skipped": True, "scale": zw.FP16_SCALE / 2, "steps_unchanged": True,
                                      "masters_unchanged": True}


# ---------------------------------------------------------------------------- cpu offload: test_zero_offload.py


# ---------------------------------------------------------------------------- checkpoints
def test_optimizer_checkpoint_moves_between_world_sizes_and_plugins(two_ranks, one_rank, four_ranks):
    """Saved by ZeRO-2 on 2 ranks after 3 steps; resumed on 1 rank (DDP, ZeRO-1, ZeRO-2) and on 4
    ranks (ZeRO-2; and ZeRO-1 from the DDP re-save): the last 2 steps match the run that never
    stopped."""
    uninterrupted = two_ranks[0]["saved"]
    resumed = {**{f"1 rank {k}": v for k, v in one_rank.items()},
               "4 ranks zero2": four_ranks["resume_zero2"], "4 ranks zero1 from ddp": four_ranks["resume_from_ddp"]}
    assert len(resumed) == 5
    for name, result in resumed.items():
        check(rel_diff(result["losses"], uninterrupted["losses"][zw.SAVE_AT:]), FP32_LOSS_RTOL, f"{name} losses")
        # the update of the 2 steps after the checkpoint
        check(update_diff(result["params"], uninterrupted["params"], uninterrupted["params_at_save"]),
              FP32_UPDATE_RTOL, f"{name} parameters")
