"""Run a command or a set of existing tests in a child process under the emulated GPU.

The emulated GPU is registered for the whole of a process (`PHALANX_EMULATE_GPU=1` makes
`import phalanx` install it), so everything that runs emulated runs in a child: a recipe's
command, `phalanx run -n 2 ...`, or a pytest of existing test node ids, whose spawned ranks inherit
the variable.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# PHALANX_TESTS_ON_CUDA=1 (bench/gpu_session.sh sets it on a GPU machine): the same commands run on
# the machine's real CUDA device instead, no emulation, kernels compiled; runs of more ranks than
# there are GPUs are skipped. The logs then name "cuda:0" without "(emulated)".
ON_CUDA = os.environ.get("PHALANX_TESTS_ON_CUDA") == "1"
DEVICE_LINE = "device cuda:0" if ON_CUDA else "device cuda:0 (emulated)"


def emulated_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PHALANX_THREADS": env.get("PHALANX_THREADS", "1")})
    if not ON_CUDA:
        env.update({"PHALANX_EMULATE_GPU": "1", "TRITON_INTERPRET": "1"})
    env.update(extra)
    return env


def on_the_device(output: str) -> bool:
    """Whether a run's output says it ran on the (emulated, or with ON_CUDA the real) GPU."""
    return "cuda:0" in output if ON_CUDA else "(emulated)" in output


def run_emulated(args: list[str], *, timeout: float = 900, cwd: Path | None = None, **env: str) -> str:
    """Run `args` (e.g. [sys.executable, "-m", "apps.protein.train", ...]) under the emulated GPU;
    fail with the tail of its output unless it exits 0. Returns stdout + stderr."""
    proc = subprocess.run(args, cwd=cwd or ROOT, env=emulated_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode} under PHALANX_EMULATE_GPU=1:\n"
                             + output[-6000:])
    return output


def run_module_emulated(module: str, *module_args: str, ranks: int = 1, timeout: float = 900, **env: str) -> str:
    """`python -m module args` on one process, or `phalanx run -n ranks -m module args`. Kernels
    use their torch references (the emulator's default; the kernels' dispatch on device tensors
    is tested in test_emulator.py and test_inference_emulated.py with PHALANX_EMULATE_TRITON=1)."""
    if ON_CUDA:
        import pytest
        import torch
        if torch.cuda.device_count() < ranks:
            pytest.skip(f"{ranks} ranks need {ranks} GPUs; this machine has {torch.cuda.device_count()}")
    if ranks == 1:
        return run_emulated([sys.executable, "-m", module, *module_args], timeout=timeout, **env)
    return run_emulated([sys.executable, "-m", "phalanx.cli", "run", "-n", str(ranks), "-m", module, *module_args],
                        timeout=timeout, **env)


def pytest_emulated(*node_ids: str, timeout: float = 1200, **env: str) -> str:
    """Run existing tests under the emulated GPU in a child pytest; fail if any of them fails."""
    return run_emulated([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *node_ids],
                        timeout=timeout, **env)
