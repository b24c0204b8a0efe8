"""Memory of this process: the allocator high-water mark on GPU, the resident set on CPU.

On CPU there is no allocator counter, so the figures are the process's resident set size (RSS),
interpreter and libraries included. On Linux the peak (VmHWM) can be reset to the current RSS
(`/proc/self/clear_refs`), so `reset_peak_memory()` + work + `peak_memory_bytes()` minus the RSS
before the work measures that work alone; elsewhere the peak is the lifetime `getrusage` figure.
`release_free_memory()` hands memory freed by Python/torch back to the OS first, so the next
measurement does not silently reuse it.
"""
from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path

import torch

from phalanx_kernels.accelerator import available as accelerator_available
from phalanx_kernels.accelerator import current_device, device_module, is_accelerator

from phalanx.malloc import trim_heap

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _device(device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return current_device()


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def current_memory_bytes(device: torch.device | str | None = None) -> int:
    device = _device(device)
    if is_accelerator(device):
        return int(device_module(device).memory_allocated(device))
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return peak_memory_bytes(device)


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    device = _device(device)
    if is_accelerator(device):
        return int(device_module(device).max_memory_allocated(device))
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, others KiB


def reset_peak_memory(device: torch.device | str | None = None) -> bool:
    """Restart the high-water mark at the current usage; False if this platform cannot."""
    device = _device(device)
    if is_accelerator(device):
        device_module(device).reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")  # Linux: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc's malloc_trim)."""
    gc.collect()
    if accelerator_available():
        device_module().empty_cache()
    trim_heap()


def tensor_bytes_on(tensors, device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages among `tensors` that lie on `device`'s type (the CPU, or the
    accelerator): what of them `current_memory_bytes(device)` already counts."""
    kind = _device(device).type
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.device.type != kind:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage of its own
            total += t.numel() * t.element_size()
            continue
        if storage.data_ptr() in seen:  # tied weights, views
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


# ---------------------------------------------------------------------------- resident memory by kind (Linux)
def resident_bytes() -> dict[str, int]:
    """{"anon", "shmem", "file", "total"}: resident bytes of this process by kind, from
    /proc/self/status ("total" is VmRSS). On a CPU-only machine "anon" is torch's allocations (the
    device side), "shmem" the host pool of `phalanx.hostmem`."""
    wanted = {"RssAnon": "anon", "RssShmem": "shmem", "RssFile": "file", "VmRSS": "total"}
    if not _STATUS.exists():  # not Linux: only the total is known
        import psutil

        return {"total": psutil.Process().memory_info().rss}
    out = {}
    with open(_STATUS) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                out[wanted[key]] = int(value.split()[0]) * 1024
    return out


class PeakResident:
    """The peak of `resident_bytes()` while it runs, sampled by a thread every `interval` seconds
    and at every `sample()` call (e.g. from module hooks, so that no module step is missed).

        with PeakResident() as peak:
            train()
        peak.max["anon"] - baseline["anon"]
    """

    def __init__(self, interval: float = 5e-4):
        self.interval = interval
        self.max: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def sample(self, *_args) -> None:
        now = resident_bytes()
        with self._lock:
            for key, value in now.items():
                self.max[key] = max(self.max.get(key, 0), value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def __enter__(self) -> "PeakResident":
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
