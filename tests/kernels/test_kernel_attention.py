"""Flash attention (forward and backward) and paged decode attention: Triton vs reference, and
the references against a plain dense computation."""
from __future__ import annotations

import pytest
import torch

from phalanx_kernels.attention import flash_attention_reference, flash_attention_triton
from phalanx_kernels.paged_attention import paged_decode_attention_reference, paged_decode_attention_triton
from kernel_checks import TOL, assert_close, grads


def dense_attention(q, k, v, causal, scale=None):
    """softmax(q k^T) v in fp32 with explicit GQA repeat and a bottom-right causal mask."""
    T, S, D = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = q.float() @ k.transpose(-1, -2) * (scale if scale is not None else D ** -0.5)
    if causal:
        allowed = torch.arange(T, device=q.device)[:, None] + (S - T) >= torch.arange(S, device=q.device)
        s = s.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ v).to(q.dtype)


# (B, H, Hkv, T, S, D, causal): GQA, several 16-blocks with ragged ends, T < S (a query chunk
# after a context), T > S (queries that see nothing), a non-power-of-two head dim, length 1.
CASES = [(1, 2, 1, 5, 5, 16, True), (2, 4, 2, 17, 17, 16, True), (1, 2, 2, 3, 20, 24, True),
         (1, 2, 1, 9, 4, 16, True), (1, 3, 1, 7, 11, 16, False), (1, 1, 1, 1, 1, 16, True)]


def _qkv(B, H, Hk, T, S, D, dtype, device):
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(B, H, T, D), make(B, Hk, S, D), make(B, Hk, S, D)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hk{}T{}S{}D{}{}".format(*c[:6], "c" if c[6] else ""))
def test_flash_reference_matches_dense(case):
    B, H, Hk, T, S, D, causal = case
    q, k, v = _qkv(B, H, Hk, T, S, D, torch.float32, "cpu")
    do = torch.randn(B, H, T, D)
    results = []
    for fn in (flash_attention_reference, dense_attention):
        (fn(q, k, v, causal) * do).sum().backward()
        results.append([fn(q, k, v, causal), *grads(q, k, v)])
    for name, a, e in zip(("o", "dq", "dk", "dv"), *results, strict=True):
        assert_close(a, e, 1e-5, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hk{}T{}S{}D{}{}".format(*c[:6], "c" if c[6] else ""))
def test_flash_triton_matches_reference(triton_backend, device, dtype, case):
    B, H, Hk, T, S, D, causal = case
    q, k, v = _qkv(B, H, Hk, T, S, D, dtype, device)
    do = torch.randn(B, H, T, D, device=device)
    results = []
    for fn in (flash_attention_triton, flash_attention_reference):
        o = fn(q, k, v, causal)
        (o.float() * do).sum().backward()
        results.append([o, *grads(q, k, v)])
    for name, a, e in zip(("o", "dq", "dk", "dv"), *results, strict=True):
        assert_close(a, e, TOL[dtype] * (1 if name == "o" else 2), name)


def test_flash_triton_strided_inputs_and_scale(triton_backend, device):
    """q/k/v as transposed views of [B, T, H, D] projections, and an explicit scale."""
    qkv = torch.randn(2, 9, 3, 2, 16, device=device)  # [B, T, (q, k, v), H, D]
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert_close(flash_attention_triton(q, k, v, True, 0.3), dense_attention(q, k, v, True, 0.3),
                 TOL[torch.float32], "o")


def _paged_problem(B, H, Hk, D, page, blocks, lens, dtype, device):
    k_cache = torch.randn(blocks, page, Hk, D, device=device, dtype=dtype)
    v_cache = torch.randn(blocks, page, Hk, D, device=device, dtype=dtype)
    max_blocks = max(-(-n // page) for n in lens) + 1
    tables = torch.stack([torch.randperm(blocks, device=device)[:max_blocks] for _ in lens]).int()
    for b, n in enumerate(lens):
        tables[b, -(-n // page):] = -1  # unused entries: never read
    q = torch.randn(B, H, D, device=device, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, device=device, dtype=torch.int32)


def _paged_dense(q, k_cache, v_cache, tables, lens):
    """Per sequence: gather its positions one by one, then dense attention of its one query."""
    page = k_cache.shape[1]
    outs = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device=q.device)
        blocks = tables[b][pos // page].long()
        k = k_cache[blocks, pos % page].transpose(0, 1)[None]  # [1, Hk, n, D]
        v = v_cache[blocks, pos % page].transpose(0, 1)[None]
        outs.append(dense_attention(q[b][None, :, None], k, v, False)[0, :, 0])
    return torch.stack(outs)


PAGED = [  # (B, H, Hkv, D, page, blocks, context lengths, splits)
    (3, 4, 2, 16, 5, 12, [1, 17, 30], 1),
    (3, 4, 2, 16, 5, 12, [1, 17, 30], 3),
    (2, 3, 1, 24, 16, 4, [0, 40], 2),   # an empty context; head dim 24; MQA
    (1, 2, 2, 16, 4, 6, [21], None),
]


@pytest.mark.parametrize("case", PAGED, ids=lambda c: f"lens{c[6]}-splits{c[7]}")
def test_paged_reference_matches_dense(case):
    B, H, Hk, D, page, blocks, lens, _ = case
    q, kc, vc, tables, cl = _paged_problem(B, H, Hk, D, page, blocks, lens, torch.float32, "cpu")
    assert_close(paged_decode_attention_reference(q, kc, vc, tables, cl), _paged_dense(q, kc, vc, tables, cl),
                 1e-5, "o")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PAGED, ids=lambda c: f"lens{c[6]}-splits{c[7]}")
def test_paged_triton_matches_reference(triton_backend, device, dtype, case):
    B, H, Hk, D, page, blocks, lens, splits = case
    q, kc, vc, tables, cl = _paged_problem(B, H, Hk, D, page, blocks, lens, dtype, device)
    got = paged_decode_attention_triton(q, kc, vc, tables, cl, num_splits=splits)
    want = paged_decode_attention_reference(q, kc, vc, tables, cl)
    assert_close(got, want, TOL[dtype], "o")
    assert got[torch.tensor(lens) == 0].abs().sum() == 0
