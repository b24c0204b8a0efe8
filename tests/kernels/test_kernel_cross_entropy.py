"""Fused linear + cross-entropy: the chunked reference against full-logits F.cross_entropy, the
Triton chunk step against the reference, and the memory property (no [N, V] allocation)."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from phalanx_kernels import cross_entropy, fused_linear_cross_entropy
from phalanx_kernels.cross_entropy import (fused_linear_cross_entropy_reference,
                                           fused_linear_cross_entropy_triton, linear_cross_entropy_eager)
from kernel_checks import TOL, assert_close, grads


def _problem(N, H, V, dtype, device="cpu", bias=False, ignore_index=-100):
    hidden = torch.randn(N, H, device=device, dtype=dtype, requires_grad=True)
    weight = (0.3 * torch.randn(V, H, device=device)).to(dtype).requires_grad_()
    b = torch.randn(V, device=device, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (N,), device=device)
    labels[:: 3] = ignore_index  # every third token ignored (padding / prompt)
    return hidden, weight, b, labels


def _run(fn, hidden, weight, bias, labels, reduction, grad_out, **kw):
    loss = fn(hidden, weight, labels, bias, reduction=reduction, **kw)
    (loss.float() * grad_out).sum().backward()
    return [loss, *grads(hidden, weight, bias)]


def _compare(got, want, tol):
    for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), got, want, strict=True):
        if e is not None:
            assert_close(a, e, tol, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_full_logits(dtype, reduction, smoothing, bias):
    N, H, V = 23, 16, 37
    hidden, weight, b, labels = _problem(N, H, V, dtype, bias=bias)
    grad_out = torch.randn(N) if reduction == "none" else torch.tensor(1.7)
    want = _run(linear_cross_entropy_eager, hidden, weight, b, labels, reduction, grad_out,
                label_smoothing=smoothing)
    for chunk in (1, 5, 64):  # one token per chunk, a ragged last chunk, a single chunk
        got = _run(fused_linear_cross_entropy_reference, hidden, weight, b, labels, reduction, grad_out,
                   label_smoothing=smoothing, chunk_size=chunk)
        assert got[0].dtype == torch.float32
        _compare(got, want, 1e-5 if dtype == torch.float32 else 2e-2)


def test_custom_ignore_index_and_batched_shape():
    B, T, H, V = 2, 5, 8, 11
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[0, :2] = 7  # a real class used as the ignore index
    per_token = fused_linear_cross_entropy(hidden, weight, labels, ignore_index=7, reduction="none")
    assert per_token.shape == (B, T) and (per_token[labels == 7] == 0).all()
    want = linear_cross_entropy_eager(hidden, weight, labels, ignore_index=7, reduction="none")
    assert_close(per_token, want, 1e-5, "loss")


def test_all_ignored_mean_is_zero_not_nan():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.full((4,), -100)
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_no_grad_gives_the_same_loss():
    hidden, weight, _, labels = _problem(9, 8, 13, torch.float32)
    with torch.no_grad():
        a = fused_linear_cross_entropy(hidden, weight, labels, label_smoothing=0.2, chunk_size=4)
    b = linear_cross_entropy_eager(hidden, weight, labels, label_smoothing=0.2)
    assert_close(a, b, 1e-6, "loss")


def test_autocast_bf16_with_fp32_master_weights():
    hidden, weight, _, labels = _problem(16, 8, 13, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(fused_linear_cross_entropy, hidden, weight, None, labels, "mean", torch.tensor(1.0))
        want = _run(linear_cross_entropy_eager, hidden, weight, None, labels, "mean", torch.tensor(1.0))
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    _compare(got, want, 2e-2)


def test_bad_arguments_name_the_problem():
    hidden, weight, _, labels = _problem(4, 8, 13, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="shifted"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="lm_head weight"):
        fused_linear_cross_entropy(hidden, weight.t(), labels)


def _peak_and_largest_alloc(fn):
    """Peak live bytes and the largest single allocation of torch's CPU allocator during fn()."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = largest = 0
    for e in events:
        live += e.nbytes()
        peak, largest = max(peak, live), max(largest, e.nbytes())
    return peak, largest


def test_never_allocates_full_logits():
    N, H, V = 1024, 32, 2048
    hidden, weight, _, labels = _problem(N, H, V, torch.float32)
    full_logits = N * V * 4
    fused_peak, fused_largest = _peak_and_largest_alloc(
        lambda: fused_linear_cross_entropy(hidden, weight, labels, chunk_size=128).backward())
    eager_peak, _ = _peak_and_largest_alloc(
        lambda: linear_cross_entropy_eager(hidden, weight, labels).backward())
    assert fused_largest <= full_logits // 8  # one 128-token chunk of logits
    assert eager_peak >= 2 * full_logits and fused_peak * 3 <= eager_peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction,smoothing,bias", [("mean", 0.0, False), ("sum", 0.1, True),
                                                      ("none", 0.1, False)])
def test_triton_matches_reference(triton_backend, device, dtype, reduction, smoothing, bias, monkeypatch):
    # the Triton step keeps bf16 gradients, folded into grad_weight in vocabulary slices: make
    # the slices 5 rows so that path is exercised
    monkeypatch.setattr(cross_entropy, "WEIGHT_GRAD_SLICE_BYTES", 5 * 16 * 2)
    N, H, V = 11, 16, 37
    hidden, weight, b, labels = _problem(N, H, V, dtype, device=device, bias=bias)
    grad_out = torch.randn(N, device=device) if reduction == "none" else torch.tensor(0.5, device=device)
    kw = dict(label_smoothing=smoothing, chunk_size=4)
    got = _run(fused_linear_cross_entropy_triton, hidden, weight, b, labels, reduction, grad_out, **kw)
    want = _run(fused_linear_cross_entropy_reference, hidden, weight, b, labels, reduction, grad_out, **kw)
    _compare(got, want, TOL[dtype])


def test_triton_vocab_spanning_several_blocks(triton_backend, device):
    hidden, weight, _, labels = _problem(3, 16, 2500, torch.float32, device=device)  # > 2 x 1024 blocks
    got = _run(fused_linear_cross_entropy_triton, hidden, weight, None, labels, "mean", torch.tensor(1.0),
               label_smoothing=0.1)
    want = _run(fused_linear_cross_entropy_reference, hidden, weight, None, labels, "mean",
                torch.tensor(1.0), label_smoothing=0.1)
    _compare(got, want, TOL[torch.float32])
