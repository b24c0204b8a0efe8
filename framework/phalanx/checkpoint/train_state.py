"""Everything besides weights and optimizer state needed to continue a run exactly.

`TrainState` (step, epoch, sampler position, scheduler, user extras) is JSON. RNG states are
saved per rank (`rng/rank00000.json`): python's, numpy's, torch's CPU generator and every CUDA
generator, so dropout and shuffling continue identically after a restart. The fp16 loss scaler
belongs to the optimizer and is saved with its state (`optimizer/index.json`); a `loss_scaler`
entry of older checkpoints is ignored.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx_kernels.accelerator import available as accelerator_available
from phalanx_kernels.accelerator import device_module

from phalanx.checkpoint.atomic import MANIFEST, CheckpointError

STATE_FILE = "train_state.json"
CHECKPOINT_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)
    lr_scheduler: dict[str, Any] = field(default_factory=dict)
    tokens_seen: int = 0
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | Path) -> None:
        (Path(directory) / STATE_FILE).write_text(json.dumps(asdict(self), default=_to_json))

    @classmethod
    def load(cls, directory: str | Path) -> "TrainState":
        path = Path(directory) / STATE_FILE
        if not path.is_file():
            raise CheckpointError(f"{str(directory)!r} has no {STATE_FILE}: not a training checkpoint")
        data = json.loads(path.read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def scheduler_state(lr_scheduler: Any) -> dict:
    """The LR scheduler's state as `TrainState.lr_scheduler` keeps it (JSON-ready)."""
    state = lr_scheduler.state_dict()
    # LambdaLR keeps callables in its state: they are rebuilt from code, not saved.
    return {k: v for k, v in state.items() if k != "lr_lambdas" or all(x is None for x in v)}


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"cannot save {type(value).__name__} in the training state")


def save_rng_state(directory: str | Path, rank: int) -> None:
    write_rng_state(directory, rank, rng_state())


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, every CUDA device), JSON-ready."""
    np_state = np.random.get_state()
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in device_module().get_rng_state_all()] if accelerator_available() else [],
    }


def write_rng_state(directory: str | Path, rank: int, state: dict[str, Any]) -> None:
    rng_dir = Path(directory) / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    (rng_dir / f"rank{rank:05d}.json").write_text(json.dumps(state))


def load_rng_state(directory: str | Path, rank: int) -> bool:
    """Restore this rank's RNG states; returns False when the checkpoint has none for this rank
    (e.g. it was saved with fewer ranks), in which case the RNGs are left as they are."""
    path = Path(directory) / "rng" / f"rank{rank:05d}.json"
    if not path.is_file():
        return False
    state = json.loads(path.read_text())
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), npy[2], npy[3], npy[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and accelerator_available():
        device_module().set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    return True


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR / f"step-{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with a manifest) under output_dir/checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINT_DIR
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / MANIFEST).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None
