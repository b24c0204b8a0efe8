"""The benchmark scripts' variant tables stay consistent (a renamed table once broke
`bench/train_throughput.py --part plugins` with a KeyError before it measured anything).

Cheap: imports the script and checks its tables; the benchmarks themselves are timed by hand
(`bench/`), and run at their smallest arguments in tests/bench/test_bench_smoke.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_train_throughput_variant_tables_agree():
    tt = _load("train_throughput")
    # part 1: every plugin variant is known to `available`, has a label and a known baseline
    for name in tt.PLUGIN_VARIANTS:
        assert tt.available(name), name
        assert name in tt.LABELS
        assert tt.BASELINE_OF.get(name, "raw_ddp") in tt.PLUGIN_VARIANTS
    # part 3: every option row names a sized variant, and its plugin accepts its options
    from phalanx.booster.plugins import make_plugin
    for name, (plugin, options) in tt.SIZED_PLUGIN_OPTIONS.items():
        assert name in tt.SIZED_VARIANTS, name
        make_plugin(plugin, precision="fp32", max_norm=1.0, **options)
    for name in tt.SIZED_VARIANTS:
        assert name in tt.SIZED_LABELS, name
