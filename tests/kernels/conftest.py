"""Test setup for phalanx_kernels.

Triton reads TRITON_INTERPRET when a kernel is *defined* (`@triton.jit` picks the interpreter or
the compiler then). phalanx_kernels defines its kernels lazily, on the first Triton call, so
setting the variable here, at collection time and before any test runs, puts every Triton kernel
of this process in the interpreter. That is only done without a GPU: on a CUDA machine the same
tests run the compiled kernels on CUDA tensors (see the `device` fixture).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # normally already set by the root conftest.py
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

from kernel_checks import HAS_TRITON


@pytest.fixture
def device() -> str:
    """Where Triton kernels run in this session: the GPU, else the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_backend():
    """Force the Triton path for the duration of a test; skip when triton is not installed."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from phalanx_kernels import use_backend
    with use_backend("triton"):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
