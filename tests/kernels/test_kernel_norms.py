"""RMSNorm (plain and fused with the residual add) and LayerNorm: Triton vs torch reference."""
from __future__ import annotations

import pytest
import torch

from phalanx_kernels.layernorm import layer_norm_reference, layer_norm_triton
from phalanx_kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_triton
from kernel_checks import TOL, assert_close, grads

SHAPES = [(1, 8), (3, 5, 24), (2, 40)]  # one row; odd rows and a non-power-of-two width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(triton_backend, device, dtype, shape, residual):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    r = torch.randn(shape, device=device, dtype=dtype, requires_grad=True) if residual else None
    dy = torch.randn(shape, device=device)
    dh = torch.randn(shape, device=device)
    results = []
    for fn in (rms_norm_triton, rms_norm_reference):
        out = fn(x, w, 1e-5, r)
        y, h = out if residual else (out, None)
        loss = (y.float() * dy).sum() + ((h.float() * dh).sum() if residual else 0)
        loss.backward()
        results.append([y, h, *grads(x, w, r)])
    for name, a, e in zip(("y", "h", "dx", "dw", "dresidual"), *results, strict=True):
        if e is not None:
            assert_close(a, e, TOL[dtype] * (4 if name == "dw" else 1), name)


def test_rms_norm_residual_aliasing_input(triton_backend, device):
    """x and residual being one tensor must still give it both gradient contributions."""
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device)
    results = []
    for fn in (rms_norm_triton, rms_norm_reference):
        y, h = fn(x, w, 1e-6, x)
        (y.square().sum() + h.sum()).backward()
        results.append(grads(x)[0])
    assert_close(results[0], results[1], TOL[torch.float32], "dx")


def test_rms_norm_reference_is_hf_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(24, eps=1e-5).to(dtype)
        torch.nn.init.normal_(norm.weight)
        x = torch.randn(3, 7, 24, dtype=dtype)
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_reference(triton_backend, device, dtype, shape, affine):
    x = (3 + 2 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=True) if affine else None
    b = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=True) if affine else None
    dy = torch.randn(shape, device=device)
    results = []
    for fn in (layer_norm_triton, layer_norm_reference):
        y = fn(x, w, b, 1e-5)
        (y.float() * dy).sum().backward()
        results.append([y, *grads(x, w, b)])
    for name, a, e in zip(("y", "dx", "dw", "db"), *results, strict=True):
        if e is not None:
            assert_close(a, e, TOL[dtype] * (4 if name in ("dw", "db") else 1), name)


def test_expanded_upstream_gradients(triton_backend, device):
    """`y.sum().backward()` hands each backward kernel a stride-0 gradient."""
    from phalanx_kernels.attention import flash_attention_reference, flash_attention_triton
    from phalanx_kernels.glu import swiglu_reference, swiglu_triton
    from phalanx_kernels.softmax import masked_softmax_reference, masked_softmax_triton
    x = torch.randn(3, 24, device=device, requires_grad=True)
    w = torch.randn(24, device=device, requires_grad=True)
    q = torch.randn(1, 2, 5, 16, device=device, requires_grad=True)
    pairs = [(lambda: rms_norm_triton(x, w), lambda: rms_norm_reference(x, w), (x, w)),
             (lambda: layer_norm_triton(x, w, w), lambda: layer_norm_reference(x, w, w), (x, w)),
             (lambda: swiglu_triton(x, x * 2), lambda: swiglu_reference(x, x * 2), (x,)),
             (lambda: masked_softmax_triton(x, bias=w), lambda: masked_softmax_reference(x, bias=w), (x, w)),
             (lambda: flash_attention_triton(q, q, q, True), lambda: flash_attention_reference(q, q, q, True), (q,))]
    for ours, ref, inputs in pairs:
        ours().sum().backward()
        got = grads(*inputs)
        ref().sum().backward()
        for a, e in zip(got, grads(*inputs), strict=True):
            assert_close(a, e, TOL[torch.float32] * 4, "grad")
