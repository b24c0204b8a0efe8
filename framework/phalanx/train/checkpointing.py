"""Checkpoint housekeeping for the loop: which checkpoint to resume, pruning, partial saves.

The writing itself is `Booster.save_checkpoint` (atomic: a temporary directory renamed into
place, with a manifest). Here: rank 0 decides and every rank follows, so all ranks resume from
the same step even if the file system shows them different views for a moment.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from phalanx.checkpoint.train_state import CHECKPOINT_DIR, latest_checkpoint, list_checkpoints
from phalanx.launch import barrier


def _from_rank0(value):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def resume_checkpoint(output_dir: str | Path) -> Path | None:
    """The latest complete checkpoint under output_dir (rank 0's view, broadcast)."""
    found = latest_checkpoint(output_dir) if dist.get_rank() == 0 else None
    found = _from_rank0(str(found) if found else None)
    return Path(found) if found else None


def existing_checkpoints(output_dir: str | Path) -> list[int]:
    steps = [step for step, _ in list_checkpoints(output_dir)] if dist.get_rank() == 0 else []
    return _from_rank0(steps)


def remove_partial_saves(output_dir: str | Path) -> list[Path]:
    """Delete `step-*.tmp-*` directories left by a save that was killed (never loadable).
    `step-*.old-*` directories are kept: one may be the only copy of a checkpoint whose
    replacement was interrupted."""
    removed = []
    if dist.get_rank() == 0:
        root = Path(output_dir) / CHECKPOINT_DIR
        if root.is_dir():
            for path in sorted(root.glob("step-*.tmp-*")):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    barrier()
    return removed


def prune_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` complete checkpoints (0 keeps all). Called only after a new
    checkpoint is complete, so there is always at least one loadable checkpoint on disk."""
    removed = []
    if keep_last > 0 and dist.get_rank() == 0:
        found = list_checkpoints(output_dir)
        for _, path in found[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    barrier()
    return removed


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    """Hide transformers' "Writing model shards" bar while a checkpoint is saved (it would print
    one bar per checkpoint into the training log), restoring the user's setting afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
