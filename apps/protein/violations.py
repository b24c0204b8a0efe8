"""AlphaFold's structural violation loss and metrics (supplement section 1.9.11).

- Backbone geometry between consecutive residues: the C(i)-N(i+1) peptide bond length and the
  CA(i)-C(i)-N(i+1) and C(i)-N(i+1)-CA(i+1) bond angles (as cosines), each against AlphaFold's
  literature mean (Engh & Huber; the bond before a proline is the cis value), penalised by
  relu(|x - mean| - 12 sd) so that only gross violations cost anything.
- Clashes: two heavy atoms of different residues closer than the sum of their van der Waals
  radii minus 1.5 A (the peptide bond and disulfide SG-SG pairs excluded); within a residue, the
  same for atoms three or more bonds apart. Bond lengths and angles inside a residue are not
  scored: the structure module builds each residue from rigid groups of ideal geometry, so they
  hold by construction.

`structural_violations(atom14, batch)` returns the loss (AlphaFold's sum of the three mean
backbone terms and the per-atom clash sum over the atom count) and the per-item pieces;
`violation_metrics` turns them into counts for evaluation.
"""
from __future__ import annotations

import torch

from apps.protein import constants as rc
from apps.protein.rigid import Rigid
from apps.protein.sidechains import atom14_positions, group_frames

# AlphaFold's literature values (residue_constants): trans / cis (before proline) peptide bond.
C_N_LENGTH, C_N_SD = (1.329, 1.341), (0.014, 0.016)
CA_C_N_COS, CA_C_N_SD = -0.4473, 0.0311     # 116.568 +- 1.995 degrees
C_N_CA_COS, C_N_CA_SD = -0.5203, 0.0353     # 121.352 +- 2.315 degrees
VDW_RADIUS = {"C": 1.7, "N": 1.55, "O": 1.52, "S": 1.8}
TOLERANCE_SD = 12.0         # violation_tolerance_factor
CLASH_TOLERANCE = 1.5       # clash_overlap_tolerance, A
PRO = rc.THREE.index("PRO")
CYS = rc.THREE.index("CYS")


def _vdw_table() -> torch.Tensor:
    """[21, 14]: the van der Waals radius of each atom14 slot of each residue type (0 where empty)."""
    table = torch.zeros(21, 14)
    for r, res in enumerate(rc.THREE):
        for i, name in enumerate(rc.atom14_names(res)):
            if name:
                table[r, i] = VDW_RADIUS[name[0]]
    return table


def _safe_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return torch.sqrt((x ** 2).sum(-1) + eps)


def backbone_violations(atom14, exists, residue_index, aatype) -> dict[str, torch.Tensor]:
    """Per consecutive pair [B, L-1]: the loss of the C-N bond and the two angles, and their mask
    (both residues' atoms present and no gap in the numbering)."""
    ca, c = atom14[:, :-1, 1], atom14[:, :-1, 2]
    n_next, ca_next = atom14[:, 1:, 0], atom14[:, 1:, 1]
    no_gap = (residue_index[:, 1:] - residue_index[:, :-1] == 1).to(atom14.dtype)
    mask = exists[:, :-1, 1] * exists[:, :-1, 2] * exists[:, 1:, 0] * exists[:, 1:, 1] * no_gap
    cis = (aatype[:, 1:] == PRO).to(atom14.dtype)
    length_mean = C_N_LENGTH[0] + cis * (C_N_LENGTH[1] - C_N_LENGTH[0])
    length_sd = C_N_SD[0] + cis * (C_N_SD[1] - C_N_SD[0])
    c_n = _safe_norm(n_next - c)
    c_n_unit = (n_next - c) / c_n[..., None]
    c_ca_unit = (ca - c) / _safe_norm(ca - c)[..., None]
    n_ca_unit = (ca_next - n_next) / _safe_norm(ca_next - n_next)[..., None]
    cos_ca_c_n = (c_ca_unit * c_n_unit).sum(-1)
    cos_c_n_ca = (-c_n_unit * n_ca_unit).sum(-1)
    errors = {"bond_c_n": (_safe_norm((c_n - length_mean)[..., None]), length_sd),
              "angle_ca_c_n": (_safe_norm((cos_ca_c_n - CA_C_N_COS)[..., None]), CA_C_N_SD),
              "angle_c_n_ca": (_safe_norm((cos_c_n_ca - C_N_CA_COS)[..., None]), C_N_CA_SD)}
    out = {k: torch.relu(err - TOLERANCE_SD * sd) for k, (err, sd) in errors.items()}
    out["mask"] = mask
    return out


def nonbonded_within(tables: dict[str, torch.Tensor]) -> torch.Tensor:
    """[21, 14, 14]: the atom pairs of each residue type three or more bonds apart. Bonds are read
    off the ideal residue (atoms under 2 A apart; bond lengths do not depend on the torsions), plus
    proline's N-CD, the one bond that spans two rigid groups."""
    aatype = torch.arange(21)
    backbone = Rigid.identity((21,), torch.device("cpu"), torch.float32)
    anti = torch.tensor([0.0, -1.0]).expand(21, 7, 2)               # every torsion at 180 degrees
    cpu_tables = {k: v.cpu().float() for k, v in tables.items()}
    x = atom14_positions(group_frames(backbone, anti, aatype, cpu_tables), aatype, cpu_tables)
    m = torch.as_tensor(rc.TABLES["atom14_mask"])
    pair = m[:, :, None] * m[:, None, :]
    bonded = (torch.cdist(x, x) < 2.0).float() * pair
    cd = rc.atom14_names("PRO").index("CD")
    bonded[PRO, 0, cd] = bonded[PRO, cd, 0] = 1                    # proline's ring closes across torsions
    within2 = ((bonded + bonded @ bonded) > 0).float()             # self, bonded, or sharing a neighbour
    return pair * (1 - within2)


def clash_losses(atom14, exists, residue_index, aatype, tables) -> dict[str, torch.Tensor]:
    """Per-atom clash loss sums [B, L, 14] between residues and within residues, and the per-atom
    clash indicators (AlphaFold's per_atom_clash_mask)."""
    vdw = _vdw_table().to(atom14.device, atom14.dtype)[aatype]                       # [B, L, 14]
    b, length = aatype.shape
    d = _safe_norm(atom14[:, :, None, :, None, :] - atom14[:, None, :, None, :, :], 1e-10)  # [B, L, L, 14, 14]
    pair_exists = exists[:, :, None, :, None] * exists[:, None, :, None, :]
    upper = torch.triu(torch.ones(length, length, device=atom14.device, dtype=atom14.dtype), 1)
    mask = pair_exists * upper[None, :, :, None, None]
    peptide = torch.zeros(14, 14, device=atom14.device, dtype=atom14.dtype)
    peptide[2, 0] = 1                                                                  # C(i) - N(i+1)
    neighbour = (residue_index[:, None, :] - residue_index[:, :, None] == 1).to(atom14.dtype)
    mask = mask * (1 - neighbour[..., None, None] * peptide)
    is_cys = (aatype == CYS).to(atom14.dtype)
    disulfide = torch.zeros(14, 14, device=atom14.device, dtype=atom14.dtype)
    disulfide[5, 5] = 1                                                                # SG - SG
    mask = mask * (1 - (is_cys[:, :, None] * is_cys[:, None, :])[..., None, None] * disulfide)
    bound = vdw[:, :, None, :, None] + vdw[:, None, :, None, :]
    between = mask * torch.relu(bound - CLASH_TOLERANCE - d)
    between_clash = mask * (d < bound - CLASH_TOLERANCE).to(atom14.dtype)

    idx = torch.arange(length, device=atom14.device)
    d_self = d[:, idx, idx]                                                            # [B, L, 14, 14]
    far = nonbonded_within(tables).to(atom14.device, atom14.dtype)[aatype]
    self_mask = far * exists[..., :, None] * exists[..., None, :]
    bound_self = vdw[..., :, None] + vdw[..., None, :]
    within = self_mask * torch.relu(bound_self - CLASH_TOLERANCE - d_self)
    within_clash = self_mask * (d_self < bound_self - CLASH_TOLERANCE).to(atom14.dtype)
    return {"between_loss": between.sum((2, 4)) + between.sum((1, 3)),
            "within_loss": within.sum(-1) + within.sum(-2),
            "between_clash": torch.maximum(between_clash.amax((2, 4)), between_clash.amax((1, 3))),
            "within_clash": torch.maximum(within_clash.amax(-1), within_clash.amax(-2))}


def structural_violations(atom14: torch.Tensor, batch, tables, atom_mask: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss [B], pieces) for predicted atom14 positions [B, L, 14, 3]; `batch` needs aatype,
    residue_index and seq_mask. The atoms that exist are those of each residue type (a prediction
    has them all), or `atom_mask` [B, L, 14] (a deposited structure's observed atoms)."""
    aatype, residue_index = batch["aatype"], batch["residue_index"]
    exists = torch.as_tensor(rc.TABLES["atom14_mask"], device=atom14.device, dtype=atom14.dtype)[aatype]
    if atom_mask is not None:
        exists = exists * atom_mask.to(atom14.dtype)
    exists = exists * batch["seq_mask"].to(atom14.dtype)[..., None]
    bb = backbone_violations(atom14, exists, residue_index, aatype)
    clash = clash_losses(atom14, exists, residue_index, aatype, tables)
    mean = lambda v: (v * bb["mask"]).sum(-1) / (bb["mask"].sum(-1) + 1e-6)  # noqa: E731
    clash_sum = (clash["between_loss"] + clash["within_loss"]).sum((-1, -2)) / (exists.sum((-1, -2)) + 1e-6)
    loss = mean(bb["bond_c_n"]) + mean(bb["angle_ca_c_n"]) + mean(bb["angle_c_n_ca"]) + clash_sum
    return loss, bb | clash | {"exists": exists}


@torch.no_grad()
def violation_metrics(atom14: torch.Tensor, batch, tables, atom_mask: torch.Tensor | None = None
                      ) -> list[dict[str, float]]:
    """Per item: counts of backbone bond / angle violations beyond 12 sd, of atoms clashing with
    another residue or within their own, the share of residues with any violation, and of
    consecutive CA-CA distances over 4 A (AlphaFold's extreme_ca_ca)."""
    _, p = structural_violations(atom14, batch, tables, atom_mask)
    bb_bad = ((p["bond_c_n"] + p["angle_ca_c_n"] + p["angle_c_n_ca"]) > 0).to(atom14.dtype) * p["mask"]
    clash_res = torch.maximum(p["between_clash"].amax(-1), p["within_clash"].amax(-1))
    residue_bad = clash_res.clone()
    residue_bad[:, :-1] = torch.maximum(residue_bad[:, :-1], bb_bad)
    residue_bad[:, 1:] = torch.maximum(residue_bad[:, 1:], bb_bad)
    seq = batch["seq_mask"].to(atom14.dtype)
    ca_ca = _safe_norm(atom14[:, 1:, 1] - atom14[:, :-1, 1], 0.0)
    extreme = ((ca_ca > 4.0).to(atom14.dtype) * p["mask"]).sum(-1) / (p["mask"].sum(-1) + 1e-6)
    return [{"bond_violations": float(((p["bond_c_n"][i] > 0) * p["mask"][i]).sum()),
             "angle_violations": float((((p["angle_ca_c_n"][i] + p["angle_c_n_ca"][i]) > 0) * p["mask"][i]).sum()),
             "clashing_atoms_between": float(p["between_clash"][i].sum()),
             "clashing_atoms_within": float(p["within_clash"][i].sum()),
             "violating_residue_share": float((residue_bad[i] * seq[i]).sum() / seq[i].sum().clamp(min=1)),
             "extreme_ca_ca_share": float(extreme[i])} for i in range(atom14.shape[0])]
