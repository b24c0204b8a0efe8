"""Masked softmax with a pair bias (the Evoformer pattern): Triton vs reference, forward and backward."""
from __future__ import annotations

import pytest
import torch

from phalanx_kernels.softmax import masked_softmax_reference, masked_softmax_triton
from kernel_checks import TOL, assert_close, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_mask,use_bias,float_mask", [(True, True, False), (True, False, True),
                                                           (False, True, False), (False, False, False)])
def test_evoformer_shapes_match_reference(triton_backend, device, dtype, use_mask, use_bias, float_mask):
    B, S, H, Q, K = 2, 3, 2, 5, 7  # logits [batch, seq rows, heads, queries, keys]
    x = torch.randn(B, S, H, Q, K, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(B, 1, H, Q, K, device=device, dtype=dtype, requires_grad=True) if use_bias else None
    mask = None
    if use_mask:
        mask = torch.rand(B, S, 1, 1, K, device=device) > 0.3
        mask[0, 1] = False  # one sequence row fully masked: zeros, not NaN
        mask = mask.float() if float_mask else mask
    dy = torch.randn(B, S, H, Q, K, device=device)
    results = []
    for fn in (masked_softmax_triton, masked_softmax_reference):
        y = fn(x, mask, bias)
        (y.float() * dy).sum().backward()
        results.append([y, *grads(x, bias)])
    for name, a, e in zip(("y", "dx", "dbias"), *results, strict=True):
        if e is not None:
            assert_close(a, e, TOL[dtype] * (1 if name == "y" else 4), name)
    if use_mask:
        assert results[0][0][0, 1].abs().sum() == 0


@pytest.mark.parametrize("shape", [(1, 1), (4, 33), (2, 3, 1)])
def test_plain_softmax_odd_shapes(triton_backend, device, shape):
    x = torch.randn(shape, device=device)
    assert_close(masked_softmax_triton(x), torch.softmax(x, -1), TOL[torch.float32], "y")


def test_non_contiguous_input_and_mask_that_would_enlarge(triton_backend, device):
    x = torch.randn(2, 4, 3, device=device).transpose(1, 2)  # [2, 3, 4] with strides
    assert_close(masked_softmax_triton(x), torch.softmax(x, -1), TOL[torch.float32], "y")
    with pytest.raises(ValueError, match="broadcast"):
        masked_softmax_triton(torch.randn(3, 4, device=device), bias=torch.randn(2, 3, 4, device=device))
