"""Structural violation loss (AF2 supplement 1.9.11) against hand computations: an ideal peptide
costs nothing, a stretched peptide bond / a clash cost what the formula says, gradients push
clashing atoms apart."""
from __future__ import annotations

import math

import pytest
import torch

from apps.protein import constants as rc
from apps.protein import violations as v
from apps.protein.sidechains import ideal_tables

GLY = rc.THREE.index("GLY")


@pytest.fixture(scope="module")
def tables():
    return ideal_tables()


def _place(a, b, c, length, angle_deg, torsion_deg):
    """NeRF: the point d with |cd| = length, angle bcd and dihedral abcd as given."""
    angle, torsion = math.radians(angle_deg), math.radians(torsion_deg)
    bc = (c - b) / (c - b).norm()
    n = torch.linalg.cross(b - a, bc)
    n = n / n.norm()
    m = torch.stack([bc, torch.linalg.cross(n, bc), n], -1)
    d2 = torch.tensor([-length * math.cos(angle), length * math.sin(angle) * math.cos(torsion),
                       length * math.sin(angle) * math.sin(torsion)], dtype=a.dtype)
    return c + m @ d2


def ideal_strand(n_res: int = 6) -> torch.Tensor:
    """[1, L, 14, 3] glycines with literature backbone geometry (C-N 1.329 A, CA-C-N and C-N-CA at
    AlphaFold's mean cosines), trans peptides and extended phi/psi."""
    ca_c_n = math.degrees(math.acos(v.CA_C_N_COS))
    c_n_ca = math.degrees(math.acos(v.C_N_CA_COS))
    n = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    ca = torch.tensor([1.458, 0.0, 0.0], dtype=torch.float64)
    c = ca + 1.525 * torch.tensor([math.cos(math.radians(180 - 111.2)), math.sin(math.radians(180 - 111.2)), 0.0],
                                  dtype=torch.float64)
    x = torch.zeros(1, n_res, 14, 3, dtype=torch.float64)
    phi, psi = -120.0, 130.0
    for i in range(n_res):
        x[0, i, 0], x[0, i, 1], x[0, i, 2] = n, ca, c
        x[0, i, 3] = _place(n, ca, c, 1.231, 120.5, psi + 180)
        nxt = _place(n, ca, c, 1.329, ca_c_n, psi)
        ca_next = _place(ca, c, nxt, 1.458, c_n_ca, 180.0)
        c_next = _place(c, nxt, ca_next, 1.525, 111.2, phi)
        n, ca, c = nxt, ca_next, c_next
    return x


def batch_for(n_res: int, residue_index=None):
    ri = torch.arange(n_res) if residue_index is None else torch.tensor(residue_index)
    return {"aatype": torch.full((1, n_res), GLY), "residue_index": ri[None], "seq_mask": torch.ones(1, n_res)}


def test_ideal_peptide_has_no_violation(tables):
    x = ideal_strand()
    loss, parts = v.structural_violations(x, batch_for(6), tables)
    assert parts["mask"].sum() == 5
    assert loss.item() == 0.0
    m = v.violation_metrics(x, batch_for(6), tables)[0]
    assert m == {"bond_violations": 0.0, "angle_violations": 0.0, "clashing_atoms_between": 0.0,
                 "clashing_atoms_within": 0.0, "violating_residue_share": 0.0, "extreme_ca_ca_share": 0.0}


def test_stretched_peptide_bond_costs_the_excess_over_12_sd(tables):
    x = ideal_strand()
    c, n_next = x[0, 2, 2], x[0, 3, 0]
    delta = 0.3
    x[0, 3:] += delta * (n_next - c) / (n_next - c).norm()    # angles unchanged, one bond longer
    loss, parts = v.structural_violations(x, batch_for(6), tables)
    length = math.sqrt((1.329 + delta) ** 2 + 1e-6)          # the norm's own epsilon, as AlphaFold's
    expected_bond = math.sqrt(1e-6 + (length - 1.329) ** 2) - 12 * 0.014
    assert parts["bond_c_n"][0, 2].item() == pytest.approx(expected_bond, abs=1e-9)
    assert loss.item() == pytest.approx(expected_bond / (5 + 1e-6), abs=1e-9)
    m = v.violation_metrics(x, batch_for(6), tables)[0]
    assert (m["bond_violations"], m["angle_violations"], m["violating_residue_share"]) == (1.0, 0.0, 2 / 6)
    # a gap in the numbering there: no peptide bond is expected, so nothing of it to violate, but
    # C and N 1.63 A apart are then a clash (C + N radii 3.25 A, less the 1.5 A tolerance)
    gapped = batch_for(6, [0, 1, 2, 10, 11, 12])
    loss, parts = v.structural_violations(x, gapped, tables)
    assert parts["mask"][0, 2] == 0 and parts["mask"].sum() == 4
    assert loss.item() == pytest.approx(2 * (1.75 - length) / 24, abs=1e-6)


def test_bond_before_proline_uses_the_cis_value(tables):
    x = ideal_strand()
    batch = batch_for(6)
    batch["aatype"][0, 3] = v.PRO
    bb = v.backbone_violations(x, torch.ones(1, 6, 14, dtype=x.dtype), batch["residue_index"], batch["aatype"])
    # 1.329 against 1.341 +- 12 x 0.016: well inside, and a 0.4 A stretch costs 0.4 + 0.012 - 0.192
    assert bb["bond_c_n"][0, 2].item() == 0.0
    x[0, 3:] += 0.4 * (x[0, 3, 0] - x[0, 2, 2]) / (x[0, 3, 0] - x[0, 2, 2]).norm()
    bb = v.backbone_violations(x, torch.ones(1, 6, 14, dtype=x.dtype), batch["residue_index"], batch["aatype"])
    length = math.sqrt((1.329 + 0.4) ** 2 + 1e-6)
    assert bb["bond_c_n"][0, 2].item() == pytest.approx(math.sqrt(1e-6 + (length - 1.341) ** 2) - 12 * 0.016, abs=1e-9)


def far_apart_glycines(gap: float) -> torch.Tensor:
    """Two glycines whose atoms are all >= 10 A apart except O of the first and N of the second."""
    a = torch.tensor([[0, 0, 0], [10, 0, 0], [20, 0, 0], [30, 0, 0]], dtype=torch.float64)
    b = torch.tensor([[30, 0, gap], [30, 10, gap], [30, 20, gap], [30, 30, gap]], dtype=torch.float64)
    x = torch.zeros(1, 2, 14, 3, dtype=torch.float64)
    x[0, 0, :4], x[0, 1, :4] = a, b
    return x


def test_clash_between_residues_hand_computed(tables):
    x = far_apart_glycines(1.0).requires_grad_(True)
    batch = batch_for(2, [0, 5])                             # not neighbours: no bond terms
    loss, parts = v.structural_violations(x, batch, tables)
    pair = (1.52 + 1.55 - 1.5) - 1.0                         # O + N radii, minus the tolerance, minus the distance
    assert loss.item() == pytest.approx(2 * pair / 8, abs=1e-6)   # counted for both atoms, over 8 atoms
    assert parts["between_clash"].sum().item() == 2
    assert v.violation_metrics(x.detach(), batch, tables)[0]["clashing_atoms_between"] == 2.0
    loss.sum().backward()
    grad = x.grad[0]
    assert grad[0, 3, 2].item() > 0 and grad[1, 0, 2].item() < 0    # descent pushes O down, N up: apart
    assert grad[0, 3, 2].item() == pytest.approx(2 / 8, abs=1e-6)
    others = grad.clone()
    others[0, 3], others[1, 0] = 0, 0
    assert others.abs().max().item() == 0.0
    assert v.structural_violations(far_apart_glycines(1.6), batch, tables)[0].item() == 0.0  # 1.6 > 1.57


def test_peptide_bond_and_disulfide_are_not_clashes(tables):
    x = far_apart_glycines(1.0)
    x[0, 1, 0] = x[0, 0, 2] + torch.tensor([0.0, 0.0, 1.0], dtype=x.dtype)   # N(2) 1 A from C(1)
    _, parts = v.structural_violations(x, batch_for(2, [0, 1]), tables)
    assert parts["between_loss"].sum().item() == 0.0
    cys = torch.zeros(1, 2, 14, 3, dtype=torch.float64)
    cys[0, 0, :6] = torch.arange(6, dtype=torch.float64)[:, None] * torch.tensor([10.0, 0, 0], dtype=torch.float64)
    cys[0, 1, :6] = cys[0, 0, :6] + torch.tensor([0.0, 50.0, 0.0], dtype=torch.float64)
    cys[0, 1, 5] = cys[0, 0, 5] + torch.tensor([0.0, 2.05, 0.0], dtype=torch.float64)   # SG-SG bond 2.05 A
    batch = {"aatype": torch.full((1, 2), v.CYS), "residue_index": torch.tensor([[0, 9]]), "seq_mask": torch.ones(1, 2)}
    _, parts = v.structural_violations(cys, batch, tables)
    assert parts["between_loss"].sum().item() == 0.0


def test_within_residue_clash_only_for_atoms_three_bonds_apart(tables):
    far = v.nonbonded_within(tables)
    assert far[GLY, 0, 3] == 1 and far[GLY, 1, 3] == 0 and far[GLY, 0, 2] == 0   # N-O yes; CA-O, N-C no
    leu = rc.THREE.index("LEU")
    names = rc.atom14_names("LEU")
    assert far[leu, names.index("N"), names.index("CD1")] == 1
    assert far[leu, names.index("CB"), names.index("CD1")] == 0
    pro = rc.atom14_names("PRO")
    assert far[v.PRO, pro.index("N"), pro.index("CD")] == 0 and far[v.PRO, pro.index("C"), pro.index("CG")] == 1
    x = far_apart_glycines(5.0)[:, :1]
    x[0, 0, 3] = x[0, 0, 0] + torch.tensor([0.0, 1.0, 0.0], dtype=x.dtype)   # O 1 A from N of its own residue
    loss, parts = v.structural_violations(x, batch_for(1), tables)
    pair = (1.52 + 1.55 - 1.5) - 1.0
    assert loss.item() == pytest.approx(4 * pair / 4, abs=1e-6)   # AlphaFold's symmetric 14x14 sum, over 4 atoms
    assert parts["within_clash"].sum().item() == 2


def test_bent_angle_costs_the_cosine_excess_over_12_sd():
    """CA-C-N opened to a cosine 0.5 below AlphaFold's mean; C-N-CA at its mean."""
    cos1 = v.CA_C_N_COS - 0.5
    c_n_unit = torch.tensor([-cos1, math.sqrt(1 - cos1 ** 2), 0.0], dtype=torch.float64)
    n_ca_unit = v.C_N_CA_COS * -c_n_unit + math.sqrt(1 - v.C_N_CA_COS ** 2) * torch.tensor([0.0, 0, 1], dtype=torch.float64)
    x = torch.zeros(1, 2, 14, 3, dtype=torch.float64)
    x[0, 0, 1] = torch.tensor([-1.525, 0.0, 0.0])             # CA(1); C(1) at the origin
    x[0, 1, 0] = 1.329 * c_n_unit                              # N(2)
    x[0, 1, 1] = x[0, 1, 0] + 1.458 * n_ca_unit                # CA(2)
    bb = v.backbone_violations(x, torch.ones(1, 2, 14, dtype=x.dtype), torch.tensor([[0, 1]]), torch.tensor([[GLY, GLY]]))
    assert bb["angle_ca_c_n"][0, 0].item() == pytest.approx(math.sqrt(1e-6 + 0.25) - 12 * 0.0311, abs=1e-5)
    assert bb["angle_c_n_ca"][0, 0].item() == 0.0 and bb["bond_c_n"][0, 0].item() == 0.0


def test_a_deposited_structure_has_no_backbone_violation_and_few_clashes(tables):
    from tests.apps.protein.protein_tiny import real_batch

    batch = real_batch(crop=48, batch=1)
    x, mask = batch["atom14_gt_positions"].double(), batch["atom14_gt_exists"]
    m = v.violation_metrics(x, batch, tables, mask)[0]
    assert m["bond_violations"] == 0 and m["angle_violations"] == 0 and m["extreme_ca_ca_share"] == 0
    assert m["clashing_atoms_between"] <= 2 and m["clashing_atoms_within"] == 0
    # without the mask, the unobserved atoms (at the origin) would be counted as clashing
    assert v.violation_metrics(x, batch, tables)[0]["clashing_atoms_between"] >= m["clashing_atoms_between"]


def test_violation_weight_adds_the_term_and_trains_the_structure():
    from apps.protein.losses import LossWeights, alphafold_loss
    from apps.protein.scoring import score_crops
    from tests.apps.protein.protein_tiny import real_batch, tiny_model

    model, batch = tiny_model(), real_batch(crop=16, batch=1)
    out = model(**batch, recycles=0)
    tables = {"default_frames": model.default_frames, "atom14_local": model.atom14_local}
    _, terms = alphafold_loss(out, batch, tables, LossWeights())
    assert "violation" not in terms                        # initial training: weight 0, not computed
    total, terms = alphafold_loss(out, batch, tables, LossWeights(violation=1.0))
    expected = v.structural_violations(out["atom14"], batch, tables)[0].mean()
    assert terms["violation"].item() == pytest.approx(expected.item()) and expected.item() > 0
    terms["violation"].backward()
    grads = [p.grad for p in model.structure_module.parameters() if p.grad is not None]
    assert grads and max(g.abs().max().item() for g in grads) > 0
    feats = {k: t[0] for k, t in batch.items()}
    scored = score_crops(model, [("2q2k_A", feats)], recycles=0)["2q2k_A"]
    assert {"bond_violations", "clashing_atoms_between", "violating_residue_share"} <= scored.keys()
