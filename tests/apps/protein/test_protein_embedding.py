"""The input embedder's optional crop-position feature (model.crop_position_bins): off, residues of
the same type in a single-sequence crop start identical (AlphaFold); on, every position differs,
counted from the crop's first residue (so shifting the residue numbering changes nothing)."""
from __future__ import annotations

import torch

from apps.protein.model.alphafold import InputEmbedder, ModelConfig, crop_position_one_hot


def _single_sequence_inputs(aatype: torch.Tensor, first_index: int):
    """One crop, one MSA row (the query), residue numbering starting at first_index."""
    n = aatype.shape[0]
    target = torch.cat([torch.zeros(n, 1), torch.nn.functional.one_hot(aatype, 21).float()], -1)[None]
    msa = torch.zeros(1, 1, n, 49)
    msa[0, 0, torch.arange(n), aatype] = 1.0
    return target, torch.arange(first_index, first_index + n)[None], msa


def test_crop_position_one_hot_counts_from_the_crop_start_and_clips():
    index = torch.tensor([[17, 18, 19, 25, 40]])
    got = crop_position_one_hot(index, 10).argmax(-1)
    assert got.tolist() == [[0, 1, 2, 8, 9]]     # 25 - 17 = 8; 40 - 17 = 23 clipped to 9


def test_identical_residues_differ_only_with_the_position_feature():
    torch.manual_seed(0)
    aatype = torch.zeros(12, dtype=torch.long)   # twelve alanines
    inputs = _single_sequence_inputs(aatype, first_index=5)
    plain = InputEmbedder(ModelConfig(c_m=8, c_z=4, crop_position_bins=0))
    m, _ = plain(*inputs)
    # AlphaFold's MSA embedding of a homopolymer: every column the same (bit-identical).
    assert torch.equal(m[0, 0], m[0, 0, :1].expand(12, -1))

    torch.manual_seed(0)
    with_position = InputEmbedder(ModelConfig(c_m=8, c_z=4, crop_position_bins=16))
    m_pos, z_pos = with_position(*inputs)
    rows = m_pos[0, 0]
    gaps = (rows[:, None] - rows[None]).norm(dim=-1) + torch.eye(12)
    assert gaps.min() > 1e-3                       # every residue distinguishable
    # Only the MSA gets the feature; the pair is AlphaFold's (same weights: same seed, same order).
    _, z_plain = plain(*inputs)
    assert torch.equal(z_pos, z_plain)
    # Counted from the crop's first residue: renumbering the chain leaves the embedding unchanged.
    m_shift, _ = with_position(*_single_sequence_inputs(aatype, first_index=300))
    assert torch.equal(m_shift, m_pos)
