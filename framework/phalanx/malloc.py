"""glibc's allocator, tuned for training on the CPU: freed tensors are reused, not faulted in again.

torch's CPU allocator is plain `malloc`. glibc serves every block above its mmap threshold (at
most 32 MiB, adjusted at run time) with a fresh `mmap` and gives it back with `munmap` when it is
freed, and trims the top of the heap as soon as 128 KiB there are free. A training step allocates
the same large blocks every time — FSDP's unsharded parameters and gradients (a whole decoder
layer, 50 MB at hidden 1024), gathered ZeRO buckets, activations — so each step pays a page fault
per 4 KiB page of each block again: 2.9x the time of the copy that fills it (a 50 MB buffer,
measured: 243 ms for four allocated and filled against 85 ms when the memory is reused).

`keep_freed_memory()` raises both thresholds, so large blocks come from the heap and freed ones stay
in the process for the next step. It does not raise the peak: a step needs the same blocks again.
What it changes is that memory freed after a peak stays resident until `give_back_freed_memory()`
(`malloc_trim`), which phalanx calls where a peak ends and a different phase starts (before a
checkpoint is written, after training). GPU processes are left alone (their large tensors are not
`malloc`'s). `PHALANX_KEEP_FREED_MEMORY=0` turns it off; other C libraries (musl) are skipped.

Measuring memory wants the opposite: resident memory that follows live memory, or a peak read
from /proc includes whatever glibc kept for reuse (72 MiB resident for 33 MiB live, measured in
the Gemini memory test). `follow_live_memory()` sets that (`phalanx.plan.measure` and the memory
tests call it). This module is the one place that calls `mallopt`; both settings are in
`SETTINGS`. A measuring process stays measuring: once `follow_live_memory()` ran, a later
`keep_freed_memory()` (the one in `phalanx.launch()`) leaves the thresholds alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# name -> (mmap threshold, trim threshold), bytes.
SETTINGS: dict[str, tuple[int, int]] = {
    # Training: blocks up to 1 GiB come from the heap (the largest FSDP layer or ZeRO bucket of a
    # model that trains on a CPU is well below); 2 GiB of free heap top is kept before glibc trims.
    "keep": (1 << 30, 1 << 31),
    # Measuring: every block above 64 KiB is its own mapping, unmapped when freed, and the heap
    # top is trimmed past 128 KiB, so resident memory is live memory.
    "follow": (64 << 10, 128 << 10),
}

_state: dict = {"setting": None, "libc": None}


def _libc():
    """glibc, or None (another C library, or none found)."""
    if _state["libc"] is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
        glibc = libc is not None and hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim")
        _state["libc"] = libc if glibc else False
    return _state["libc"] or None


def _apply(setting: str) -> bool:
    """Set glibc's thresholds to `SETTINGS[setting]`; False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    mmap_threshold, trim_threshold = SETTINGS[setting]
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    _state["setting"] = setting if ok else None
    return ok


def keep_freed_memory(enabled: bool | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; "keep" in `SETTINGS`).
    Returns whether they are raised. `enabled=None` reads `PHALANX_KEEP_FREED_MEMORY` (default
    on). A process that follows live memory (`follow_live_memory`) keeps following it."""
    if enabled is None:
        enabled = os.environ.get("PHALANX_KEEP_FREED_MEMORY", "1").strip().lower() not in ("0", "false", "no", "off")
    if not enabled or _state["setting"] is not None:
        return _state["setting"] == "keep"
    return _apply("keep")


def follow_live_memory() -> bool:
    """Make resident memory follow live memory ("follow" in `SETTINGS`), for measuring peaks.
    False where there is no glibc `mallopt`."""
    return _state["setting"] == "follow" or _apply("follow")


def give_back_freed_memory() -> None:
    """Return the memory the process keeps free to the kernel (`malloc_trim(0)`); a no-op unless
    `keep_freed_memory` raised the thresholds."""
    if _state["setting"] == "keep":
        trim_heap()


def trim_heap() -> None:
    """`malloc_trim(0)` whatever the setting (before a measurement's baseline); a no-op off glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
