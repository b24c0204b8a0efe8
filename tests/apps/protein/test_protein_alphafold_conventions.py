"""Where this recipe once differed from AlphaFold 2 in ways real parameters would expose; each test
fails on the old behaviour: the extra-MSA head width, the recycled distogram, the psi convention,
the renaming of symmetric atoms and the side-chain FAPE frame mask."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from apps.protein import constants as rc
from apps.protein.data_sets import structure_path
from apps.protein.features import ground_truth
from apps.protein.io import read_structure
from apps.protein.losses import pae_loss, renamed_truth, rigid_group_mask
from apps.protein.model import AlphaFold, ModelConfig
from apps.protein.model.alphafold import recycling_distance_one_hot
from apps.protein.rigid import Rigid
from apps.protein.sidechains import atom14_positions, dihedral, group_frames, ideal_tables

CONFIGS = Path(__file__).resolve().parents[3] / "apps" / "protein" / "configs"


def _chain():
    return read_structure(structure_path("2q2k"), "A")


def _truth(chain, start=22, end=70) -> dict[str, torch.Tensor]:
    truth = ground_truth(chain, start, end)
    truth["aatype"] = torch.as_tensor(chain.aatype[start:end]).long()
    truth["seq_mask"] = torch.ones(end - start)
    return {k: v[None] for k, v in truth.items()}


def test_extra_msa_row_attention_is_8_channels_per_head():
    """AlphaFold's extra-MSA stack (c_e = 64, 8 heads) attends with 8 channels per head: its query
    weight is 64 x 64 (this model had 256 x 64, the main stack's 32 per head)."""
    with torch.device("meta"):
        model = AlphaFold(ModelConfig())
    extra, main = model.extra_msa_stack.blocks[0], model.evoformer.blocks[0]
    assert tuple(extra.row_attn.attn.q.weight.shape) == (64, 64) and extra.row_attn.attn.c_hidden == 8
    assert tuple(extra.col_attn.q.weight.shape) == (64, 64)
    assert tuple(main.row_attn.attn.q.weight.shape) == (256, 256)


def test_recycled_distogram_bins_and_the_empty_first_pass():
    """Lower edges 3.25, 4.5, ... 20.75 A (15 bins, the last open); nearer than 3.25 A: no bin."""
    x = torch.tensor([[0.0, 0, 0], [3.0, 0, 0], [3.3, 0, 0], [4.6, 0, 0], [20.8, 0, 0], [40.0, 0, 0]])
    one_hot = recycling_distance_one_hot(x)
    assert one_hot.shape == (6, 6, 15)
    assert one_hot[0, 1].sum() == 0 and one_hot[0, 0].sum() == 0     # 3.0 A and 0 A: in no bin
    assert one_hot[0, 2].argmax() == 0 and one_hot[0, 3].argmax() == 1  # 3.3 A, 4.6 A
    assert one_hot[0, 4].argmax() == 14 and one_hot[0, 5].argmax() == 14
    assert one_hot[1, 3].sum() == 0 and one_hot[2, 4].argmax() == 11  # 1.6 A: no bin; 17.5 A: [17.0, 18.25)
    assert recycling_distance_one_hot(torch.zeros(1, 8, 3)).sum() == 0  # the first pass: all zeros


def test_psi_follows_alphafold():
    """The psi torsion is AlphaFold's (N-CA-C-O mirrored, about the backbone psi N-CA-C-N(next)),
    and with that angle the psi group places the carbonyl O where it is observed."""
    chain = _chain()
    truth = _truth(chain)
    atom14, mask = truth["atom14_gt_positions"][0], truth["atom14_gt_exists"][0]
    n, ca, c = atom14[:-1, 0], atom14[:-1, 1], atom14[:-1, 2]
    backbone_psi = dihedral(n, ca, c, atom14[1:, 0])
    ok = (mask[:-1, :4].prod(-1) * mask[1:, 0]).bool()
    psi = torch.atan2(*truth["torsion_sin_cos"][0, :-1, 2].unbind(-1))
    gap = torch.remainder(psi - backbone_psi + np.pi, 2 * np.pi) - np.pi
    assert gap[ok].abs().median() < np.radians(10)             # the old convention: ~180 degrees
    # O from AlphaFold's convention: backbone frames, psi = the backbone psi, chis irrelevant.
    tables = ideal_tables()
    torsions = torch.zeros(len(n), 7, 2)
    torsions[..., 1] = 1.0
    torsions[:, 2] = torch.stack([torch.sin(backbone_psi), torch.cos(backbone_psi)], -1)
    frames = Rigid(truth["backbone_rot"][0, :-1], truth["backbone_trans"][0, :-1])
    aatype = truth["aatype"][0, :-1]
    placed = atom14_positions(group_frames(frames, torsions, aatype, tables), aatype, tables)
    o_error = (placed[:, 3] - atom14[:-1, 3]).norm(dim=-1)
    assert o_error[ok].median() < 0.3                          # rotated 180 degrees: ~2 A


def test_psi_default_frame_is_alphafolds():
    """Origin C, x along CA->C, y towards CA - N, expressed in the backbone frame."""
    tables = ideal_tables()
    local = tables["atom14_local"][0]                          # ALA in its backbone frame: N, CA=0, C
    frame = tables["default_frames"][0, 3]
    rot, origin = frame[:3, :3], frame[:3, 3]
    assert torch.allclose(origin, local[2], atol=1e-5)
    x = (local[2] - local[1]) / (local[2] - local[1]).norm()
    assert torch.allclose(rot[:, 0], x, atol=1e-5)
    assert torch.dot(rot[:, 1], local[1] - local[0]) > 0.5     # the old frame's y pointed the other way


def _swap_symmetric(atom14, aatype, residues):
    swap = torch.as_tensor(rc.TABLES["ambiguous_swap"])[aatype]
    out = atom14.clone()
    for i in residues:
        out[i] = atom14[i, swap[i]]
    return out


def test_symmetric_atoms_are_renamed_by_distances():
    """AlphaFold's algorithm 26 compares inter-atom distances, so the naming chosen does not depend
    on where the prediction sits: a rotated, shifted copy of the truth with some symmetric side
    chains named the other way gets exactly those residues renamed."""
    truth = _truth(_chain())
    aatype = truth["aatype"][0]
    ambiguous = torch.as_tensor(rc.TABLES["ambiguous_swap"])[aatype] != torch.arange(14)
    observed = truth["atom14_gt_exists"][0].bool()
    symmetric = [i for i in range(len(aatype)) if ambiguous[i].any() and observed[i][ambiguous[i]].all()]
    assert len(symmetric) >= 4
    flipped = symmetric[::2]
    angle = torch.tensor(2.0)
    rot = torch.tensor([[torch.cos(angle), -torch.sin(angle), 0], [torch.sin(angle), torch.cos(angle), 0], [0, 0, 1.0]])
    moved = _swap_symmetric(truth["atom14_gt_positions"][0], aatype, flipped) @ rot.T + torch.tensor([40.0, -25, 10])
    pred = moved * truth["atom14_gt_exists"][0][..., None]
    chosen = renamed_truth(pred[None], truth)[0]
    for i in symmetric:
        want = truth["atom14_alt_gt_positions"][0, i] if i in flipped else truth["atom14_gt_positions"][0, i]
        assert torch.equal(chosen[i], want), i


def test_sidechain_frames_exist_only_where_atoms_were_observed():
    """A lysine whose atoms past CB are unobserved has backbone and psi frames but no chi frames
    (the old mask took chi1-4 from the residue type)."""
    chain = _chain()
    lys = next(i for i in range(22, 70) if chain.sequence[i] == "K" and chain.atom37_mask[i].sum() == 9)
    for name in ("CG", "CD", "CE", "NZ"):
        chain.atom37_mask[lys, rc.ATOM37_INDEX[name]] = 0
    mask = rigid_group_mask(_truth(chain))[0]
    assert mask[lys - 22].tolist() == [1, 0, 0, 1, 0, 0, 0, 0]
    full = next(i for i in range(22, 70) if chain.sequence[i] == "K" and chain.atom37_mask[i].sum() == 9)
    assert mask[full - 22].tolist() == [1, 0, 0, 1, 1, 1, 1, 1]


def test_pae_loss_bins_the_aligned_error():
    """Perfect frames: every pair's error is in bin 0, so logits for bin 0 give ~0 loss and logits
    for bin 5 give ~their margin."""
    truth = _truth(_chain(), 22, 30)
    out = {"frames_rot": truth["backbone_rot"][None], "frames_trans": truth["backbone_trans"][None]}
    logits = torch.zeros(1, 8, 8, 64)
    logits[..., 0] = 30.0
    assert pae_loss({**out, "pae_logits": logits}, truth) < 1e-6
    logits = torch.zeros(1, 8, 8, 64)
    logits[..., 5] = 30.0
    assert abs(float(pae_loss({**out, "pae_logits": logits}, truth)) - 30.0) < 1e-3


def test_alphafold2_config_names_a_file_it_can_load():
    """alphafold2.yaml has no template stack, so it must not suggest params_model_1/2 (whose
    predictions lean on templates); its pae_head matches a _ptm file."""
    text = (CONFIGS / "alphafold2.yaml").read_text()
    files = re.findall(r"--params \S*params_model_(\d)(_ptm)?\.npz", text)
    assert files and all(number not in ("1", "2") for number, _ in files)
    from apps.protein.config import load_recipe

    cfg = load_recipe(str(CONFIGS / "alphafold2.yaml"), [])
    assert cfg.model.pae_head == all(ptm for _, ptm in files)


def test_a_misspelt_input_is_refused():
    """The model takes a training batch (labels are passed along and left), but a keyword that is
    neither input nor label stops with its name instead of being swallowed."""
    import pytest

    from protein_tiny import real_batch, tiny_model

    batch = real_batch(crop=8, clusters=2, extra=2, batch=1)
    with pytest.raises(TypeError, match="recyles"):
        tiny_model()(**batch, recyles=0)
