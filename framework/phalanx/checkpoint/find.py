"""Finding the Hugging Face model directory a path names: a model directory itself, a training
checkpoint (the PPO policy export `policy/` first, else `model/`), or a training output_dir (its
latest complete checkpoint). One lookup for `phalanx serve` and the recipes."""
from __future__ import annotations

import os
from pathlib import Path

from phalanx.checkpoint.train_state import latest_checkpoint

CHECKPOINT_MODEL_DIRS = ("policy", "model")  # inside a checkpoint: the PPO policy export first, else the model


def model_dir(path: str | os.PathLike) -> Path:
    """The Hugging Face model directory (one with config.json) that `path` names: `path` itself;
    inside a checkpoint, `policy/` then `model/`; inside a training output_dir, those of its latest
    complete checkpoint. FileNotFoundError naming every place looked at otherwise."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{str(p)!r} is not a directory: give a Hugging Face model directory (with "
                                "config.json), a training checkpoint or a training output_dir")
    if (p / "config.json").is_file():
        return p
    looked = [p / "config.json"]
    for inner in CHECKPOINT_MODEL_DIRS:
        looked.append(p / inner / "config.json")
        if looked[-1].is_file():
            return p / inner
    ckpt = latest_checkpoint(p)
    if ckpt is not None:
        for inner in CHECKPOINT_MODEL_DIRS:
            looked.append(Path(ckpt) / inner / "config.json")
            if looked[-1].is_file():
                return Path(ckpt) / inner
    else:
        looked.append(p / "checkpoints" / "step-*  (a complete checkpoint)")
    raise FileNotFoundError(f"no model in {str(p)!r}: looked for " + ", ".join(str(x) for x in looked)
                            + ". Give a Hugging Face model directory, a checkpoint with policy/ or model/, or "
                            "a training output_dir with a complete checkpoint (train first, or fix the path)")
