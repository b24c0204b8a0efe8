"""The `phalanx` command.

    phalanx run -n 4 train.py --config cfg.yaml        # torchrun with 4 processes on this node
    phalanx run -n 8 --nnodes 2 --rdzv-endpoint host:29500 -m apps.llama.pretrain --config …
    phalanx env                                        # versions, devices, backends, Triton
    phalanx serve MODEL_DIR [--port 8000]              # OpenAI-compatible server (phalanx.inference)
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import platform
import sys

# torchrun flags passed through unchanged (multi-node rendezvous and restarts).
_PASSTHROUGH = ["--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--rdzv-conf",
                "--master-addr", "--master-port", "--max-restarts", "--monitor-interval", "--log-dir",
                "--redirects", "--tee", "--local-addr"]


def build_run_command(argv: list[str]) -> list[str]:
    """Translate `phalanx run` arguments into a `python -m torch.distributed.run` command line."""
    parser = argparse.ArgumentParser(prog="phalanx run", description="Start N processes per node with torchrun.")
    parser.add_argument("-n", "--nproc-per-node", default="1",
                        help="processes on this node (an int, or 'gpu'/'cpu'/'auto' as torchrun accepts)")
    for flag in _PASSTHROUGH:
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
    for flag in _PASSTHROUGH:
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


def run(argv: list[str]) -> int:
    cmd = build_run_command(argv)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # launch() then gives each rank its share of cores
    # Run from the current directory so `-m apps.…` works from a checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def _version(dist_name: str) -> str:
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return "not installed"


def environment_report() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    report: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "phalanx": _version("phalanx"),
    }
    for name in ("torch", "transformers", "datasets", "safetensors", "triton", "wandb", "diffusers"):
        report[name] = _version(name)
    report["cpu_cores"] = os.cpu_count()
    try:
        import psutil
        report["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    cuda = torch.cuda.is_available()
    report["cuda"] = torch.version.cuda if cuda else "not available"
    report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    report["backends"] = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available() and cuda,
                          "mpi": dist.is_mpi_available()}
    report["default_backend"] = "nccl" if cuda else "gloo"
    report.update(_precision_report(cuda))
    report["triton_kernels"] = _triton_status(cuda)
    return report


def _precision_report(cuda: bool) -> dict[str, object]:
    """What `precision=auto` picks here, and the measured CPU matmul rates behind the choice."""
    from phalanx.amp.precision import resolve_precision
    from phalanx_kernels.capability import cpu_bf16_support

    cpu = cpu_bf16_support()
    return {
        "cpu_capability": cpu.capability,
        "cpu_bf16": f"{'native' if cpu.native else 'emulated'} ({cpu.reason})",
        "cpu_matmul": (f"fp32 {cpu.fp32_gflops:.1f} GFLOP/s, bf16 {cpu.bf16_gflops:.1f} GFLOP/s per core "
                       f"(256x256; bf16 {cpu.bf16_slowdown:.2f}x the time of fp32)"),
        "precision_auto": f"{resolve_precision('auto')} on {'cuda' if cuda else 'cpu'}",
    }


def _triton_status(cuda: bool) -> str:
    try:
        importlib.import_module("triton")
    except ImportError:
        return "not installed (kernels use their torch references)"
    if cuda:
        return "compiled kernels on CUDA"
    return "no GPU driver: kernels use torch references (Triton runs only under TRITON_INTERPRET=1, for tests)"


def env_command() -> int:
    for key, value in environment_report().items():
        print(f"{key:>16}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return run(rest)
    if command == "env":
        return env_command()
    if command == "serve":
        from phalanx.inference.serve import serve_main
        return serve_main(rest)
    print(f"phalanx: unknown command {command!r}; use 'run', 'env' or 'serve'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
