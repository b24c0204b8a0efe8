"""The comparison helpers of phalanx.testing (the measures every equivalence test uses), in one
process: what they measure, that they reject what they should, and what their messages say."""
from __future__ import annotations

import json

import pytest
import torch

from phalanx.testing import (Diff, assert_rel_close, assert_update_close, check, eps, rel_diff, rounding_rtol,
                             update_diff)


def test_rounding_rtol_is_eps_times_root_n():
    assert rounding_rtol(torch.float32, 128) == pytest.approx(8 * 2.0**-23 * 128**0.5)
    assert rounding_rtol(torch.bfloat16, 4) == pytest.approx(8 * 2.0**-7 * 2)
    assert eps(torch.float16) == 2.0**-10
    with pytest.raises(ValueError, match="n must be >= 1"):
        rounding_rtol(torch.float32, 0)


def test_rel_diff_of_numbers_lists_tensors_and_dicts():
    assert rel_diff(1.01, 1.0).value == pytest.approx(0.01)
    worst = rel_diff([2.0, 3.3, 4.0], [2.0, 3.0, 4.0])
    assert worst.value == pytest.approx(0.1) and worst.where == "[1]"
    # a tensor's error is relative to its largest magnitude, and the worst element is named
    t = torch.tensor([[10.0, 0.001], [1.0, -2.0]])
    bad = t.clone()
    bad[0, 1] += 0.05
    d = rel_diff(bad, t)
    assert d.value == pytest.approx(0.005) and d.where == "(0, 1)"
    d = rel_diff({"a": t, "b": bad}, {"a": t, "b": t})
    assert d.value == pytest.approx(0.005) and d.where == "b (0, 1)"
    assert rel_diff(torch.zeros(3), torch.zeros(3)).value == 0.0
    assert rel_diff(torch.ones(3), torch.zeros(3)).value == float("inf")
    assert rel_diff(torch.tensor([float("nan")]), torch.tensor([1.0])).value == float("inf")


@pytest.mark.parametrize("got, want", [
    ([], []),                       # an empty result must fail, not pass vacuously
    ([1.0], [1.0, 2.0]),            # so must a short one
    ({}, {"w": torch.ones(2)}),     # and a missing tensor
    ({"w": torch.ones(3)}, {"w": torch.ones(2)}),
])
def test_rel_diff_refuses_empty_short_or_mismatched_results(got, want):
    with pytest.raises(AssertionError):
        rel_diff(got, want)


def test_update_diff_measures_the_fraction_of_the_step_that_differs():
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(50, 40, generator=g), "b": torch.randn(40, generator=g)}
    step = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    want = {k: start[k] + step[k] for k in start}
    assert update_diff(want, want, start).value == 0.0
    # a learning rate 3% off is an update error of 3%, whatever the size of the weights
    lr_off = {k: start[k] + 1.03 * step[k] for k in start}
    assert update_diff(lr_off, want, start).value == pytest.approx(0.03, rel=1e-3)
    # not training at all is an error of 100%; only one tensor trained: its share is named
    assert update_diff(start, want, start).value == pytest.approx(1.0)
    half = update_diff({"w": want["w"], "b": start["b"]}, want, start)
    assert 0 < half.value < 1 and half.where == "b"
    # three tensors instead of dicts
    assert update_diff(lr_off["w"], want["w"], start["w"]).value == pytest.approx(0.03, rel=1e-3)
    with pytest.raises(AssertionError, match="did not change"):
        update_diff(want, start, start)
    with pytest.raises(AssertionError, match="missing keys"):
        update_diff({"w": want["w"]}, want, start)


def test_update_floor_is_the_rounding_of_the_stored_weights():
    """A step of 1e-4 on weights of magnitude 1, stored in fp32: each weight holds the step only to
    eps·|w|, so two correct runs may differ by up to eps·‖w‖/‖Δ‖ ≈ 1.2e-3 of the step."""
    start = {"w": torch.ones(1000)}
    want = {"w": start["w"] + 1e-4}
    d = update_diff(want, want, start)
    assert d.floor == pytest.approx(eps(torch.float32) * (1 + 1e-4) / 1e-4, rel=1e-3)
    nudged = {"w": want["w"] + eps(torch.float32)}  # one ulp everywhere: explained by rounding alone
    check(update_diff(nudged, want, start), 1e-6, "one ulp")
    wrong = {"w": start["w"] + 1.1e-4}  # a 10% larger step is not
    with pytest.raises(AssertionError, match="the rounding of the compared values"):
        check(update_diff(wrong, want, start), 1e-6, "10% step")


def test_check_names_what_failed_and_by_how_much(tmp_path, monkeypatch):
    log = tmp_path / "tolerances.jsonl"
    monkeypatch.setenv("PHALANX_TOLERANCE_LOG", str(log))
    assert check(Diff(1e-6, "[2]"), 1e-5, "losses") == 1e-6
    with pytest.raises(AssertionError) as err:
        assert_rel_close([1.0, 2.0, 3.003], [1.0, 2.0, 3.0], 1e-4, "2 ranks losses")
    assert str(err.value) == "2 ranks losses: rel error 0.001 at [2] exceeds the tolerance 0.0001"
    with pytest.raises(AssertionError, match="nan"):
        check(Diff(float("nan")), 1.0, "nan")
    start = {"w": torch.zeros(4)}
    with pytest.raises(AssertionError, match=r"weights: update error .* 0\.5 at w exceeds the tolerance 0\.0001"):
        assert_update_close({"w": torch.full((4,), 1.5)}, {"w": torch.ones(4)}, start, 1e-4, "weights")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["what"] for r in records] == ["losses", "2 ranks losses", "nan", "weights"]
    assert records[1]["value"] == pytest.approx(1e-3) and records[1]["tol"] == 1e-4
