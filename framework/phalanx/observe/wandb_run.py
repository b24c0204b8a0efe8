"""Optional Weights & Biases logging, offline by default.

wandb is imported only when a run is created (never at import time), and runs in "offline" mode
unless the config asks for "online": nothing leaves the machine by default, and the run lands in
`<output_dir>/wandb/offline-run-*`, to be uploaded later with `wandb sync` if wanted. A resumed
training run passes the saved run id, so its points continue the same wandb run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

MODES = ("offline", "online", "disabled")


class WandbRun:
    def __init__(self, *, project: str, directory: str | Path, config: dict[str, Any] | None = None,
                 mode: str = "offline", run_id: str | None = None, name: str | None = None):
        if mode not in MODES:
            raise ValueError(f"wandb mode {mode!r} is not one of {', '.join(MODES)}")
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("wandb=true needs the wandb package: `pip install wandb`, or set wandb=false") from exc
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True)
        self.run = wandb.init(project=project, dir=str(directory), config=config or {}, mode=mode, id=run_id,
                              name=name, resume="allow" if run_id else None, settings=settings,
                              reinit="finish_previous")
        self.id: str = self.run.id
        self.dir = Path(self.run.dir).parent if getattr(self.run, "dir", None) else directory

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if clean:
            self.run.log(clean, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
