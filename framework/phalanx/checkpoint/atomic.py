"""Atomic, verifiable checkpoint directories.

`atomic_directory(path)` yields a temporary directory next to `path` that every rank writes
into; on success rank 0 writes `manifest.json` (file sizes and SHA-256), then renames the
temporary directory to `path` (moving an older `path` aside first and deleting it only after the
new one is in place). An interrupted save leaves only a `*.tmp-*` directory and the previous
checkpoint untouched.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from phalanx.json_collectives import broadcast_json
from phalanx.launch import barrier

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt, or does not fit the model."""


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, extra: dict | None = None) -> dict:
    directory = Path(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(directory).as_posix()
            files[rel] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"format": "phalanx-checkpoint/1", "created": time.time(), "files": files, **(extra or {})}
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST)
    return manifest


def verify_manifest(directory: str | Path, check_hashes: bool = True) -> dict:
    """Raise CheckpointError unless `directory` holds a complete, uncorrupted checkpoint."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {str(directory)!r} does not exist")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(directory)!r} has no {MANIFEST}: it is partial (a save was interrupted) or was not "
            "written by phalanx; use an earlier checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
    for rel, meta in manifest.get("files", {}).items():
        f = directory / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(directory)!r} is missing {rel}; it is partial or was modified")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint file {f} has {f.stat().st_size} bytes, the manifest says "
                                  f"{meta['bytes']}: it is truncated or corrupt")
        if check_hashes and _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} does not match its SHA-256 in the manifest: it is corrupt")
    return manifest


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextlib.contextmanager
def atomic_directory(path: str | Path, manifest_extra: dict | None = None) -> Iterator[Path]:
    """All ranks write into the yielded temporary directory; it becomes `path` atomically."""
    path = Path(path)
    token = uuid.uuid4().hex[:8]
    if dist.is_initialized() and dist.get_world_size() > 1:
        token = broadcast_json(token, src=0)  # rank 0's; JSON, not a pickled object
    tmp = path.parent / f"{path.name}.tmp-{token}"
    if _is_main():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=False)
    barrier()
    try:
        yield tmp
    except BaseException:
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if _is_main():
        commit_directory(tmp, path, manifest_extra)
    barrier()


def commit_directory(tmp: Path, path: Path, manifest_extra: dict | None = None) -> None:
    """Rank 0, once every rank's files are in `tmp`: write the manifest, then rename `tmp` to
    `path` (an older `path` is moved aside first and deleted only after the new one is in place)."""
    write_manifest(tmp, manifest_extra)
    old = None
    if path.exists():
        old = path.parent / f"{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
        path.replace(old)
    tmp.replace(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
