"""Small helpers shared by the Triton host wrappers."""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def device_guard(t: torch.Tensor):
    """Launch on the tensor's GPU (not the current one); nothing to do on CPU (interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def parallel_programs(t: torch.Tensor) -> int:
    """How many programs fill the device: the SM count on a GPU, a handful in the interpreter."""
    if t.is_cuda:
        return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 4


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel over `block` elements."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    if block >= 1024:
        return 4
    return 2 if block >= 256 else 1


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View as [rows, last dim] with a unit stride along the last dim (copying only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def upcast_dots(x: torch.Tensor) -> bool:
    """Whether `mma` must upcast its operands: Triton 3.9's interpreter multiplies bf16/fp16
    operands of tl.dot as their raw 16-bit patterns, so on CPU they go through fp32 (exact for
    the products; only the accumulation order differs from a GPU's fp32-accumulating MMA)."""
    return not x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation; see `upcast_dots` for UPCAST."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out
