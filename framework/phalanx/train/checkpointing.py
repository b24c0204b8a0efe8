"""Checkpoint housekeeping for the loop: which checkpoint to resume, partial saves.

The writing itself is `phalanx.checkpoint.writer.CheckpointWriter` (atomic: a temporary
directory renamed into place, with a manifest; a failed save keeps the previous checkpoint). Here: rank 0 decides and every rank follows, so all ranks resume from
the same step even if the file system shows them different views for a moment.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from phalanx.checkpoint.train_state import CHECKPOINT_DIR, latest_checkpoint, list_checkpoints
from phalanx.json_collectives import broadcast_json
from phalanx.launch import barrier


def from_rank0(value):
    """Rank 0's `value` (JSON data: paths as text, numbers, lists) on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return broadcast_json(value, src=0)
    return value


def resume_checkpoint(output_dir: str | Path) -> Path | None:
    """The latest complete checkpoint under output_dir (rank 0's view, broadcast)."""
    found = latest_checkpoint(output_dir) if dist.get_rank() == 0 else None
    found = from_rank0(str(found) if found else None)
    return Path(found) if found else None


def existing_checkpoints(output_dir: str | Path) -> list[int]:
    steps = [step for step, _ in list_checkpoints(output_dir)] if dist.get_rank() == 0 else []
    return from_rank0(steps)


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
