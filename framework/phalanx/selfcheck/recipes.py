"""Each recipe's 2-step smoke run, as a child process on this machine's device (run from a
checkout: the recipes live in apps/, which phalanx itself never imports)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .report import Skip

# name -> (module, arguments): the tiny config of each recipe cut to 2 steps.
SMOKES: dict[str, tuple[str, list[str]]] = {
    "protein": ("apps.protein.train", ["--config", "apps/protein/configs/tiny.yaml", "train.max_steps=2"]),
}


def _checkout() -> Path | None:
    for root in (Path.cwd(), *Path.cwd().parents):
        if (root / "apps").is_dir() and (root / "framework" / "phalanx").is_dir():
            return root
    return None


def _smoke(module: str, args: list[str], output_dir: str):
    root = _checkout()
    if root is None:
        raise Skip("run from a phalanx checkout (the recipes live in apps/)")
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", module, *args, f"train.output_dir={output_dir}"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise AssertionError(f"exit {proc.returncode}: {tail[0][:200]}")
    return f"python -m {module} {' '.join(args)}"


def checks(output_dir: Path):
    return [(name, lambda m=m, a=a, n=name: _smoke(m, a, str(output_dir / n))) for name, (m, a) in SMOKES.items()]
