"""The training script of the fault tests, started by `phalanx run -n 2 --max-restarts K`.

    fault_worker.py OUTPUT_ROOT FAULT [FAULT ...]

Every attempt first trains (or finds complete) the uninterrupted reference run `ref`, then each
FAULT's run in order. The i-th fault fires only in restart attempt i (TORCHELASTIC_RESTART_COUNT),
so attempt i dies in run i, attempt i+1 resumes it from its last complete checkpoint, finishes
it, and goes on to the next fault. When every run is complete, rank 0 writes OUTPUT_ROOT/result.json:
per run its metrics (loss per step, evals), whether its final weights are bit-identical to the
reference's, the step it resumed from and when the fault fired / training resumed.

Faults (each at step FAULT_STEP, after the checkpoint of step FAULT_STEP - 2):
  kill_step         rank 1 SIGKILLs itself inside the forward pass
  raise_step        rank 0 raises inside the forward pass
  kill_save         rank 0 SIGKILLs itself while writing checkpoint FAULT_STEP (synchronous save)
  kill_async_write  async_save; rank 1 SIGKILLs itself in the background writer of checkpoint FAULT_STEP
  kill_node         (two agents, --nnodes 2) every rank of the second agent SIGKILLs itself
  hang              hang_timeout_s=HANG_TIMEOUT; rank 1 sleeps inside the forward pass: the watchdogs
                    name it and stop, the agent restarts the group
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import train_helpers as th  # noqa: E402

MAX_STEPS, SAVE_EVERY, FAULT_STEP, HANG_TIMEOUT = 8, 2, 6, 3.0
RUN_OPTIONS = {"kill_async_write": {"async_save": True}, "hang": {"hang_timeout_s": HANG_TIMEOUT}}


def note(run_dir: Path, key: str, value=None) -> None:
    """Record when (or at which step) something first happened (one machine: one clock)."""
    path = run_dir / "events.json"
    events = json.loads(path.read_text()) if path.is_file() else {}
    events.setdefault(key, time.time() if value is None else value)
    path.write_text(json.dumps(events))


class FaultInjector:
    """A TrainHook that fires `fault` in the forward pass or the checkpoint writer of FAULT_STEP."""

    name = "fault_injector"

    def __init__(self, fault: str | None, run_dir: Path, model: torch.nn.Module):
        self.fault, self.run_dir, self.step = fault, run_dir, 0
        self.rank = int(os.environ.get("RANK", 0))
        # The decoder runs in every forward (the fused loss calls it directly, not the LM's forward).
        model.get_decoder().register_forward_pre_hook(self._before_forward)

    def bind(self, model):
        if self.fault in ("kill_save", "kill_async_write"):
            from phalanx.checkpoint.writer import CheckpointWriter

            real = CheckpointWriter._write_files
            injector = self

            def write_files(writer, snapshot):
                victim = 0 if injector.fault == "kill_save" else 1
                if snapshot.step == FAULT_STEP and injector.rank == victim:
                    (snapshot.tmp / f"half-written-rank{injector.rank}.bin").write_bytes(b"x" * 1000)
                    note(injector.run_dir, "fault")
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(writer, snapshot)

            CheckpointWriter._write_files = write_files

    def after_step(self, step):
        self.step = step

    def save(self, directory):
        pass

    def load(self, directory):
        if self.rank == 0:
            note(self.run_dir, "resumed")
            state = json.loads((Path(directory).parent / "train_state.json").read_text())
            note(self.run_dir, "resumed_step", state["step"])

    def _before_forward(self, module, args):
        if not module.training or self.step + 1 != FAULT_STEP or self.fault is None:
            return
        if self.fault == "kill_step" and self.rank == 1:
            note(self.run_dir, "fault")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "kill_node" and os.environ.get("GROUP_RANK") == "1":  # every rank of the 2nd agent
            note(self.run_dir, "fault")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "raise_step" and self.rank == 0:
            note(self.run_dir, "fault")
            raise RuntimeError("injected failure inside a training step")
        if self.fault == "hang" and self.rank == 1:
            note(self.run_dir, "fault")
            time.sleep(120)


def train_run(root: Path, name: str, fault: str | None):
    from phalanx.testing import tiny_llama
    from phalanx.train import causal_lm_eval, fit

    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    # DDP's fixed bucket layout (find_unused_parameters): a restarted process's first step then sums
    # gradients in the same order as the uninterrupted run, so 4-rank runs compare bit for bit too
    # (torch's default re-buckets after each process's first step: docs/reliability.md).
    # Under the emulated GPU DDP cannot fix its layout (its reducer then pins host memory in C++, which
    # a Python backend cannot give): 2-rank sums are exact in any bucket order, so those still compare
    # bit for bit (docs/testing.md).
    from phalanx_kernels.accelerator import emulated

    cfg = th.config(run_dir, max_steps=MAX_STEPS, save_every=SAVE_EVERY, keep_last=2, eval_every=4,
                    micro_batch_size=4, plugin_options={"find_unused_parameters": not emulated()},
                    **RUN_OPTIONS.get(name, {}))
    model = tiny_llama(seed=0)
    return fit(cfg, model, th.ArithmeticSequences(), hooks=[FaultInjector(fault, run_dir, model)],
               eval_fn=causal_lm_eval(th.ArithmeticSequences(n=10, seed=3), batch_size=5))


def final_weights(result) -> dict[str, torch.Tensor]:
    from phalanx.checkpoint import load_hf_state_dict

    return load_hf_state_dict(Path(result.checkpoint_dir) / "model")


def main(root: str, faults: list[str]) -> None:
    from phalanx.launch import launch, shutdown

    root_dir = Path(root)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    ctx = launch(seed=0, timeout_s=60)
    if ctx.rank == 0:
        (root_dir / "attempts.log").open("a").write(f"{attempt} {time.time()}\n")
    results = {"ref": train_run(root_dir, "ref", None)}
    for i, fault in enumerate(faults):
        results[fault] = train_run(root_dir, fault, fault if attempt == i else None)
    if ctx.is_main:
        ref_weights = final_weights(results["ref"])
        summary = {}
        for name, result in results.items():
            records = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
            weights = final_weights(result)
            events_path = root_dir / name / "events.json"
            summary[name] = {
                "losses": {r["step"]: r["loss"] for r in records if "loss" in r},
                "evals": {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r},
                "identical_weights": all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights),
                "max_weight_diff": max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights),
                "final_step": result.final_step,
                "events": json.loads(events_path.read_text()) if events_path.is_file() else {},
                "checkpoints": sorted(p.name for p in (root_dir / name / "checkpoints").iterdir()),
            }
        (root_dir / "result.json").write_text(json.dumps(summary, indent=1))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
