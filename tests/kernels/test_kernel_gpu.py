"""On a CUDA machine: the default dispatch picks Triton, at sizes that use the GPU tile configs
(64-wide blocks, several warps) that the interpreter tests do not reach."""
from __future__ import annotations

import pytest
import torch

import phalanx_kernels as pk
from kernel_checks import HAS_TRITON, TOL, assert_close, grads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")]


def _both(fn, *inputs, grad=None):
    """fn on the auto (Triton) path and on the torch reference: outputs and input gradients."""
    results = []
    for backend in ("auto", "torch"):
        with pk.use_backend(backend):
            out = fn(*inputs)
            out = out[0] if isinstance(out, tuple) else out
            if grad is not None:
                out.backward(grad)
            results.append([out.detach().clone(), *grads(*[t for t in inputs if isinstance(t, torch.Tensor)
                                                          and t.requires_grad])])
    return results


def test_dispatch_picks_triton_on_cuda():
    from phalanx_kernels import dispatch
    assert dispatch.use_triton(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_kernels_at_gpu_sizes(dtype):
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
    x, w = mk(1000, 4096), mk(4096)
    for got, want in [_both(pk.rms_norm, x, w, grad=torch.randn_like(x)),
                      _both(pk.layer_norm, x, w, w, grad=torch.randn_like(x)),
                      _both(pk.swiglu, x, mk(1000, 4096), grad=torch.randn_like(x))]:
        for a, e in zip(got, want, strict=True):
            assert_close(a, e, TOL[dtype] * 4)
    q, k, v = mk(2, 8, 300, 128), mk(2, 2, 300, 128), mk(2, 2, 300, 128)
    got, want = _both(lambda *t: pk.flash_attention(*t, causal=True), q, k, v, grad=torch.randn_like(q))
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, TOL[dtype] * 4)
    h, lm = mk(3000, 256), mk(5000, 256)
    labels = torch.randint(0, 5000, (3000,), device="cuda")
    got, want = _both(lambda a, b: pk.fused_linear_cross_entropy(a, b, labels, label_smoothing=0.1), h, lm,
                      grad=torch.ones((), device="cuda"))
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, TOL[dtype] * 4)


def test_paged_decode_at_gpu_sizes():
    B, H, Hk, D, page, ctx = 8, 32, 8, 128, 16, 3000
    blocks = B * (ctx // page + 1)
    kc = torch.randn(blocks, page, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(blocks, device="cuda").view(B, -1).int()
    lens = torch.randint(1, ctx, (B,), device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    got, want = _both(pk.paged_decode_attention, q, kc, vc, tables, lens)
    assert_close(got[0], want[0], TOL[torch.bfloat16])
