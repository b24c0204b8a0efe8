"""Peak memory of this process, on GPU (allocator high-water mark) or CPU (peak RSS).

On CPU there is no allocator counter, so the figure is the peak resident set size from
`getrusage`: it includes the interpreter and libraries, and it only ever grows within a
process. Compare CPU figures between fresh processes, or subtract a baseline taken before the
work starts (`peak_memory_bytes()` right after start-up).
"""
from __future__ import annotations

import sys

import torch


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Restart the GPU high-water mark (the CPU's peak RSS cannot be reset)."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)
