"""`phalanx selfcheck` on a machine without a GPU: it installs the emulated GPU itself, runs the
kernel, collective, plugin and inference checks, prints its table, writes the JSON and says which
checks need real CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import ROOT, emulated_env  # noqa: E402


@pytest.mark.slow
def test_selfcheck_runs_under_emulation_and_reports(tmp_path):
    env = {**emulated_env(), "PHALANX_EMULATE_GPU": "0"}  # selfcheck must turn emulation on by itself
    out_json = tmp_path / "selfcheck.json"
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli", "selfcheck", "--only",
                           "kernels,collectives,plugins,inference", "--json", str(out_json)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "phalanx selfcheck on cuda:0 (emulated), 1 rank(s)" in proc.stdout
    report = json.loads(out_json.read_text())
    assert report["emulated"] is True
    by_name = {(r["group"], r["name"]): r for r in report["results"]}
    assert by_name[("inference", "torch.compile on CUDA")]["status"] == "skip"
    assert "real CUDA" in by_name[("inference", "torch.compile on CUDA")]["detail"]
    failed = [k for k, r in by_name.items() if r["status"] == "FAIL"]
    assert not failed, failed
    kernels = [r for r in report["results"] if r["group"] == "kernels"]
    assert len(kernels) == 14 and all(r["status"] == "pass" for r in kernels)  # dispatched through Triton
    assert {r["name"] for r in report["results"] if r["group"] == "plugins"} == {"ddp", "zero1", "zero2", "fsdp",
                                                                                  "gemini"}
    assert by_name[("inference", "greedy == HF generate, tokens/s")]["figures"]["ratio_vs_hf"] > 0


def test_selfcheck_refuses_an_unknown_group():
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli", "selfcheck", "--only", "kernel"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown group(s) ['kernel']" in proc.stderr
