"""The precisions every plugin supports, and `auto`: the one the hardware computes fast.

`auto` resolves to bf16 where the device has fast bf16 arithmetic (CUDA with bf16; CPUs with
AVX512-BF16 or AMX whose bf16 matmul measures faster than fp32, see `phalanx_kernels.capability`)
and to fp32 elsewhere: on an AVX2-only CPU a bf16 matmul is emulated and runs 70-100x slower than
fp32, and a CPU with AVX512-BF16 but no AMX can be slower in bf16 too. An explicit `bf16` is
honoured everywhere, with one warning per process where it is slower than fp32.
"""
from __future__ import annotations

import warnings

import torch

from phalanx_kernels.accelerator import current_device

from phalanx_kernels.capability import bf16_is_fastest, cpu_bf16_support

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHOICES = ("auto", *PRECISIONS)

_warned: set[str] = set()


def _default_device() -> torch.device:
    return current_device()


def warn_if_emulated_bf16(device: torch.device | str | None = None, what: str = "precision=bf16",
                          fix: str = "precision=auto (or fp32)") -> bool:
    """Warn once per process when bf16 on `device` is slower than fp32 (emulated, or native
    without matrix units); returns whether it is."""
    device = torch.device(device) if device is not None else _default_device()
    if bf16_is_fastest(device):
        return False
    if device.type == "cpu" and what not in _warned:
        _warned.add(what)
        info = cpu_bf16_support()
        kind = "without native bf16" if not info.native else "where bf16 is slower than fp32"
        warnings.warn(
            f"{what} on a CPU {kind} ({info.reason}): a bf16 matmul measured "
            f"{info.bf16_gflops:.1f} GFLOP/s against {info.fp32_gflops:.1f} for fp32, "
            f"{info.bf16_slowdown:.1f}x slower. Use {fix} to run at full speed.",
            stacklevel=3)
    return True


def resolve_precision(precision: str, device: torch.device | str | None = None) -> str:
    """A concrete precision (fp32, bf16 or fp16) for `precision`, which may be `auto`, on `device`
    (default: CUDA if present, else CPU). Unknown names raise with the valid list."""
    if precision not in CHOICES:
        raise ValueError(f"precision={precision!r} is not supported; use one of {', '.join(CHOICES)}")
    if precision == "auto":
        return "bf16" if bf16_is_fastest(device) else "fp32"
    if precision == "bf16":
        warn_if_emulated_bf16(device)
    return precision


check_precision = resolve_precision  # validates too: the name plugins and configs call


def dtype_of(precision: str) -> torch.dtype:
    return PRECISIONS[check_precision(precision)]
