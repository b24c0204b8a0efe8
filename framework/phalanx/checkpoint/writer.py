"""Training checkpoints that survive a full disk, a killed rank, and can be written in the background.

A save has two halves:

1. **snapshot** (every rank, on the training thread, with collectives): gather the full model
   state, this rank's optimizer fragments and the fragment index, the RNG states and the training
   state into host memory (copies when the write is asynchronous, so training may change the live
   tensors), and let hooks (EMA) write their part. A synchronous save streams the model instead:
   the plugin gathers one tensor at a time and rank 0 writes the safetensors files as they fill
   (`phalanx.checkpoint.hf`), so no rank ever holds the whole model. An asynchronous one keeps a
   copy until its background write, spread over the ranks where every rank receives the gathered
   tensors (DDP, ZeRO, FSDP, Gemini: `Plugin.full_state_on_every_rank`; `hf.spread_model_copy`)
   or that moves each tensor to the rank keeping it (HybridParallelPlugin:
   `Plugin.spreads_model_copy`): each rank keeps about 1/N of the model and writes it as one file
   of the sharded export; only models transformers renames on save are kept whole on rank 0.
   The small metadata that crosses ranks (the temporary directory's name, the optimizer index)
   is JSON in uint8 tensors (`phalanx.json_collectives`), never a pickled object;
2. **write and commit** (no collectives): each rank writes its files into the temporary directory
   and reports "ok" or its error through the process group's key-value store; rank 0 waits for
   every report, then writes the manifest and renames the directory into place (or deletes it if
   any rank failed), prunes old checkpoints, and publishes the outcome, which every rank reads.

With `async_write=True` the second half runs in a background thread while training continues; the
next save (and the end of training) first waits for it. A crash at any moment leaves either the
new complete checkpoint or only a `*.tmp-*` directory beside the previous complete one.

A failed write (disk full, a file-size limit, a read-only or vanished directory) never leaves a
half checkpoint and never deletes the last good one: the outcome names the error and the
checkpoint that is still intact, and the caller decides whether to stop (`on_error="stop"`) or to
warn and train on (`"warn"`).
"""
from __future__ import annotations

import copy as _copy
import json
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from phalanx.checkpoint.atomic import CheckpointError, commit_directory
from phalanx.checkpoint.hf import (SpreadModelCopy, quiet_hf_progress, save_hf_model, spread_model_copy, spreads,
                                   write_spread_model)
from phalanx.checkpoint.optimizer import INDEX as OPTIM_INDEX
from phalanx.checkpoint.optimizer import OptimizerFragments, fragment_index, fragment_tensors
from phalanx.checkpoint.train_state import TrainState, list_checkpoints, rng_state, scheduler_state, write_rng_state
from phalanx.json_collectives import broadcast_json
from phalanx.malloc import give_back_freed_memory
from phalanx.observe import get_logger

MODEL_DIR, OPTIM_DIR = "model", "optimizer"  # the layout Booster.load_checkpoint reads


class SavesModels(Protocol):
    """What the writer asks of the booster (`phalanx.booster.Booster`, a floor above: reached
    through these public members only, never imported)."""

    plugin: Any  # its `full_state_on_every_rank`, `spreads_model_copy` and gathers

    def optimizer_fragments(self, optimizer: Any) -> OptimizerFragments: ...

    def stream_model(self, model: Any, directory: Path, *, writer: bool, **kwargs: Any) -> None: ...

    def unwrap(self, model: Any) -> Any: ...


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written; the previous complete checkpoint is untouched."""


@dataclass
class SaveOutcome:
    step: int
    path: Path
    ok: bool
    error: str = ""              # the first rank's error when not ok
    write_s: float = 0.0         # time spent writing and committing (hidden when asynchronous)
    pruned: list[str] = field(default_factory=list)


@dataclass
class _Snapshot:
    step: int
    path: Path
    tmp: Path
    token: str
    model: Any = None            # rank 0: the unwrapped model (its config is saved with the weights)
    model_state: dict[str, torch.Tensor] | None = None  # rank 0, asynchronous saves that cannot spread
    model_spread: SpreadModelCopy | None = None          # every rank, other asynchronous saves
    model_written: bool = False  # synchronous saves: the model was streamed into tmp already
    tokenizer: Any = None
    optim_file: str = ""
    optim_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    optim_index: dict[str, Any] | None = None           # rank 0
    rng: dict[str, Any] = field(default_factory=dict)
    train_state: TrainState | None = None               # rank 0
    error: str = ""              # a failure already met while snapshotting (e.g. a hook's write)
    hook_files: Callable[[], None] | None = None  # what the hooks left to write (no collectives)


def _store() -> dist.Store:
    # The process group's own key-value store (a TCPStore under torchrun, a HashStore for one
    # rank): it works from a background thread and does not depend on the collectives.
    return dist.distributed_c10d._get_default_store()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class CheckpointWriter:
    """Writes `fit`'s checkpoints; see the module docstring. One per training run."""

    def __init__(self, booster: SavesModels, output_dir: str | Path, *, keep_last: int = 0, async_write: bool = False,
                 on_error: str = "warn", last_good: Path | None = None, timeout_s: float = 600.0):
        if on_error not in ("warn", "stop"):
            raise ValueError(f"on_error={on_error!r}: choose 'warn' or 'stop'")
        self.booster = booster
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.async_write = async_write
        self.on_error = on_error
        self.last_good = last_good          # the newest complete checkpoint this run knows of
        self.outcomes: list[SaveOutcome] = []  # every finished save, in order
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None
        self.log = get_logger("phalanx.checkpoint")

    # ------------------------------------------------------------------ the training thread
    def save(self, path: str | Path, step: int, model: Any, optimizer: Any, lr_scheduler: Any,
             train_state: TrainState, *, tokenizer: Any = None,
             hooks_writer: Callable[[Path], Callable[[], None] | None] | None = None
             ) -> SaveOutcome | None:
        """Snapshot now and write (in the background when async). Collective: every rank calls.
        Returns the outcome when the write was synchronous, else None (see `wait`).

        hooks_writer(tmp) runs on every rank while snapshotting (it may gather); it may return a
        callable that writes its files later, with this rank's other files (in the background
        when async), so a hook's disk time is hidden like the model's."""
        self.wait()
        if not self.async_write:
            # The steps' kept blocks go back before a synchronous save's own peak. An async save
            # copies the state into host memory right away: the kept blocks are what it reuses
            # (trimming first made it fault every page in again: 22 vs 15 ms a save, docs/reliability.md).
            give_back_freed_memory()
        snap = self._snapshot(Path(path), step, model, optimizer, lr_scheduler, train_state, tokenizer, hooks_writer)
        if self.async_write:
            self._thread = threading.Thread(target=self._write_and_commit, args=(snap,),
                                            name=f"phalanx-checkpoint-{step}", daemon=True)
            self._thread.start()
            return None
        self._write_and_commit(snap)
        return self._finish()

    def wait(self) -> SaveOutcome | None:
        """Wait for the save in flight (if any); returns its outcome, raising CheckpointSaveError
        when it failed and on_error='stop'."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        return self._finish()

    def close(self, timeout_s: float = 60.0) -> None:
        """After an error in training: give a save in flight a bounded time to finish, never raise."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _finish(self) -> SaveOutcome:
        outcome, self._outcome = self._outcome, None
        assert outcome is not None
        self.outcomes.append(outcome)
        if outcome.ok:
            self.last_good = outcome.path
        elif self.on_error == "stop":
            raise CheckpointSaveError(self.failure_message(outcome) + " Stopping (on_save_error='stop').")
        return outcome

    def failure_message(self, outcome: SaveOutcome) -> str:
        kept = (f"the previous checkpoint {self.last_good} is intact and is what a restart resumes from"
                if self.last_good else "no earlier checkpoint exists")
        return (f"checkpoint {outcome.path.name} was NOT saved: {outcome.error}; {kept}. Fix: free space or choose "
                "another output_dir (check the disk quota and file-size limit, `ulimit -f`).")

    def _snapshot(self, path: Path, step: int, model: Any, optimizer: Any, lr_scheduler: Any,
                  train_state: TrainState, tokenizer: Any, hooks_writer: Callable[[Path], Any] | None) -> _Snapshot:
        unwrap = self.booster.unwrap
        copy = self.async_write
        # Rank 0 creates the temporary directory, then tells every rank its name (or the error).
        box: list[Any] = [uuid.uuid4().hex[:8], ""]
        if self.rank == 0:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                (path.parent / f"{path.name}.tmp-{box[0]}").mkdir()
            except OSError as exc:
                box[1] = _describe(exc)
        if self.world > 1:
            box = broadcast_json(box, src=0)
        token, error = box
        snap = _Snapshot(step=step, path=path, tmp=path.parent / f"{path.name}.tmp-{token}", token=token, error=error)

        if self.rank == 0:
            snap.model = unwrap(model)
            snap.tokenizer = tokenizer
        shared_error = snap.error  # the same on every rank (broadcast above): collectives follow it
        if copy:
            # Asynchronous: a copy of the model until the background write, spread over the ranks
            # where the plugin hands every rank every tensor or spreads the copy itself, else
            # whole on rank 0.
            plugin = self.booster.plugin
            if plugin.full_state_on_every_rank and spreads(unwrap(model)):
                snap.model_spread = spread_model_copy(unwrap(model), plugin.iter_full_model_state(model),
                                                      self.rank, self.world)  # collective
            elif plugin.spreads_model_copy and spreads(unwrap(model)):
                snap.model_spread = plugin.spread_model_copy(model)  # collective
            else:
                state = plugin.full_model_state_dict(model)  # collective under FSDP / ZeRO
                if self.rank == 0:
                    snap.model_state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
                del state
        if optimizer is not None:
            frags = self.booster.optimizer_fragments(optimizer)
            snap.optim_file, snap.optim_tensors, local = fragment_tensors(frags, self.rank, copy=copy)
            snap.optim_index = fragment_index(frags, local)  # collective
        snap.rng = rng_state()
        if self.rank == 0:
            state_copy = _copy.deepcopy(train_state)
            state_copy.world_size = self.world
            if lr_scheduler is not None:
                state_copy.lr_scheduler = _copy.deepcopy(scheduler_state(lr_scheduler))
            snap.train_state = state_copy
        if hooks_writer is not None:
            # Hooks snapshot here (they may gather, so every rank calls them or none: the decision
            # follows the shared error only); what they return is their file writing, done with
            # this rank's other files (in the background when async). A failure is reported like
            # any other.
            try:
                if not shared_error:
                    snap.hook_files = hooks_writer(snap.tmp)
            except Exception as exc:  # noqa: BLE001 - becomes this rank's error in the outcome
                snap.error = snap.error or _describe(exc)
        if not copy:
            # Synchronous: rank 0 writes each tensor as it is gathered (one file of max_shard_size
            # held at a time); every rank walks the gather to the end even when rank 0 cannot
            # write, and a failure becomes that rank's error, reported like any other.
            try:
                with quiet_hf_progress():
                    self.booster.stream_model(model, snap.tmp / MODEL_DIR, writer=self.rank == 0 and not snap.error,
                                              tokenizer=tokenizer)
                snap.model_written = True
            except Exception as exc:  # noqa: BLE001 - becomes this rank's error in the outcome
                snap.error = snap.error or _describe(exc)
        return snap

    # ------------------------------------------------------------------ the writer (maybe a thread)
    def _write_files(self, snap: _Snapshot) -> None:
        """This rank's files, no collectives."""
        if snap.model_spread is not None:
            with quiet_hf_progress():
                write_spread_model(snap.model, snap.model_spread, snap.tmp / MODEL_DIR, self.rank, tokenizer=snap.tokenizer)
        elif self.rank == 0 and not snap.model_written:
            with quiet_hf_progress():
                save_hf_model(snap.model, snap.model_state, snap.tmp / MODEL_DIR, tokenizer=snap.tokenizer)
        optim_dir = snap.tmp / OPTIM_DIR
        if snap.optim_tensors or snap.optim_index is not None:
            optim_dir.mkdir(parents=True, exist_ok=True)
        if snap.optim_tensors:
            from safetensors.torch import save_file

            save_file(snap.optim_tensors, str(optim_dir / snap.optim_file))
        if snap.optim_index is not None:
            (optim_dir / OPTIM_INDEX).write_text(json.dumps(snap.optim_index))
        write_rng_state(snap.tmp, self.rank, snap.rng)
        if snap.hook_files is not None:
            snap.hook_files()
        if snap.train_state is not None:
            snap.train_state.save(snap.tmp)

    def _write_and_commit(self, snap: _Snapshot) -> None:
        start = time.perf_counter()
        error = snap.error
        if not error:
            try:
                self._write_files(snap)
            except Exception as exc:  # noqa: BLE001 - reported through the store, decided by rank 0
                error = _describe(exc)
        store, prefix = _store(), f"phalanx/checkpoint/{snap.token}"
        try:
            store.set(f"{prefix}/rank{self.rank}", json.dumps({"error": error}))
            if self.rank == 0:
                result = self._commit(snap, store, prefix)
                store.set(f"{prefix}/result", json.dumps(result))
            else:
                store.wait([f"{prefix}/result"], _timedelta(self.timeout_s))
                result = json.loads(store.get(f"{prefix}/result"))
        except Exception as exc:  # noqa: BLE001 - a dead peer or store: this save did not happen
            result = {"ok": False, "error": f"ranks could not agree on the save ({_describe(exc)})", "pruned": []}
        self._outcome = SaveOutcome(step=snap.step, path=snap.path, ok=result["ok"], error=result["error"],
                                    write_s=time.perf_counter() - start, pruned=result["pruned"])
        if self.rank == 0:
            if result["ok"]:
                self.log.info(f"saved {snap.path}" + (f" (pruned {len(result['pruned'])} older)" if result["pruned"]
                                                      else "") + (" in the background" if self.async_write else ""))
            else:
                self.log.warning(self.failure_message(self._outcome))
        snap.model_state = snap.model_spread = snap.hook_files = None
        snap.optim_tensors = {}

    def _commit(self, snap: _Snapshot, store: dist.Store, prefix: str) -> dict[str, Any]:
        """Rank 0: wait for every rank's report, then publish the checkpoint or delete the attempt."""
        keys = [f"{prefix}/rank{r}" for r in range(self.world)]
        store.wait(keys, _timedelta(self.timeout_s))
        errors = [(r, json.loads(store.get(k))["error"]) for r, k in enumerate(keys)]
        for key in keys:  # a long run saves thousands of times: keep the store small
            store.delete_key(key)
        errors = [(r, e) for r, e in errors if e]
        if not errors:
            try:
                commit_directory(snap.tmp, snap.path, {"step": snap.step})
            except Exception as exc:  # noqa: BLE001 - e.g. no space left for the manifest
                errors = [(0, _describe(exc))]
        if errors:
            shutil.rmtree(snap.tmp, ignore_errors=True)
            rank, error = errors[0]
            return {"ok": False, "error": f"rank {rank}: {error}", "pruned": []}
        return {"ok": True, "error": "", "pruned": [str(p) for p in prune_keeping_newest(self.output_dir,
                                                                                        self.keep_last)]}


def prune_keeping_newest(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Rank 0: delete all but the newest `keep_last` complete checkpoints (0 keeps all). Only
    complete checkpoints count, so the last good one is never deleted."""
    removed = []
    if keep_last > 0:
        for _, path in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _timedelta(seconds: float):
    import datetime as _dt

    return _dt.timedelta(seconds=seconds)

