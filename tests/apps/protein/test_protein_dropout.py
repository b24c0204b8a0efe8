"""AlphaFold's dropout (supplement 1.11.6, algorithm 6): one mask shared along rows (row-wise) or
columns (column-wise), each update of the Evoformer block with its own orientation and rate, the
structure module's 0.1, and nothing in eval mode."""
from __future__ import annotations

import pytest
import torch

from apps.protein.model import AlphaFold, ModelConfig
from apps.protein.model.dap import Axial
from apps.protein.model.evoformer import EvoformerBlock, EvoformerConfig
from apps.protein.model.primitives import SharedDropout
from apps.protein.model.structure import StructureConfig
from protein_tiny import real_batch, tiny_model


@pytest.mark.parametrize("shared_dim", [1, 2])
def test_the_mask_is_shared_along_one_axis_only(shared_dim):
    torch.manual_seed(0)
    drop = SharedDropout(0.25, shared_dim).train()
    x = torch.ones(2, 24, 24, 16)
    y = drop(x)
    assert set(y.unique().tolist()) == {0.0, torch.tensor(1.0 / 0.75).item()}  # kept entries scaled by 1 / (1 - rate)
    first = y.select(shared_dim, 0).unsqueeze(shared_dim)
    assert torch.equal(y, first.expand_as(y))                        # the same mask along shared_dim
    other = 3 - shared_dim                                           # ... and not along the other axis
    assert not torch.equal(y, y.select(other, 0).unsqueeze(other).expand_as(y))
    assert abs((y == 0).float().mean().item() - 0.25) < 0.03          # 2 x 24 x 16 = 768 draws: 4 sd = 0.031
    assert torch.equal(drop.eval()(x), x)


def test_evoformer_block_uses_alphafolds_orientations():
    """MSA row attention: row-wise 0.15; triangle multiplications (both) and the starting-node
    attention: row-wise 0.25; the ending-node attention: column-wise 0.25; nothing else."""
    cfg = EvoformerConfig(c_m=8, c_z=4, heads_msa=2, c_hidden_msa=4, heads_pair=2, c_hidden_pair=4,
                          c_hidden_mul=4, c_hidden_opm=2, transition_n=2)
    block = EvoformerBlock(cfg).train()
    calls = []
    for name, module in block.named_modules():
        if isinstance(module, SharedDropout):
            module.register_forward_hook(lambda mod, args, out, name=name: calls.append((name, mod.rate, mod.shared_dim)))
    m, z = torch.randn(1, 3, 6, 8), torch.randn(1, 6, 6, 4)
    block(m, z, torch.ones(1, 3, 6), torch.ones(1, 6, 6), Axial())
    assert calls == [("drop_msa_row", 0.15, 1), ("drop_pair_row", 0.25, 1), ("drop_pair_row", 0.25, 1),
                     ("drop_pair_row", 0.25, 1), ("drop_pair_col", 0.25, 2)]
    assert StructureConfig().dropout == 0.1 and ModelConfig().evoformer.dropout_pair == 0.25


def test_training_draws_masks_and_eval_is_deterministic():
    from phalanx.device import current_device, to_device

    device = current_device()          # the emulated GPU under PHALANX_EMULATE_GPU=1 (tests/emulated)
    model, batch = tiny_model(dropout=True).to(device), to_device(real_batch(crop=16, batch=1), device)
    with torch.no_grad():
        model.train()
        a, b = model(**batch, recycles=0)["atom37"], model(**batch, recycles=0)["atom37"]
        assert (a - b).abs().max() > 1e-3                         # different masks each pass
        model.eval()
        c, d = model(**batch, recycles=0)["atom37"], model(**batch, recycles=0)["atom37"]
        assert torch.equal(c, d)
        # eval with dropout configured == a model configured without dropout (same weights)
        plain = tiny_model(dropout=False).to(device).eval()
        assert torch.equal(plain(**batch, recycles=0)["atom37"], c)


def test_rates_are_checked():
    with pytest.raises(ValueError, match="dropout_pair"):
        EvoformerConfig(dropout_pair=1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        SharedDropout(-0.1, 1)
