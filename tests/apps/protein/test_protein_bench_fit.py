"""bench/protein.py's memory fit: unchunked a + b L^2 + c L^3, chunked a + b L^2, and the
longest length within a budget, against exact synthetic peaks."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _bench():
    path = Path(__file__).resolve().parents[3] / "bench" / "protein.py"
    spec = importlib.util.spec_from_file_location("bench_protein", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fit_recovers_the_cubic_term_and_the_budget_length():
    bench = _bench()
    peak = lambda L: 20.0 + 0.01 * L ** 2 + 0.0005 * L ** 3          # noqa: E731
    fit = bench.fit_memory([(L, peak(L)) for L in (32, 64, 96, 128)], chunked=False)
    assert fit == pytest.approx({0: 20.0, 2: 0.01, 3: 0.0005}, rel=1e-6, abs=1e-6)
    assert bench.describe_fit(fit).endswith("L^3")
    # 20 + 0.01 L^2 + 0.0005 L^3 <= 1000 holds up to L = 118 (980.8; 1004.2 at 119)
    assert peak(118) <= 1000 < peak(119)
    assert bench.longest_fitting(fit, 1000.0) == 118


def test_chunked_fit_is_quadratic_and_short_sweeps_drop_terms():
    bench = _bench()
    fit = bench.fit_memory([(L, 5.0 + 0.02 * L ** 2) for L in (16, 32, 64)], chunked=True)
    assert fit == pytest.approx({0: 5.0, 2: 0.02}, rel=1e-6)
    assert bench.longest_fitting(fit, 5.0 + 0.02 * 500.5 ** 2) == 500
    two = bench.fit_memory([(8, 10.0), (16, 13.0)], chunked=False)     # two lengths: a + b L^2 only
    assert set(two) == {0, 2}
    assert bench.longest_fitting({0: 3.0}, 10.0) is None               # nothing grows: no answer
    assert bench.describe_fit({0: 1.5, 2: -0.25}) == "1.5 - 0.25 L^2"


def test_whole_max_length_measures_long_lengths_chunked_only(capsys):
    """--whole-max-length: past it only the chunked stack is measured (the unchunked fwd+bwd at 384
    would need ~30 GB), and the summary's whole/chunked ratios skip those lengths."""
    from types import SimpleNamespace

    bench = _bench()
    args = SimpleNamespace(chunk=16, whole_max_length=128, lengths=[64, 128, 256], ranks=[1], budget_gb=4.0)
    assert [bench.chunks_at(L, args) for L in args.lengths] == [(None, 16), (None, 16), (16,)]
    rows = [{"length": L, "ranks": 1, "chunk": c, "time_s": 1.0, "peak_mib": (L / 64) ** (2 if c else 3) * 10}
            for L in args.lengths for c in bench.chunks_at(L, args)]
    summary = bench.summarise(rows, args)
    assert set(summary["memory_fit_mib"]) == {"ranks1_chunkNone", "ranks1_chunk16"}
    printed = capsys.readouterr().out
    assert "L=128 ranks=1: chunk 16 / whole" in printed and "L=256 ranks=1: chunk 16 / whole" not in printed
    assert bench.chunks_at(384, SimpleNamespace(chunk=16, whole_max_length=None)) == (None, 16)
