"""Which low-precision dtypes this machine computes natively, measured once per process.

A bf16 matmul is fast where the hardware has bf16 arithmetic (CUDA GPUs from Ampere on; CPUs with
AVX512-BF16 or AMX) and emulated elsewhere: on an AVX2-only CPU it runs 70-100x slower than fp32.
Everything that casts for bf16 (the fused cross-entropy, the inference engine's packed weights)
asks `native_bf16`; the `precision="auto"` choice (and evaluation autocast) asks `bf16_is_fastest`,
which also wants the probe to find bf16 faster than fp32.

On CPU the answer comes from torch's dispatch capability (`torch.backends.cpu.get_cpu_capability`,
which honours ATEN_CPU_CAPABILITY), the CPU's bf16 instructions as torch's cpuinfo reports them,
and a short probe that times a 256x256 matmul in fp32 and bf16 (a few ms where bf16 is native,
~50 ms where it is emulated). The environment variable PHALANX_CPU_BF16=native|emulated overrides
the decision (the probe still runs for the rates); tests use it to exercise both paths on one
machine.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

from phalanx_kernels.accelerator import available, current_device, device_module, is_accelerator

_OVERRIDE_ENV = "PHALANX_CPU_BF16"
# bf16 counts as native when its matmul is at most this many times slower than fp32's. Native
# bf16 with AMX is 2-4x faster, without AMX 1.6-2x slower (a Xeon under KVM); emulation is 30-100x
# slower (47x with AVX2 kernels), so the threshold is far from every measured case.
_MAX_NATIVE_SLOWDOWN = 8.0
_PROBE_SIZE = 256


@dataclass(frozen=True)
class CpuBf16Support:
    """What the CPU does with bf16. `native` decides; the rest explains it."""
    native: bool
    capability: str          # torch's CPU dispatch level: "AVX512", "AVX2", "DEFAULT", ...
    instructions: bool       # AVX512-BF16 or AMX present (per torch's cpuinfo)
    fp32_gflops: float       # 256x256 matmul, one thread, best of a few
    bf16_gflops: float
    reason: str

    # Whether bf16 also beats fp32 here. Native bf16 is not always faster: an Intel Xeon whose
    # hypervisor hides AMX but exposes AVX512-BF16 measured bf16 at 0.6x fp32's rate (83 vs 143
    # GFLOP/s, 1024x1024, one thread), so training there is faster in fp32.
    faster_than_fp32: bool = True

    @property
    def bf16_slowdown(self) -> float:
        """How many times slower a bf16 matmul is than an fp32 one (below 1: faster)."""
        return self.fp32_gflops / max(self.bf16_gflops, 1e-9)


def _matmul_gflops(dtype: torch.dtype, n: int = _PROBE_SIZE, reps: int = 3) -> float:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a per-core rate, comparable across machines and ranks
    try:
        a @ b  # warm-up: library initialisation, weight reorders
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / max(best, 1e-9) / 1e9


def _bf16_instructions() -> bool:
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


@functools.lru_cache(maxsize=1)
def _measured_cpu_bf16_support() -> CpuBf16Support:
    """Measure once per process whether this CPU runs bf16 matmuls natively."""
    capability = torch.backends.cpu.get_cpu_capability()
    instructions = _bf16_instructions()
    fp32, bf16 = _matmul_gflops(torch.float32), _matmul_gflops(torch.bfloat16)
    slowdown = fp32 / max(bf16, 1e-9)
    override = os.environ.get(_OVERRIDE_ENV, "").strip().lower()
    if override in ("native", "emulated"):
        native, reason = override == "native", f"{_OVERRIDE_ENV}={override}"
    elif override:
        raise ValueError(f"{_OVERRIDE_ENV}={override!r}: use 'native' or 'emulated' (or unset it to detect)")
    elif not capability.startswith("AVX512") and capability != "AMX":
        native, reason = False, f"CPU capability {capability}: bf16 is emulated"
    elif not instructions:
        native, reason = False, f"CPU capability {capability} without AVX512-BF16/AMX: bf16 is emulated"
    elif slowdown > _MAX_NATIVE_SLOWDOWN:
        native, reason = False, f"bf16 matmul measured {slowdown:.1f}x slower than fp32"
    else:
        native, reason = True, f"CPU capability {capability} with bf16 instructions"
    # An override of "native" stands for the fast kind (the tests' AVX512-BF16/AMX machine).
    faster = native and (override == "native" or slowdown < 1.0)
    if native and not faster:
        reason += ", but its bf16 matmul is slower than fp32 (no AMX?)"
    return CpuBf16Support(native, capability, instructions, fp32, bf16, reason, faster)


def native_bf16(device: torch.device | str | None = None) -> bool:
    """Whether `device` (default: CUDA if present, else CPU) computes bf16 at full speed."""
    device = torch.device(device) if device is not None else current_device()
    if is_accelerator(device):
        return available() and device_module(device).is_bf16_supported()
    if device.type == "cpu":
        return cpu_bf16_support().native
    return False  # meta and other devices: assume nothing


_agreed: list[CpuBf16Support] = []  # set by agree_across_ranks: the decision every rank shares


def cpu_bf16_support() -> CpuBf16Support:
    """This process's decision: measured once, or the one all ranks agreed on (`agree_across_ranks`)."""
    return _agreed[0] if _agreed else _measured_cpu_bf16_support()


def _clear_cpu_bf16_support() -> None:
    _agreed.clear()
    _measured_cpu_bf16_support.cache_clear()


cpu_bf16_support.cache_clear = _clear_cpu_bf16_support  # the tests re-measure with other settings


def agree_across_ranks(group=None) -> CpuBf16Support:
    """Give every rank of a CPU (gloo) process group the same decision: the least capable rank's.

    Each rank's probe is timed on cores the other ranks share, so on a CPU whose bf16 rate is
    near a threshold two ranks could decide differently, and then compute in different dtypes
    and exchange mismatched tensors (seen: a gloo all_reduce of bf16 on one rank against fp32 on
    the other). Collective: every rank of `group` must call it (phalanx.launch does)."""
    import dataclasses

    import torch.distributed as dist

    support = _measured_cpu_bf16_support()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return support
    flags = torch.tensor([int(support.native), int(support.faster_than_fp32)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    native, faster = bool(flags[0]), bool(flags[1])
    if (native, faster) != (support.native, support.faster_than_fp32):
        support = dataclasses.replace(support, native=native, faster_than_fp32=faster,
                                      reason=support.reason + "; another rank measured less, all ranks follow it")
    _agreed[:] = [support]
    return support


def bf16_is_fastest(device: torch.device | str | None = None) -> bool:
    """Whether bf16 is the faster training dtype on `device`: native there and, on CPU, measured
    faster than fp32 (what `precision="auto"` picks bf16 on)."""
    device = torch.device(device) if device is not None else current_device()
    if device.type == "cpu":
        support = cpu_bf16_support()
        return support.native and support.faster_than_fp32
    return native_bf16(device)


def fast_compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """`dtype`, or fp32 when `dtype` is bf16 and `device` would emulate it (a CPU without bf16
    arithmetic): the fallback every bf16 matmul path uses."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_bf16("cpu"):
        return torch.float32
    return dtype
