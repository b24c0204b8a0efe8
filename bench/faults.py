"""Kill-and-recover, N times: does a recovered run end as the uninterrupted run ends, and does the
job say it succeeded?

    python bench/faults.py --repeat 20                # 2 ranks, one agent
    python bench/faults.py --repeat 20 --agents 2     # 2 agents x 2 ranks (c10d rendezvous on 127.0.0.1)

Each repetition is one `phalanx run --max-restarts 1` job training a tiny Llama with `fit` (DDP,
fp32, gloo) for --steps steps with a checkpoint every --save-every; in the first attempt the last
rank (--agents 1) or every rank of the second agent (--agents 2) SIGKILLs itself in the forward pass
of step --kill-step. The agent restarts the group, `fit` resumes from the last complete checkpoint
and finishes. Printed per run: the job's exit code(s) (what a scheduler reads), the wall time, the
recovery time (from the kill to the first resumed forward), and the largest difference of the final
weights from the uninterrupted run's (0.0 = bit for bit). The ratio line compares the recovered
runs' median wall time with the uninterrupted job's (the peer: the same job with no fault).

`--rebucket` runs DDP as torch defaults it (re-bucketing after each process's first step): with
3 or more ranks the restarted run's first step then sums gradients in another order, so the final
weights are compared within `--tolerance` (default 1e-6 there) instead of bit for bit.

Not in the suite at these sizes (minutes); tests/bench/test_bench_smoke.py runs one small cycle and
tests/framework/test_fault_elastic.py asserts the exit codes and the re-bucketing bound.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
       "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1"}


# -- the training script each job runs (every rank) ------------------------------------------------
class _Sequences:
    """start, start+d, start+2d, ... (mod vocab): a tiny model learns it in a few steps."""

    def __init__(self, n: int, seq: int = 16, vocab: int = 128, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Killer:
    """A TrainHook that SIGKILLs the victims in the forward of `kill_step` (first attempt only),
    and notes when that happened and when training resumed."""

    name = "bench_faults"

    def __init__(self, model, run_dir: Path, kill_step: int | None, victim: bool):
        self.run_dir, self.kill_step, self.victim, self.step, self.resumed = run_dir, kill_step, victim, 0, False
        model.get_decoder().register_forward_pre_hook(self._before_forward)

    def bind(self, model) -> None: ...
    def save(self, directory) -> None: ...

    def load(self, directory) -> None:
        self.resumed = True

    def after_step(self, step: int) -> None:
        self.step = step

    def _before_forward(self, module, args) -> None:
        if not module.training:
            return
        if self.resumed and not (self.run_dir / "resumed").exists():
            (self.run_dir / "resumed").write_text(str(time.time()))
        if self.kill_step is not None and self.step + 1 == self.kill_step and self.victim:
            (self.run_dir / "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def worker(run_dir: Path, steps: int, save_every: int, kill_step: int | None, options: dict) -> None:
    import torch

    from phalanx.launch import launched
    from phalanx.testing import tiny_llama
    from phalanx.train import TrainConfig, fit

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    with launched(seed=0, timeout_s=60) as ctx:
        victim = (os.environ.get("GROUP_RANK") == "1" if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1
                  else ctx.rank == ctx.world_size - 1)
        cfg = TrainConfig(output_dir=str(run_dir / "out"), max_steps=steps, save_every=save_every, keep_last=2,
                          micro_batch_size=4, lr=1e-2, warmup_steps=2, precision="fp32", resume=True, seed=7, log_every=1,
                          progress_bar=False, plot=False, peak_tflops=0, **options)
        model = tiny_llama(seed=0)
        fit(cfg, model, _Sequences(64), hooks=[_Killer(model, run_dir, kill_step if attempt == 0 else None, victim)])
        if ctx.rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / "weights.pt")


# -- the driver -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(run_dir: Path, args, kill: bool) -> tuple[list[int], float]:
    """One job (one or two agents); returns (each agent's exit code, wall seconds)."""
    run_dir.mkdir(parents=True)
    script = [str(Path(__file__).resolve()), "--worker", str(run_dir), "--steps", str(args.steps),
              "--save-every", str(args.save_every), "--options", json.dumps(_options(args))] + (["--kill-step", str(args.kill_step)] if kill else [])
    common = ["-n", str(args.ranks), "--max-restarts", "1"]
    if args.agents > 1:
        common += ["--nnodes", str(args.agents), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{_free_port()}", "--rdzv-id", run_dir.name]
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-m", "phalanx.cli", "run", *common, *script],
                              stdout=(run_dir / f"agent{i}.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True, env={**os.environ, **ENV}) for i in range(args.agents)]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, args.timeout - (time.time() - start))))
        except subprocess.TimeoutExpired:
            codes.append(None)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return codes, time.time() - start


def _options(args) -> dict:
    """The TrainConfig settings the flags ask for (a production run's: async saves, the watchdog)."""
    # DDP with its first bucket layout kept (find_unused_parameters): a restarted process's first
    # step then sums gradients in the uninterrupted run's order, so 4 ranks compare bit for bit
    # (docs/reliability.md).
    plugin_options = {"find_unused_parameters": not args.rebucket} if args.plugin == "ddp" else {}
    return {"plugin": args.plugin, "plugin_options": plugin_options, "async_save": args.async_save,
            "hang_timeout_s": args.hang_timeout}


def max_weight_diff(a: Path, b: Path) -> float:
    import torch

    if not (a.is_file() and b.is_file()):
        return float("nan")
    wa, wb = torch.load(a), torch.load(b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--agents", type=int, default=1, choices=(1, 2))
    ap.add_argument("--ranks", type=int, default=2, help="ranks per agent")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=5)
    ap.add_argument("--plugin", default="ddp", help="fit's plugin (ddp, zero1, zero2, fsdp, ...)")
    ap.add_argument("--rebucket", action="store_true",
                    help="DDP as torch defaults it: re-bucket after each process's first step (a restarted "
                         "run's first step then sums in another order: with 3+ ranks not bit for bit)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest final-weight difference accepted (default 0, or 1e-6 with --rebucket)")
    ap.add_argument("--async-save", action="store_true", help="fit's async_save (a background writer thread)")
    ap.add_argument("--hang-timeout", type=float, default=0.0, help="fit's hang_timeout_s (the watchdog thread)")
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    ap.add_argument("--keep", help="keep the runs' directories here (default: a temporary directory)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.steps, args.save_every, args.kill_step if "--kill-step" in sys.argv
                      else None, json.loads(args.options))
    root = Path(args.keep or tempfile.mkdtemp(prefix="phalanx-faults-"))
    print(f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores), load average "
          f"{os.getloadavg()[0]:.2f}, {args.agents} agent(s) x {args.ranks} ranks, {args.steps} steps, checkpoint "
          f"every {args.save_every}, kill at step {args.kill_step}, options {_options(args)}", flush=True)
    ref_codes, ref_wall = run_job(root / "ref", args, kill=False)
    print(f"uninterrupted: exit {ref_codes}, {ref_wall:.1f} s", flush=True)
    rows = []
    for i in range(args.repeat):
        run_dir = root / f"run{i:02d}"
        codes, wall = run_job(run_dir, args, kill=True)
        killed, resumed = run_dir / "killed", run_dir / "resumed"
        recovery = (float(resumed.read_text()) - float(killed.read_text())
                    if killed.is_file() and resumed.is_file() else float("nan"))
        diff = max_weight_diff(run_dir / "weights.pt", root / "ref" / "weights.pt")
        rows.append((codes, wall, recovery, diff))
        print(f"run {i + 1:2d}: exit {codes}, {wall:.1f} s, recovery {recovery:.1f} s, max weight diff {diff:.3g}",
              flush=True)
    clean = sum(all(c == 0 for c in codes) for codes, *_ in rows)
    tolerance = args.tolerance if args.tolerance is not None else (1e-6 if args.rebucket else 0.0)
    exact = sum(diff <= tolerance for *_, diff in rows)
    walls = [wall for _, wall, _, _ in rows]
    recoveries = [r for _, _, r, _ in rows if r == r]
    same = "bit-identical to" if tolerance == 0 else f"within {tolerance:g} of"
    print(f"summary: {clean}/{len(rows)} jobs exited 0, {exact}/{len(rows)} with final weights {same} "
          f"the uninterrupted run; recovery median {statistics.median(recoveries) if recoveries else float('nan'):.1f} s; "
          f"load average now {os.getloadavg()[0]:.2f}")
    print(f"ratio: recovered job wall time / uninterrupted job = {statistics.median(walls) / ref_wall:.2f}x")
    print("BENCH_JSON " + json.dumps({
        "bench": "faults", "agents": args.agents, "ranks_per_agent": args.ranks, "plugin": args.plugin,
        "runs": len(rows), "exit_0": clean, "within_tolerance": exact, "tolerance": tolerance, "exit_codes": [codes for codes, *_ in rows],
        "max_weight_diff": max((d for *_, d in rows), default=None), "recovery_s": recoveries,
        "wall_ratio": statistics.median(walls) / ref_wall, "loadavg": os.getloadavg()[0]}))
    sys.exit(0 if clean == len(rows) == exact and all(c == 0 for c in ref_codes) else 1)


if __name__ == "__main__":
    main()
