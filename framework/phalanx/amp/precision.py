"""The precision a run computes in, as one typed value resolved once at the entry point.

`Precision` names the compute dtype and the optimizer's master dtype (always fp32); plugins,
optimizers and the planner read its fields (`mixed`, `loss_scaling`, `low_dtype`,
`compute_dtype`) instead of comparing names. Strings stay in user-facing configs and CLI flags;
whatever takes `str | Precision` calls `resolve_precision` once at its boundary.

`auto` resolves to bf16 where the device has fast bf16 arithmetic (CUDA with bf16; CPUs with
AVX512-BF16 or AMX whose bf16 matmul measures faster than fp32, see `phalanx_kernels.capability`)
and to fp32 elsewhere: on an AVX2-only CPU a bf16 matmul is emulated and runs 70-100x slower than
fp32, and a CPU with AVX512-BF16 but no AMX can be slower in bf16 too. An explicit `bf16` is
honoured everywhere, with one warning per process where it is slower than fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings

import torch

from phalanx_kernels.accelerator import EMULATED_TYPE, current_device

from phalanx_kernels.capability import bf16_is_fastest, cpu_bf16_support


@dataclasses.dataclass(frozen=True)
class Precision:
    """name: "fp32" | "bf16" | "fp16" | "fp8" (never "auto"); compute_dtype: what the model
    computes in; master_dtype: the optimizer's copy of the weights (fp32); fp8_linears: the linear
    layers' matmuls run in fp8 with dynamic scaling (`phalanx.amp.fp8_linear`), everything else
    in the compute dtype (bf16)."""
    name: str
    compute_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    fp8_linears: bool = False

    @property
    def mixed(self) -> bool:
        """The model computes in a lower dtype than the optimizer's fp32 masters."""
        return self.compute_dtype != self.master_dtype

    @property
    def loss_scaling(self) -> bool:
        """fp16 only: its narrow exponent needs the dynamic loss scaler."""
        return self.compute_dtype == torch.float16

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The dtype plugins cast the model to: the compute dtype when mixed, else None."""
        return self.compute_dtype if self.mixed else None

    def __str__(self) -> str:
        return self.name


FP32 = Precision("fp32", torch.float32)
BF16 = Precision("bf16", torch.bfloat16)
FP16 = Precision("fp16", torch.float16)
FP8 = Precision("fp8", torch.bfloat16, fp8_linears=True)
PRECISIONS: dict[str, Precision] = {p.name: p for p in (FP32, BF16, FP16, FP8)}
NAMES = tuple(PRECISIONS)  # the concrete names
CHOICES = ("auto", *NAMES)  # for configs and argparse

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


def precision_named(name: str | Precision) -> Precision:
    """The Precision called `name` (fp32, bf16, fp16 or fp8), with no device involved: no `auto`, no
    warning (for the planner, which sizes runs on other machines). Unknown names raise."""
    if isinstance(name, Precision):
        return name
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is not supported here; use one of {', '.join(NAMES)}")
    return PRECISIONS[name]


def resolve_precision(value: str | Precision, device: torch.device | str | None = None) -> Precision:
    """The concrete Precision for `value` on `device` (default: CUDA if present, else CPU): the one
    place `auto` is resolved, names are validated (unknown names raise with the valid list) and the
    slow-bf16 warning is given. A Precision passes through unchanged."""
    if isinstance(value, Precision):
        return value
    if value not in CHOICES:
        raise ValueError(f"precision={value!r} is not supported; use one of {', '.join(CHOICES)}")
    if value == "auto":
        return BF16 if bf16_is_fastest(device) else FP32
    precision = PRECISIONS[value]
    if precision.fp8_linears:
        check_fp8_device(device)
    elif precision.compute_dtype == torch.bfloat16:
        warn_if_emulated_bf16(device)
    return precision


@functools.lru_cache(maxsize=None)
def host_fp8_matmul() -> bool:
    """Whether this host's CPU kernels multiply fp8 matrices reliably: the scaled matmul torchao's
    float8 linears make, after a bf16 matmul. oneDNN does on AVX-512 CPUs; with AVX2 kernels
    (`ONEDNN_MAX_CPU_ISA=AVX2`) it does until the process has run a bf16 matmul, then fails ("could
    not create a primitive descriptor for the matmul primitive"). The emulated GPU computes on these
    kernels, so its fp8 support is the host's."""
    square = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    square @ square
    x, w, one = torch.ones(16, 32).to(torch.float8_e4m3fn), torch.ones(48, 32).to(torch.float8_e4m3fn), torch.tensor(1.0)
    try:
        torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


def fp8_device_support(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether `device` has fp8 matrix units (NVIDIA compute capability 8.9 or newer: Ada, Hopper,
    Blackwell; the emulated GPU reports 9.0 where the host's kernels multiply fp8) and what the
    device is, for messages."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cpu":
        return False, "the CPU"
    if device.type == EMULATED_TYPE and not host_fp8_matmul():
        return False, "the emulated GPU on a host whose CPU kernels do not multiply fp8 (AVX2: oneDNN)"
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "get_device_capability"):
        return False, f"a {device.type} device"
    major, minor = backend.get_device_capability(device)
    return (major, minor) >= (8, 9), f"{backend.get_device_name(device)} (compute capability {major}.{minor})"


def check_fp8_device(device: torch.device | str | None = None) -> None:
    """Refuse precision=fp8 where the device has no fp8 matmul, or where torchao is missing."""
    supported, what = fp8_device_support(device)
    if not supported:
        raise ValueError(f"precision=fp8 needs a GPU with fp8 matrix units (NVIDIA compute capability 8.9 or newer: "
                         f"L4/RTX 40xx, H100/H200, B200); this run's device is {what}. Use precision=bf16 (or auto).")
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("precision=fp8 runs its linear layers through torchao's float8 training, which is not "
                         "installed: pip install -e \".[fp8]\" (torchao)")


def precision_of_dtype(dtype: torch.dtype) -> Precision:
    """The Precision whose compute dtype is `dtype`: for optimizers built standalone on a model
    already cast (their plugin passes its own Precision instead)."""
    for precision in PRECISIONS.values():
        if precision.compute_dtype == dtype:
            return precision
    raise ValueError(f"no precision computes in {dtype}; cast the model to one of "
                     f"{', '.join(str(p.compute_dtype) for p in PRECISIONS.values())}")
