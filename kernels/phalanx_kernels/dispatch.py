"""Choosing between a kernel's Triton implementation and its torch reference.

`auto` (the default) runs Triton when it is installed and every tensor is on a CUDA device, and
the torch reference everywhere else. `triton` forces the Triton path (tests use it on CPU under
`TRITON_INTERPRET=1`); `torch` forces the reference. The choice is process-wide on purpose:
ranks run as threads in some tests, and a per-thread setting would silently not reach them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Iterator

import torch

from phalanx_kernels.accelerator import emulated, is_accelerator

BACKENDS = ("auto", "triton", "torch")
_backend = "auto"


def set_backend(name: str) -> str:
    """Set the process-wide backend; returns the previous one so callers can restore it."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    previous, _backend = _backend, name
    return previous


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run a block with another backend, e.g. `with use_backend("triton"): ...` in a test."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the triton package can be imported (it is not imported here). Cached: the
    look-up costs ~1 ms, a noticeable share of a CPU decode step."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels will be defined for the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _emulated_references() -> bool:
    """Under the emulated GPU the kernels run their torch references unless
    PHALANX_EMULATE_TRITON=1: Triton's interpreter launches one Python program per tile (the
    protein recipe's 2 tiny steps took over 10 minutes through it, 17 s on the CPU). With the
    variable set they dispatch and run exactly as on a GPU, through the interpreter; the emulator's
    tests, the engine's emulated test and `phalanx selfcheck` do so."""
    return emulated() and os.environ.get("PHALANX_EMULATE_TRITON", "0") != "1"


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Decide, for one call, whether to take the Triton path for these tensors."""
    present = [t for t in tensors if t is not None]
    if _backend == "torch":
        return False
    if _backend == "auto":
        return (bool(present) and all(is_accelerator(t) for t in present) and triton_available()
                and not _emulated_references())
    # forced "triton": fail here with the fix rather than deep inside triton
    if not triton_available():
        raise RuntimeError("kernel backend 'triton' was requested but triton is not installed; "
                           "`pip install triton` or use set_backend('auto')")
    if any(not t.is_cuda for t in present) and not interpreting():  # emulated GPU tensors too: they need the interpreter
        raise RuntimeError("kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "the first kernel call (Triton reads it when kernels are defined)")
    return True
