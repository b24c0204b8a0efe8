"""`phalanx selfcheck`: the command to run first on a new GPU machine.

In at most a few minutes on one GPU (and on N with `phalanx run -n N -m phalanx.selfcheck`) it
checks what the CPU test suite cannot: the Triton kernels compiled against their torch references
(forward and backward, fp32 and bf16), the collectives on device tensors, each plugin for 10 steps
against one process, the inference engine's greedy output against Hugging Face `generate` with its
tokens/s beside `generate`'s, and each recipe's 2-step smoke run. It prints a table, writes the
results as JSON and exits non-zero on any failure. On a machine without a GPU it runs under the
emulated GPU (PHALANX_EMULATE_GPU=1) and says which checks need real CUDA.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

GROUPS = ("kernels", "collectives", "plugins", "inference", "recipes")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated groups to run (default: all of {', '.join(GROUPS)})")
    p.add_argument("--json", default="selfcheck.json", help="where to write the results (default: selfcheck.json)")
    p.add_argument("--output-dir", default="runs/selfcheck", help="scratch directory of the recipe smoke runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        print(f"phalanx selfcheck: unknown group(s) {unknown}; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    from phalanx import emulate
    from phalanx_kernels.accelerator import available

    if not available():  # no GPU: the same checks on the emulated GPU, said so in the report
        os.environ["PHALANX_EMULATE_GPU"] = "1"  # the recipe smoke runs (children) emulate too
        emulate.install()

    from phalanx.launch import launched
    from phalanx_kernels.accelerator import display

    from . import collectives, inference, kernels, plugins, recipes
    from .report import run_check, table, write_json

    with launched(seed=0) as ctx:
        suites = {"kernels": kernels.checks, "collectives": collectives.checks, "plugins": plugins.checks,
                  "inference": inference.checks, "recipes": lambda: recipes.checks(Path(args.output_dir))}
        results = []
        for group in groups:
            for name, fn in suites[group]():
                result = run_check(group, name, fn)
                results.append(result)
                if ctx.is_main:
                    print(f"[selfcheck] {group:<11} {name:<34} {result.status} {result.detail}", flush=True)
        failed = any(r.status == "FAIL" for r in results)
        if ctx.is_main:
            print()
            print(f"phalanx selfcheck on {display(ctx.device)}, {ctx.world_size} rank(s)")
            print(table(results))
            header = {"device": display(ctx.device), "world_size": ctx.world_size, "python": platform.python_version(),
                      "emulated": emulate.emulated()}
            write_json(results, Path(args.json), header)
            print(f"results written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
