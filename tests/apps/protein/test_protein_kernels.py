"""The kernels the Evoformer uses (biased masked softmax, LayerNorm) as Triton kernels against
their torch references, inside a real Evoformer block: forward and every gradient. On CPU the
Triton kernels run under TRITON_INTERPRET=1 (set by the root conftest), so shapes stay tiny."""
from __future__ import annotations

import pytest
import torch

from apps.protein.model.dap import Axial
from apps.protein.model.evoformer import EvoformerBlock, EvoformerConfig
from phalanx.testing import check, rel_diff, rounding_rtol

triton = pytest.importorskip("triton")


def _run(block, m, z, msa_mask, pair_mask):
    m_out, z_out = block(m, z, msa_mask, pair_mask, Axial())
    (m_out.square().sum() + z_out.square().sum()).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    return m_out.detach(), z_out.detach(), grads


@pytest.mark.slow  # the Triton interpreter: ~70 s under load on 2 shared cores
def test_evoformer_block_triton_kernels_match_reference():
    from phalanx_kernels import use_backend

    torch.manual_seed(0)
    cfg = EvoformerConfig(c_m=8, c_z=4, heads_msa=2, c_hidden_msa=4, heads_pair=2, c_hidden_pair=4,
                          c_hidden_mul=4, c_hidden_opm=2, transition_n=2, dropout_msa_row=0.0, dropout_pair=0.0)
    block = EvoformerBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m, z = torch.randn(1, 3, 6, 8), torch.randn(1, 6, 6, 4)
    msa_mask = torch.ones(1, 3, 6)
    msa_mask[0, 2, 4:] = 0  # padded positions: masked keys
    seq = torch.tensor([[1, 1, 1, 1, 1, 0.0]])
    pair_mask = seq[:, :, None] * seq[:, None, :]
    want = _run(block, m, z, msa_mask, pair_mask)
    with use_backend("triton"):
        got = _run(block, m, z, msa_mask, pair_mask)
    tol = rounding_rtol(torch.float32, 6 * 6 * 3)
    check(rel_diff(got[0], want[0]), tol, "MSA output")
    check(rel_diff(got[1], want[1]), tol, "pair output")
    # The LayerNorm bias before the row attention's pair bias shifts whole softmax rows: its true
    # gradient is 0 and both runs hold rounding noise, compared on the largest gradient's scale.
    biggest = max(g.abs().max().item() for g in want[2].values())
    real = {k: g for k, g in want[2].items() if g.abs().max() > 1e-6 * biggest}
    assert set(want[2]) - set(real) == {"row_attn.norm_z.bias"}
    assert got[2]["row_attn.norm_z.bias"].abs().max() < 1e-6 * biggest
    check(rel_diff({k: got[2][k] for k in real}, real), tol, "parameter gradients")
