"""Metrics against values computed another way: biotite's superposition, RMSD, lDDT and TM-score on
a real chain and a perturbed copy, and hand-built structures with known answers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from apps.protein.data_sets import structure_path
from apps.protein.io import read_structure
from apps.protein.metrics import gdt_ts, kabsch, lddt, rmsd, tm_score


@pytest.fixture(scope="module")
def pair():
    """(true CA, perturbed + rotated + shifted copy): 4i6p A, 84 observed residues."""
    chain = read_structure(structure_path("4i6p"), "A")
    seen = chain.atom37_mask[:, 1] > 0
    true = torch.as_tensor(chain.atom37[seen, 1], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    noisy = true + torch.randn(true.shape, generator=g, dtype=torch.float64) * 1.5
    noisy[:20] += torch.tensor([6.0, 0.0, 0.0], dtype=torch.float64)  # one end clearly misplaced
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.linalg.det(q))
    pred = noisy @ q.T + torch.tensor([10.0, -4.0, 7.0], dtype=torch.float64)
    return true, pred


def _atoms(xyz: torch.Tensor):
    import biotite.structure as struc

    arr = struc.AtomArray(len(xyz))
    arr.coord = xyz.numpy().astype(np.float32)
    arr.atom_name[:] = "CA"
    arr.element[:] = "C"
    arr.res_id = np.arange(1, len(xyz) + 1)
    arr.res_name[:] = "ALA"
    arr.chain_id[:] = "A"
    return arr


def test_rmsd_matches_biotite_superposition(pair):
    import biotite.structure as struc

    true, pred = pair
    mask = torch.ones(len(true), dtype=torch.float64)
    fitted, _ = struc.superimpose(_atoms(true), _atoms(pred))
    want = float(struc.rmsd(_atoms(true), fitted))
    assert math.isclose(rmsd(pred, true, mask).item(), want, rel_tol=1e-4)  # biotite works in float32
    rot, _ = kabsch(pred, true, mask)
    assert math.isclose(torch.linalg.det(rot).item(), 1.0, rel_tol=1e-9)


def test_lddt_matches_biotite(pair):
    import biotite.structure as struc

    true, pred = pair
    mask = torch.ones(len(true), dtype=torch.float64)
    # One atom per residue: biotite's exclude_same_residue only drops the self-pair, as ours does.
    want = float(struc.lddt(_atoms(true), pred.numpy().astype(np.float32)))
    assert abs(lddt(pred, true, mask).item() - want) < 1e-3  # float32 distances in biotite
    assert lddt(true, true, mask).item() == pytest.approx(1.0)


def test_tm_score_is_at_least_biotites_on_the_kabsch_fit(pair):
    import biotite.structure as struc

    true, pred = pair
    mask = torch.ones(len(true), dtype=torch.float64)
    fitted, _ = struc.superimpose(_atoms(true), _atoms(pred))
    idx = np.arange(len(true))
    kabsch_tm = float(struc.tm_score(_atoms(true), fitted, idx, idx, reference_length="reference"))
    ours = tm_score(pred, true, mask).item()
    # Ours searches superpositions (TM-score's heuristic), so it is at least the plain fit's value.
    assert kabsch_tm - 1e-4 <= ours <= 1.0
    assert ours - kabsch_tm < 0.15
    assert tm_score(true, true, mask).item() == pytest.approx(1.0)


def test_hand_built_two_domain_answers():
    """A 40-residue helix-like chain; the prediction has its second half moved 100 A away.
    A rigid motion keeps distances, and every predicted first-half to second-half distance exceeds
    the true one by more than 2 x 8 A, so no superposition brings residues of both halves within 8 A:
    GDT-TS = 0.5 exactly; lDDT counts only the
    intra-half pairs, TM-score = (20 + 20 / (1 + (30 / d0)^2)) / 40 to within the search."""
    t = torch.arange(40, dtype=torch.float64)
    true = torch.stack([2.3 * torch.cos(t * 1.75), 2.3 * torch.sin(t * 1.75), 1.5 * t], -1)
    pred = true.clone()
    pred[20:] += torch.tensor([100.0, 0.0, 0.0], dtype=torch.float64)
    mask = torch.ones(40, dtype=torch.float64)
    assert gdt_ts(pred, true, mask).item() == pytest.approx(0.5)
    d0 = 1.24 * (40 - 15) ** (1 / 3) - 1.8
    want_tm = (20 + 20 / (1 + (100 / d0) ** 2)) / 40
    assert tm_score(pred, true, mask).item() == pytest.approx(want_tm, abs=0.01)
    # lDDT: pairs within 15 A in the truth; the cross-half ones are all broken.
    d = torch.cdist(true, true)
    close = (d < 15) & ~torch.eye(40, dtype=torch.bool)
    same_half = (t[:, None] < 20) == (t[None, :] < 20)
    want_lddt = (close & same_half).sum().item() / close.sum().item()
    assert lddt(pred, true, mask).item() == pytest.approx(want_lddt)
    assert rmsd(true, true, mask).item() < 1e-6
