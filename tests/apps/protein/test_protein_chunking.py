"""Chunking beyond attention: the outer product mean and both triangle multiplications computed
`chunk_size` residue rows at a time equal the whole computation (outputs and gradients, to fp32
rounding), and their largest intermediate and saved activations shrink.

Tolerance: the chunked einsums sum the same terms in the same order per output element; only the
matmul blocking differs, so `rounding_rtol(fp32, n)` with n the longest reduction (the weight
gradients' sum over batch x residues x residues)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apps.protein.model.dap import Axial
from apps.protein.model.evoformer import (EvoformerBlock, EvoformerConfig, MSARowAttentionWithPairBias,
                                          OuterProductMean, TriangleAttention, TriangleMultiplication, chunked)
from phalanx.testing import check, rel_diff, rounding_rtol

B, S, R = 2, 5, 11   # R = 11 with chunks of 4: three chunks, the last one short


def _cfg(chunk_size=None) -> EvoformerConfig:
    return EvoformerConfig(c_m=12, c_z=8, heads_msa=2, c_hidden_msa=4, heads_pair=2, c_hidden_pair=4,
                           c_hidden_mul=6, c_hidden_opm=3, transition_n=2, chunk_size=chunk_size,
                           dropout_msa_row=0.0, dropout_pair=0.0)  # deterministic training-mode forward


def _randomise(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Break the zero / gating initialisation so every parameter shapes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(B, S, R, 12, generator=g)
    z = torch.randn(B, R, R, 8, generator=g)
    msa_mask = (torch.rand(B, S, R, generator=g) > 0.2).float()
    pair_mask = (torch.rand(B, R, R, generator=g) > 0.1).float()
    return m, z, msa_mask, pair_mask


def _run(module, call, chunk_size):
    """Output and the gradients (inputs and parameters) of a fixed random projection of it."""
    module.zero_grad()
    m, z, msa_mask, pair_mask = _inputs()
    m.requires_grad_(), z.requires_grad_()
    out = call(module, m, z, msa_mask, pair_mask, chunk_size)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(2)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return [o.detach() for o in out], {"m": m.grad, "z": z.grad, **{k: v for k, v in grads.items()}}


def _opm(module, m, z, msa_mask, pair_mask, c):
    return module(m, msa_mask, Axial(), c)


def _tri(module, m, z, msa_mask, pair_mask, c):
    return module(z, pair_mask, Axial(), c)


def _row_attn(module, m, z, msa_mask, pair_mask, c):
    return module(m, z, msa_mask, Axial(), c)


def _block(module, m, z, msa_mask, pair_mask, c):
    module.chunk_size = c
    return module(m, z, msa_mask, pair_mask, Axial())


CASES = {
    "outer_product_mean": (lambda: OuterProductMean(_cfg(), 12), _opm),
    "triangle_outgoing": (lambda: TriangleMultiplication(_cfg(), outgoing=True), _tri),
    "triangle_incoming": (lambda: TriangleMultiplication(_cfg(), outgoing=False), _tri),
    "triangle_attention_start": (lambda: TriangleAttention(_cfg(), starting=True), _tri),
    "triangle_attention_end": (lambda: TriangleAttention(_cfg(), starting=False), _tri),
    "msa_row_attention": (lambda: MSARowAttentionWithPairBias(_cfg(), 12, 4), _row_attn),
    "evoformer_block": (lambda: EvoformerBlock(_cfg()), _block),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk", [1, 4])
def test_chunked_equals_whole(name, chunk):
    build, call = CASES[name]
    module = _randomise(build())
    whole_out, whole_grads = _run(module, call, None)
    part_out, part_grads = _run(module, call, chunk)
    tol = rounding_rtol(torch.float32, B * R * R * S)
    check(rel_diff(part_out, whole_out), tol, f"{name} output, chunk {chunk}")
    used = {k: g for k, g in whole_grads.items() if g is not None}
    assert set(used) == {k for k, g in part_grads.items() if g is not None}
    # The bias of the LayerNorm before a pair-bias projection shifts every logit of a row equally
    # (the softmax ignores it): its true gradient is 0 and both runs hold rounding noise. Compared
    # on the scale of the largest gradient instead (as in test_protein_dap.py).
    biggest = max(g.abs().max().item() for g in used.values())
    noise = {k for k, g in used.items() if g.abs().max() < 1e-5 * biggest}
    assert noise <= {"row_attn.norm_z.bias", "norm_z.bias"}, noise
    for k in noise:
        assert part_grads[k].abs().max() < 1e-5 * biggest, k
        del used[k]
    check(rel_diff({k: part_grads[k] for k in used}, used), tol, f"{name} gradients, chunk {chunk}")
    # and the computation is not trivially zero
    assert all(o.abs().max() > 1e-3 for o in whole_out)


def test_chunked_covers_every_row_once():
    seen = []
    out = chunked(lambda part: (seen.append((part.start, part.stop)), torch.arange(10)[part])[1], 10, 4, dim=0)
    assert seen == [(0, 4), (4, 8), (8, 12)]
    assert torch.equal(out, torch.arange(10))


class _LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_outer_product_mean_bounds_the_largest_intermediate():
    """Inference (no grad): the [i, j, c*c] outer product exists only `chunk` rows at a time."""
    build, call = CASES["outer_product_mean"]
    module = _randomise(build())
    m, z, msa_mask, pair_mask = _inputs()
    sizes = {}
    for chunk in (None, 1):
        with torch.no_grad(), _LargestTensor() as mode:
            call(module, m, z, msa_mask, pair_mask, chunk)
        sizes[chunk] = mode.largest
    assert sizes[None] == B * R * R * 9                     # the whole product, c_hidden_opm^2 = 9
    assert sizes[1] == B * R * R * 8                        # now the [B, R, R, c_z] result is the largest


def _saved_bytes(module, call, chunk) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    m, z, msa_mask, pair_mask = _inputs()
    z.requires_grad_(), m.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call(module, m, z, msa_mask, pair_mask, chunk)
    return total


@pytest.mark.parametrize("name", ["outer_product_mean", "triangle_outgoing", "triangle_incoming",
                                  "triangle_attention_start", "triangle_attention_end"])
def test_chunking_shrinks_saved_activations(name):
    """Training: the chunks are checkpointed, so what autograd keeps for the backward pass falls
    (OPM: the [i, j, c*c] product is no longer saved; triangle multiplication: the a operand, the
    product and its LayerNorm; triangle attention: the [i, H, j, k] softmax weights)."""
    build, call = CASES[name]
    module = _randomise(build())
    whole, part = _saved_bytes(module, call, None), _saved_bytes(module, call, 4)
    assert part < 0.75 * whole, (whole, part)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size=0: give a positive number"):
        EvoformerConfig(chunk_size=0)
