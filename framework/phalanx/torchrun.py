"""Starting N processes with torchrun: what `phalanx run` does, and what `phalanx serve --tp-size N`
uses to restart itself on N ranks.

A module of its own so the dependency points one way: `phalanx.cli` and `phalanx.inference.serve`
both import it, and neither imports the other's caller (serve used to reach back into the cli).
"""
from __future__ import annotations

import os
import sys

# torchrun flags passed through unchanged (multi-node rendezvous and restarts).
PASSTHROUGH = ["--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--rdzv-conf",
               "--master-addr", "--master-port", "--max-restarts", "--monitor-interval", "--log-dir",
               "--redirects", "--tee", "--local-addr"]


def build_run_command(argv: list[str]) -> list[str]:
    """Translate `phalanx run` arguments into a `python -m torch.distributed.run` command line."""
    import argparse

    parser = argparse.ArgumentParser(prog="phalanx run", description="Start N processes per node with torchrun.")
    parser.add_argument("-n", "--nproc-per-node", default="1",
                        help="processes on this node (an int, or 'gpu'/'cpu'/'auto' as torchrun accepts)")
    for flag in PASSTHROUGH:
        parser.add_argument(flag, default=None)
    parser.add_argument("--standalone", action="store_true", help="single-node rendezvous on a free port")
    parser.add_argument("-m", "--module", default=None, help="run a module (like python -m)")
    # Everything after the script (or after `-m MODULE`) belongs to the program, not to us.
    ours, target = _split_at_program(argv)
    args = parser.parse_args(ours)
    args.target = target
    if args.module is None and not args.target:
        parser.error("name a script to run, or a module with -m")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}"]
    multi_node = args.nnodes not in (None, "1")
    if args.standalone or (not multi_node and args.rdzv_endpoint is None and args.master_addr is None):
        cmd.append("--standalone")
    for flag in PASSTHROUGH:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            cmd.append(f"{flag}={value}")
    if args.module is not None:
        cmd += ["-m", args.module]
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    return cmd + target


def _split_at_program(argv: list[str]) -> tuple[list[str], list[str]]:
    ours: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return ours, argv[i + 1:]
        if arg in ("-m", "--module"):
            return ours + argv[i:i + 2], argv[i + 2:]
        if arg.startswith("--module="):
            return ours + [arg], argv[i + 1:]
        if not arg.startswith("-"):
            return ours, argv[i:]
        ours.append(arg)
        takes_value = "=" not in arg and arg not in ("--standalone", "-h", "--help")
        if takes_value and i + 1 < len(argv):
            ours.append(argv[i + 1])
            i += 1
        i += 1
    return ours, []


def run_environment() -> dict[str, str]:
    """The environment the ranks start in: one OpenMP thread until `launch()` gives each rank its
    share of the cores, the current directory importable so `-m apps.…` works from a checkout, and
    a fresh rendezvous store for every restart so `--max-restarts` recovers."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # A fresh rendezvous store per restart (see phalanx.launch.elastic_attempt_store for why the
    # shared one breaks elastic restarts with gloo).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)
    return env


def exec_run(argv: list[str]) -> int:
    """Replace this process with torchrun (`phalanx run`)."""
    cmd = build_run_command(argv)
    os.execvpe(cmd[0], cmd, run_environment())
    return 0  # not reached


def run_here(argv: list[str]) -> int:
    """Run torchrun's agent in this process and return its exit status. A SIGINT/SIGTERM is passed
    on to the ranks by the agent, which waits for them to exit; here that ends with status
    128 + signal instead of the agent's traceback (a server stopped with Ctrl-C did not fail)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    cmd = build_run_command(argv)
    os.environ.update(run_environment())
    try:
        torchrun_main(cmd[3:])
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0
