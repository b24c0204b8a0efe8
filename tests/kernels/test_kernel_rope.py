"""RoPE in place on HF-style q/k views (forward and backward), and the fused KV-cache write."""
from __future__ import annotations

import pytest
import torch

from phalanx_kernels.rope import (apply_rope_reference, apply_rope_triton, rope_and_cache_write_reference,
                                  rope_and_cache_write_triton)
from kernel_checks import TOL, assert_close, grads


def _cos_sin(positions: torch.Tensor, dim: int, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,Hq,Hk,D,batched_cos", [(2, 5, 4, 2, 16, True), (1, 1, 2, 2, 8, False),
                                                      (2, 7, 3, 1, 12, True)])
def test_apply_rope_matches_reference(triton_backend, device, dtype, B, T, Hq, Hk, D, batched_cos):
    # q and k as HF attention makes them: transposed views of projection outputs
    x = torch.randn(B, T, 8, device=device, dtype=dtype)
    wq = torch.randn(Hq * D, 8, device=device, dtype=dtype, requires_grad=True)
    wk = torch.randn(Hk * D, 8, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(T, device=device) + 3
    cos, sin = _cos_sin(positions.expand(B, T) if batched_cos else positions, D, dtype)
    dq = torch.randn(B, Hq, T, D, device=device)
    dk = torch.randn(B, Hk, T, D, device=device)
    results = []
    for fn in (apply_rope_triton, apply_rope_reference):
        q = (x @ wq.t()).view(B, T, Hq, D).transpose(1, 2)
        k = (x @ wk.t()).view(B, T, Hk, D).transpose(1, 2)
        q_out, k_out = fn(q, k, cos, sin)
        assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
        ((q_out.float() * dq).sum() + (k_out.float() * dk).sum()).backward()
        results.append([q_out, k_out, *grads(wq, wk)])
    for name, a, e in zip(("q", "k", "dwq", "dwk"), *results, strict=True):
        assert_close(a, e, TOL[dtype] * (2 if name.startswith("d") else 1), name)


def test_apply_rope_reference_is_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = _cos_sin(torch.arange(5).expand(2, 5), 16, torch.float32)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_ours, k_ours = apply_rope_reference(q.clone(), k.clone(), cos, sin)
    assert torch.equal(q_ours, q_hf) and torch.equal(k_ours, k_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write_matches_reference(triton_backend, device, dtype):
    N, Hq, Hk, D, blocks, page = 6, 4, 2, 16, 4, 3  # a page size that is not a power of two
    q = torch.randn(N, Hq, D, device=device, dtype=dtype)
    k = torch.randn(N, Hk, D, device=device, dtype=dtype)
    v = torch.randn(N, Hk, D, device=device, dtype=dtype)
    cos, sin = _cos_sin(torch.tensor([0, 1, 2, 0, 7, 8], device=device), D, dtype)
    slots = torch.tensor([0, 5, 6, -1, 11, 2], device=device, dtype=torch.int32)  # -1: padding
    outs = []
    for fn in (rope_and_cache_write_triton, rope_and_cache_write_reference):
        kc = torch.zeros(blocks, page, Hk, D, device=device, dtype=dtype)
        vc = torch.zeros_like(kc)
        qq, kk = q.clone(), k.clone()
        fn(qq, kk, v, cos, sin, kc, vc, slots)
        outs.append((qq, kk, kc, vc))
    for name, a, e in zip(("q", "k", "k_cache", "v_cache"), *outs, strict=True):
        assert_close(a, e, TOL[dtype], name)
    kc = outs[0][2].flatten(0, 1)
    assert torch.equal(kc[[1, 3, 4, 7, 8, 9, 10]].abs().sum(), torch.zeros((), dtype=dtype, device=device))
    assert torch.equal(outs[0][3].flatten(0, 1)[5], v[1])  # v is stored as is
