"""Starting `phalanx run` jobs for the fault tests: their own process group, bounded in time,
killed with everything they started when the test ends (pass or fail)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "fault_worker.py"
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
       "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1"}


def start_run(run_args: list[str], log: Path) -> subprocess.Popen:
    """`phalanx run RUN_ARGS` in a new session (so the whole tree can be killed), output to `log`."""
    return subprocess.Popen([sys.executable, "-m", "phalanx.cli", "run", *run_args], cwd=str(HERE),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ENV})


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)


def run_faults(root: Path, faults: list[str], *, timeout: float, nproc: int = 2, extra: list[str] = ()
               ) -> tuple[int, str, dict, float]:
    """One job training the reference and one run per fault (see fault_worker.py); returns
    (exit status, log text, result.json, wall seconds)."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / "job.log"
    start = time.time()
    proc = start_run(["-n", str(nproc), "--max-restarts", str(max(1, len(faults))), *extra, str(WORKER), str(root),
                      *faults], log)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = -1
    finally:
        kill_tree(proc)
    result_path = root / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return rc, log.read_text(errors="replace"), result, time.time() - start


def assert_same_as_reference(result: dict, name: str) -> None:
    """Bit for bit in fp32 on gloo: the loss of every step, every evaluation, and the weights."""
    ref, run = result["ref"], result[name]
    assert run["identical_weights"], f"{name}: final weights differ from the uninterrupted run by " \
                                     f"{run['max_weight_diff']}"
    assert run["losses"] == ref["losses"], f"{name}: losses {run['losses']} != {ref['losses']}"
    assert run["evals"] == ref["evals"], f"{name}: evals {run['evals']} != {ref['evals']}"
    assert run["final_step"] == ref["final_step"]
