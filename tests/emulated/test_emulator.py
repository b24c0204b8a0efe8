"""The emulated GPU (phalanx.emulate): what it enforces, what it counts, and that it catches the
device bugs it exists for (a recipe with a batch, a reference model or a collective left on the
CPU fails under emulation, naming the device, and runs without it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import ROOT, emulated_env, run_emulated  # noqa: E402

import emulator_checks  # noqa: E402


@pytest.fixture(scope="module")
def results():
    out = run_emulated([sys.executable, str(Path(__file__).parent / "emulator_checks.py")], timeout=300,
                       PHALANX_EMULATE_TRITON="1")
    line = next(l for l in out.splitlines() if l.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("name", sorted(emulator_checks.CHECKS))
def test_emulator(name, results):
    assert results[name] is None, results[name]


MUTANT = str(Path(__file__).parent / "mutant_recipe.py")
BUGS = {
    "batch_on_cpu": ["Expected all tensors to be on the same device", "emucuda:0 and cpu"],
    "reference_on_cpu": ["Expected all tensors to be on the same device", "emucuda:0 and cpu"],
    "collective_on_cpu": ["all_reduce got a CPU tensor", "NCCL"],
}


def _run(bug: str, *, emulate: bool, ranks: int = 1):
    import subprocess

    env = emulated_env() if emulate else {**emulated_env(), "PHALANX_EMULATE_GPU": "0"}
    cmd = [sys.executable, MUTANT, "--bug", bug] if ranks == 1 else \
        [sys.executable, "-m", "phalanx.cli", "run", "-n", str(ranks), MUTANT, "--bug", bug]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_device_bug_fails_under_emulation_and_not_without(bug):
    plain = _run(bug, emulate=False)
    assert plain.returncode == 0 and "held-out metric" in plain.stdout, plain.stderr[-2000:]
    emulated = _run(bug, emulate=True)
    assert emulated.returncode != 0, "the bug was not caught under PHALANX_EMULATE_GPU=1"
    for words in BUGS[bug]:
        assert words in emulated.stderr, emulated.stderr[-3000:]


def test_the_correct_recipe_runs_under_emulation_on_two_ranks():
    fixed = _run("none", emulate=True, ranks=2)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "held-out metric" in fixed.stdout
    assert "cuda:0 (emulated)" in fixed.stdout  # launch's first line names the emulated device
