"""SwiGLU silu(a) * b: Triton vs torch reference, forward and backward."""
from __future__ import annotations

import pytest
import torch

from phalanx_kernels.glu import swiglu_reference, swiglu_triton
from kernel_checks import TOL, assert_close, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 37), (2, 1100)])  # 2200 elements span 3 blocks
def test_swiglu_matches_reference(triton_backend, device, dtype, shape):
    a = (2 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    b = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device=device)
    results = []
    for fn in (swiglu_triton, swiglu_reference):
        y = fn(a, b)
        (y.float() * dy).sum().backward()
        results.append([y, *grads(a, b)])
    for name, got, want in zip(("y", "da", "db"), *results, strict=True):
        assert_close(got, want, TOL[dtype], name)


def test_swiglu_non_contiguous_inputs(triton_backend, device):
    ab = torch.randn(4, 2, 10, device=device)
    a, b = ab[:, 0], ab[:, 1]  # strided views, as from a fused gate/up projection
    assert_close(swiglu_triton(a, b), swiglu_reference(a, b), TOL[torch.float32], "y")
