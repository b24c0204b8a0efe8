"""Host memory for offloaded tensors (ZeRO CPU offload, Gemini's host tier), and the kernel's
view of the process's memory.

On a GPU machine "offloaded" means CPU memory, page-locked where it is copied to and from the
device often (`pinned=True`). On a CPU-only machine the device *is* the CPU, so offloaded
tensors would be indistinguishable from the rest: `host_empty` then takes them from a pool of
their own, shared anonymous mappings outside torch's allocator. The kernel counts those pages
as `RssShmem` and everything torch allocates (the "device") as `RssAnon`, so where a tensor lives
and how much each side holds are measurable (`phalanx.observe.memory.resident_bytes`, `memory_kind`) by the same code
path that moves real data on a GPU: a move between the two is a real copy. The pool pages are
not inherited by forked processes (`MADV_DONTFORK`), like private memory after exec.
"""
from __future__ import annotations

import mmap
import weakref

import torch

from phalanx_kernels.accelerator import available as accelerator_available

_PAGE = mmap.PAGESIZE
_POOL: dict[int, int] = {}  # start address of each live pool mapping -> its size in bytes


def _cpu_only() -> bool:
    return not accelerator_available()


def host_empty(numel: int, dtype: torch.dtype = torch.float32, *, zero: bool = False,
               pinned: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor for offloaded data: page-locked if `pinned` on a GPU machine; on a
    CPU-only machine from the host pool (zero-filled by the kernel, whatever `zero` says)."""
    if not _cpu_only():
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device="cpu", pin_memory=pinned)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, numel * itemsize)
    region = mmap.mmap(-1, -(-nbytes // _PAGE) * _PAGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_DONTFORK"):
        region.madvise(mmap.MADV_DONTFORK)
    if not numel:
        return torch.empty(0, dtype=dtype)
    # The tensor keeps the mapping alive (buffer export); the pages are unmapped with it.
    t = torch.frombuffer(region, dtype=dtype, count=numel)
    address = t.data_ptr()
    _POOL[address] = len(region)
    weakref.finalize(region, _POOL.pop, address, None)
    return t


def in_host_pool(t: torch.Tensor) -> bool:
    """Whether `t` lives in host memory from `host_empty`: on a CPU-only machine, in the pool;
    on a GPU machine, anywhere in CPU memory."""
    if not _cpu_only():
        return t.device.type == "cpu"
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _POOL


def host_copy(t: torch.Tensor, *, pinned: bool = False) -> torch.Tensor:
    """A flat copy of `t` in host memory (see `host_empty`)."""
    out = host_empty(t.numel(), t.dtype, pinned=pinned)
    out.copy_(t.detach().reshape(-1))
    return out


# ---------------------------------------------------------------------------- where a tensor lives (Linux)
def memory_kind(t: torch.Tensor) -> str:
    """"shared" (the host pool, on a CPU-only machine) or "private" (torch's allocator): the
    kind of the mapping that holds `t`'s first byte, as /proc/self/maps reports it."""
    address = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return "shared" if perms[3] == "s" else "private"
    raise ValueError(f"address {address:#x} is in no mapping of this process")
