"""Each recipe's 2-step smoke run, as a child process on this machine's device (run from a
checkout: the recipes live in apps/, which phalanx itself never imports)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .report import Skip

# name -> (module, arguments) of its 2-step smoke run; {out} is the run's scratch directory. Each
# recipe's tiny config on the data it ships (llama's pretrain prepares its tokenizer, model and rows
# itself); apps/chat_rlhf needs a policy model directory (see its README) and is left to its tests.
_STEPS = ["train.max_steps=2", "train.save_every=0", "train.progress_bar=false"]
SMOKES: dict[str, tuple[str, list[str]]] = {
    "llama": ("apps.llama.pretrain", ["--config", "apps/llama/configs/tiny.yaml", "work_dir={out}", *_STEPS]),
    "protein": ("apps.protein.train", ["--config", "apps/protein/configs/tiny.yaml", "train.output_dir={out}", *_STEPS]),
    "video_gen": ("apps.video_gen.train", ["--config", "apps/video_gen/configs/tiny.yaml", "train.output_dir={out}",
                                           *_STEPS]),
    "diffusion": ("apps.diffusion.train_text_to_image", ["--config", "apps/diffusion/configs/tiny_emoji.yaml",
                                                         "train.output_dir={out}", "validation.num_inference_steps=2",
                                                         *_STEPS]),
}

# the pyproject extra that installs each recipe's own dependencies
EXTRAS = {"llama": "llama", "protein": "protein", "video_gen": "video", "diffusion": "diffusion"}


def _checkout() -> Path | None:
    for root in (Path.cwd(), *Path.cwd().parents):
        if (root / "apps").is_dir() and (root / "framework" / "phalanx").is_dir():
            return root
    return None


def _smoke(module: str, args: list[str], output_dir: str):
    root = _checkout()
    if root is None:
        raise Skip("run from a phalanx checkout (the recipes live in apps/)")
    args = [a.replace("{out}", output_dir) for a in args]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's path
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", tail[0])
        if missing and missing.group(1).split(".")[0] not in ("phalanx", "phalanx_kernels", "apps"):
            raise Skip(f"python -m {module} needs {missing.group(1)!r}, not installed here "
                       f"(pip install -e '.[{EXTRAS.get(module.split('.')[1], 'dev')}]')")
        raise AssertionError(f"python -m {module} exited {proc.returncode}: {tail[0][:200]}")
    return f"python -m {module} {' '.join(args)}"


def checks(output_dir: Path):
    return [(name, lambda m=m, a=a, n=name: _smoke(m, a, str(output_dir / n))) for name, (m, a) in SMOKES.items()]
