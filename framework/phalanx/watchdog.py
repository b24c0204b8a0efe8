"""A per-rank hang watchdog that names the rank that is missing, and from what.

The training thread marks what it is doing with `track("loss all-reduce")` (a no-op unless a
watchdog runs). Every rank has a daemon thread that publishes its last entered operation (a
sequence number, the name, the step, when it was entered) to the process group's key-value store
every few seconds. When an operation has not finished within `timeout_s`, the thread reads every
rank's record and reports which ranks are behind (a lower sequence number: they never reached the
collective), which are waiting in the same operation, and which are silent (no heartbeat: dead or
frozen), and raises an alarm in the store so every other rank reports where it is too. Then it
ends the process with exit status `HANG_EXIT_CODE`, so torchrun's elastic agent restarts the
group and `fit` resumes from the last complete checkpoint.

Why a store and a thread: a rank stuck in a collective cannot use the process group, and its
training thread is blocked inside C++; the store is a separate TCP connection and the thread keeps
running while the training thread waits (collectives and sleeps release the GIL).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch.distributed as dist

from phalanx.observe import get_logger

HANG_EXIT_CODE = 75  # os.EX_TEMPFAIL: a temporary failure that a restart may cure

_ACTIVE: "Watchdog | None" = None


@dataclass
class _Record:
    seq: int = 0
    op: str = "start"
    step: int = 0
    entered: float = 0.0        # time.time() when the operation was entered
    done: bool = True


@contextlib.contextmanager
def track(op: str) -> Iterator[None]:
    """Mark the training thread as inside `op` (a collective, or work between collectives)."""
    dog = _ACTIVE
    if dog is None:
        yield
        return
    dog.enter(op)
    try:
        yield
    finally:
        dog.leave()


def set_step(step: int) -> None:
    if _ACTIVE is not None:
        _ACTIVE.step = step


class Watchdog:
    """Start with `start()` (collective: agrees on a run id), stop with `stop()`."""

    def __init__(self, timeout_s: float, *, interval_s: float | None = None,
                 on_hang: Callable[[str], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"hang timeout must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s or max(0.2, min(5.0, self.timeout_s / 4))
        self.on_hang = on_hang or self._stop_process
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.step = 0
        self._record = _Record(entered=time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefix = ""
        self.report: str | None = None

    # ------------------------------------------------------------------ the training thread
    def enter(self, op: str) -> None:
        self._record = _Record(self._record.seq + 1, op, self.step, time.time(), False)

    def leave(self) -> None:
        r = self._record
        self._record = _Record(r.seq, r.op, r.step, r.entered, True)

    def start(self) -> "Watchdog":
        global _ACTIVE
        box = [uuid.uuid4().hex[:8]]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        self._prefix = f"phalanx/watchdog/{box[0]}"
        self._store = dist.distributed_c10d._get_default_store()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="phalanx-watchdog", daemon=True)
        self._thread.start()
        _ACTIVE = self
        return self

    def stop(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 5)

    # ------------------------------------------------------------------ the watchdog thread
    def _publish(self) -> None:
        r = self._record
        self._store.set(f"{self._prefix}/rank{self.rank}",
                        json.dumps({"seq": r.seq, "op": r.op, "step": r.step, "entered": r.entered, "done": r.done,
                                    "beat": time.time()}))

    def _run(self) -> None:
        alarm = f"{self._prefix}/hang"
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
                r = self._record
                # Report when this rank's own operation is overdue, or when another rank reported:
                # every rank that can still speak says where it is before the agent stops them.
                if (not r.done and time.time() - r.entered > self.timeout_s) or self._store.check([alarm]):
                    self._store.set(alarm, str(self.rank))
                    self.report = self.describe_hang(r)
                    self.on_hang(self.report)
                    return
            except Exception as exc:  # noqa: BLE001 - the watchdog must never kill a healthy run
                get_logger("phalanx.watchdog").debug(f"watchdog check failed: {exc}")

    def _records(self) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world):
            key = f"{self._prefix}/rank{rank}"
            out[rank] = json.loads(self._store.get(key)) if self._store.check([key]) else None
        return out

    def describe_hang(self, mine: _Record) -> str:
        now = time.time()
        records = self._records()
        stale = max(3 * self.interval_s, 2.0)
        behind, waiting, ahead, silent = [], [], [], []
        lines = []
        for rank, rec in records.items():
            if rec is None:
                silent.append(rank)
                lines.append(f"rank {rank}: no heartbeat at all")
                continue
            state = "finished" if rec["done"] else "inside"
            line = (f"rank {rank}: last entered '{rec['op']}' at step {rec['step']} ({state}, "
                    f"{now - rec['entered']:.1f} s ago)")
            if rank != self.rank and now - rec["beat"] > stale:
                silent.append(rank)
                line += f", silent for {now - rec['beat']:.1f} s (dead or frozen)"
            elif rec["seq"] < mine.seq:
                behind.append(rank)
            elif rec["seq"] > mine.seq:
                ahead.append(rank)
            else:
                waiting.append(rank)
            lines.append(line)
        state = "has not finished after" if not mine.done else "finished; nothing entered since"
        head = (f"phalanx watchdog on rank {self.rank}: '{mine.op}' at step {mine.step} {state} "
                f"{now - mine.entered:.1f} s (hang timeout {self.timeout_s:g} s). ")
        if behind or silent:
            missing = sorted(set(behind) | set(silent))
            head += (f"Missing from it: rank{'s' if len(missing) > 1 else ''} "
                     f"{', '.join(map(str, missing))}. ")
        elif ahead:
            head += (f"This rank is behind: rank{'s' if len(ahead) > 1 else ''} {', '.join(map(str, ahead))} "
                     "already entered later operations (and may be waiting for this one). ")
        else:
            head += ("Every rank is inside the same operation: the collective itself is stuck (network, device), "
                     "or the operation is slower than the timeout (raise hang_timeout_s). ")
        return head + "Last operation of each rank: " + "; ".join(lines) + ". Stopping this rank (exit status " \
            f"{HANG_EXIT_CODE}) so the elastic agent restarts the group from the last checkpoint."

    def _stop_process(self, report: str) -> None:
        """Default reaction: say it on stderr (every rank, not only rank 0), give the other ranks a
        moment to say where they are, and end the process: the training thread is stuck in C++
        and cannot be interrupted any other way."""
        print(report, file=sys.stderr, flush=True)
        time.sleep(2 * self.interval_s + 0.5)
        os._exit(HANG_EXIT_CODE)
