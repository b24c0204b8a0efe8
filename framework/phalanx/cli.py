"""The `phalanx` command.

    phalanx run -n 4 train.py --config cfg.yaml        # torchrun with 4 processes on this node
    phalanx run -n 8 --nnodes 2 --rdzv-endpoint host:29500 -m apps.llama.pretrain --config …
    phalanx run -n 4 --max-restarts 3 train.py         # restart all ranks when one fails (docs/reliability.md)
    phalanx env                                        # versions, devices, backends, Triton
    phalanx serve MODEL_DIR [--port 8000]              # OpenAI-compatible server (phalanx.inference)
    phalanx plan --model DIR --world-size 8 --device-memory 80GiB   # which layout fits (docs/plan.md)
    phalanx selfcheck [--only kernels,plugins]         # run first on a new GPU machine (docs/selfcheck.md)
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import sys

from phalanx.torchrun import exec_run


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
    from phalanx_kernels.accelerator import EMULATED_TYPE, accelerator_type, device_module, display, emulated

    kind = accelerator_type()
    cuda = kind is not None
    report["cuda"] = torch.version.cuda if kind == "cuda" else ("emulated (PHALANX_EMULATE_GPU=1)" if emulated()
                                                                 else "not available")
    gpus = device_module(kind) if cuda else None
    report["gpus"] = ([f"{display(torch.device(kind, i))}: {gpus.get_device_name(i)}" for i in range(gpus.device_count())]
                      if cuda else [])
    report["backends"] = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available() and kind == "cuda",
                          "mpi": dist.is_mpi_available()}
    if emulated():
        report["backends"]["nccl (emulated by gloo)"] = True
    report["default_backend"] = {"cuda": "nccl", EMULATED_TYPE: "nccl (emulated by gloo)"}.get(kind, "gloo")
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
        "precision_auto": f"{resolve_precision('auto').name} on {'cuda' if cuda else 'cpu'}",
    }


def _triton_status(cuda: bool) -> str:
    try:
        importlib.import_module("triton")
    except ImportError:
        return "not installed (kernels use their torch references)"
    from phalanx_kernels.accelerator import emulated

    if emulated():
        return "Triton interpreter on the emulated GPU (dispatched as on CUDA, computed on the CPU)"
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
        return exec_run(rest)
    if command == "env":
        return env_command()
    if command == "serve":
        from phalanx.inference.serve import serve_main
        return serve_main(rest)
    if command == "plan":
        from phalanx.plan.cli import plan_main
        return plan_main(rest)
    if command == "selfcheck":
        from phalanx.selfcheck import main as selfcheck_main
        return selfcheck_main(rest)
    print(f"phalanx: unknown command {command!r}; use 'run', 'env', 'serve', 'plan' or 'selfcheck'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
