"""The kernels the model runner calls, dispatched once per call by device.

On CUDA each goes through phalanx_kernels' own dispatch (Triton, or what `set_backend` chose).
Elsewhere the torch references are called directly: phalanx_kernels' `use_triton` looks up the
triton package on every call (`importlib.util.find_spec`, a few filesystem stats, ~1 ms), which
measured as ~20% of a CPU decode step when paid by every norm, activation and attention call of
every layer.
"""
from __future__ import annotations

import torch

from phalanx_kernels.accelerator import is_accelerator

import phalanx_kernels as pk
from phalanx_kernels.attention import flash_attention_reference
from phalanx_kernels.glu import swiglu_reference
from phalanx_kernels.rmsnorm import rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if is_accelerator(x):
        return pk.rms_norm(x, weight, eps, residual=residual)
    return rms_norm_reference(x, weight, eps, residual)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return pk.swiglu(a, b) if is_accelerator(a) else swiglu_reference(a, b)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    return pk.flash_attention(q, k, v, causal=causal) if is_accelerator(q) else flash_attention_reference(q, k, v, causal)


def cuda_kernels(t: torch.Tensor) -> bool:
    """Whether phalanx_kernels would run Triton for this tensor (only ever on the accelerator:
    compiled on CUDA, in the interpreter on the emulated GPU)."""
    return is_accelerator(t) and pk.dispatch.use_triton(t)
