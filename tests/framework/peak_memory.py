"""The resident memory a piece of work adds to this process at its peak, counted by the kernel:
the high-water mark `VmHWM` of /proc/self/status, reset through /proc/self/clear_refs just before
the work, so a transient of any length counts (a sampling thread can miss one that lasts a few
milliseconds). Only memory the work allocates counts: the file-backed pages it faults in (the
code of torch kernels it is the first in this process to run, several MiB in a rank forked from
the forkserver, whose page tables start without the parent's file pages) are taken off.
Linux only; glibc is told to give freed memory back (`follow_live_memory`, for
the whole process: call it in a spawned rank, not in the pytest process)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

STATUS = Path("/proc/self/status")


def _status(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current VmRSS
        return True
    except OSError:
        return False


def available() -> bool:
    """Whether this process can measure (and now follows live memory)."""
    from phalanx.malloc import follow_live_memory

    return STATUS.is_file() and follow_live_memory() and _reset_peak()


def peak_added(work: Callable[[], object]) -> int:
    """Bytes of resident memory `work()` allocates at its peak above the resident memory before it
    (after garbage is collected and freed pages are returned). File-backed pages only ever grow
    during the work (code and mapped files faulted in), so their growth at the end is taken off
    the high-water mark of the total."""
    from phalanx.observe.memory import release_free_memory

    release_free_memory()
    _reset_peak()
    base, file_base = _status("VmRSS"), _status("RssFile")
    work()
    return _status("VmHWM") - base - max(0, _status("RssFile") - file_base)
