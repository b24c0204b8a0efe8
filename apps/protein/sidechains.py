"""Torsion angles <-> atom coordinates: the rigid groups of each residue.

A residue is a chain of rigid groups (`constants.rigid_group`): the backbone frame (N, CA, C, CB),
psi (O) and chi1..chi4. Group k's frame is its parent's frame, times a fixed *default frame*,
times a rotation about x by the torsion angle; its atoms sit at fixed coordinates in that frame.

psi follows AlphaFold's convention, so that real AlphaFold parameters place the carbonyl O where
AlphaFold does: the psi group's default frame sits at C with x along CA->C and y towards CA - N,
and the psi torsion is the dihedral N-CA-C-O mirrored (+ pi), i.e. close to the backbone psi
N-CA-C-N(next).

AlphaFold takes those fixed coordinates from literature values. Here they are measured: the
per-residue-type median of each atom's coordinates in its group frame over the shipped training
structures (`measure_ideal_geometry`, written once to data/ideal_geometry.json), and the default
frames are rebuilt from them exactly as AlphaFold builds its own (`from_3_points` on the atoms
that define each torsion).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from apps.protein import constants as rc
from apps.protein.rigid import Rigid, backbone_frame, from_3_points, rot_x

IDEAL_FILE = Path(__file__).resolve().parent / "data" / "ideal_geometry.json"
# Torsions in AlphaFold's order; the first two only place hydrogens.
TORSIONS = ["omega", "phi", "psi", "chi1", "chi2", "chi3", "chi4"]
PSI_ATOMS = ["N", "CA", "C", "O"]


def psi_default_frame(n: torch.Tensor, ca: torch.Tensor, c: torch.Tensor) -> Rigid:
    """AlphaFold's psi group frame at torsion 0: origin C, x along CA->C, y towards CA - N."""
    return from_3_points(ca, c, c + ca - n)


def psi_torsion(n, ca, c, o) -> torch.Tensor:
    """AlphaFold's psi angle: the N-CA-C-O dihedral mirrored, because it is measured on the O."""
    return dihedral(n, ca, c, o) + np.pi


def dihedral(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The IUPAC dihedral angle of four points (radians, [-pi, pi])."""
    b0, b1, b2 = a - b, c - b, d - c
    b1n = b1 / (b1.norm(dim=-1, keepdim=True) + 1e-8)
    v = b0 - (b0 * b1n).sum(-1, keepdim=True) * b1n
    w = b2 - (b2 * b1n).sum(-1, keepdim=True) * b1n
    x = (v * w).sum(-1)
    y = (torch.cross(b1n, v, dim=-1) * w).sum(-1)
    return torch.atan2(y, x)


def _group_quads(resname: str) -> list[list[str]]:
    """The four atoms defining psi and each chi of a residue type (psi first)."""
    return [PSI_ATOMS] + rc.CHI_ATOMS.get(resname, [])


def pseudo_beta(atoms: torch.Tensor, aatype: torch.Tensor, mask: torch.Tensor | None = None):
    """CB, or CA for glycine, of atom37 or atom14 positions [.., L, 37 or 14, 3]: [.., L, 3], and
    with `mask` [.., L, 37 or 14] also that atom's mask [.., L]. (In both layouts CA is atom 1;
    CB is atom 3 of atom37 and atom 4 of atom14.)"""
    ca, cb = 1, (rc.ATOM37_INDEX["CB"] if atoms.shape[-2] == 37 else 4)
    is_gly = aatype == rc.THREE.index("GLY")
    x = torch.where(is_gly[..., None], atoms[..., ca, :], atoms[..., cb, :])
    return x if mask is None else (x, torch.where(is_gly, mask[..., ca], mask[..., cb]))


# --------------------------------------------------------------------------- measuring
def measure_ideal_geometry(chains) -> dict:
    """{resname: {atom: [x, y, z] in its group frame}}: the per-coordinate median over every
    complete residue of `chains` (ProteinChain), plus the count of residues each type was measured
    on. The median, not the mean: a few deposited residues swap the names of equivalent atoms
    (ARG NH1/NH2), and a mean would put the ideal atom between the two positions."""
    sums: dict[str, dict[str, list]] = {r: {} for r in rc.THREE}
    counts = {r: 0 for r in rc.THREE}
    for chain in chains:
        xyz = torch.from_numpy(chain.atom37).double()
        mask = chain.atom37_mask
        for i, aa in enumerate(chain.sequence):
            if aa not in rc.ONE_TO_INDEX:
                continue
            res = rc.THREE[rc.ONE_TO_INDEX[aa]]
            names = [n for n in rc.atom14_names(res) if n]
            if not all(mask[i, rc.ATOM37_INDEX[n]] for n in names):
                continue
            pos = {n: xyz[i, rc.ATOM37_INDEX[n]] for n in names}
            local = _local_coordinates(res, pos)
            for n, v in local.items():
                sums[res].setdefault(n, []).append(v.numpy())
            counts[res] += 1
    missing = [r for r in rc.THREE if counts[r] == 0]
    if missing:
        raise ValueError(f"no complete residue of {missing} in the given chains: add structures that contain them")
    return {"source": "median over complete residues of the training structures", "counts": counts,
            "atoms": {r: {n: np.median(np.stack(v), 0).round(4).tolist() for n, v in sums[r].items()}
                      for r in rc.THREE}}


def _local_coordinates(res: str, pos: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every atom of one residue in its own group's frame (torsion rotation included)."""
    frames = {0: backbone_frame(pos["N"], pos["CA"], pos["C"])}
    for k, (a, b, c, d) in enumerate(_group_quads(res)):
        group = 3 if k == 0 else 3 + k
        if k == 0:
            f, angle = psi_default_frame(pos[a], pos[b], pos[c]), psi_torsion(pos[a], pos[b], pos[c], pos[d])
        else:
            f, angle = from_3_points(pos[b], pos[c], pos[a]), dihedral(pos[a], pos[b], pos[c], pos[d])
        frames[group] = f.compose(rot_x(torch.sin(angle), torch.cos(angle)))
    return {n: frames[rc.rigid_group(res, n)].invert_apply(p) for n, p in pos.items()}


def write_ideal_geometry(chains, path: Path = IDEAL_FILE) -> Path:
    path.write_text(json.dumps(measure_ideal_geometry(chains), indent=1))
    return path


# --------------------------------------------------------------------------- tables
def ideal_tables(path: Path = IDEAL_FILE) -> dict[str, torch.Tensor]:
    """default_frames [21, 8, 4, 4] (each group's frame in its parent's at torsion 0) and
    atom14_local [21, 14, 3] (each atom in its group frame); X gets glycine's backbone."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: write it with `python -m apps.protein.sidechains`")
    atoms = json.loads(path.read_text())["atoms"]
    default = torch.eye(4).repeat(21, 8, 1, 1)
    local = torch.zeros(21, 14, 3)
    for r, res in enumerate(rc.THREE + ["GLY"]):
        pos = {n: torch.tensor(v, dtype=torch.float32) for n, v in atoms[res].items()}
        for i, n in enumerate(rc.atom14_names(res)):
            if n:
                local[r, i] = pos[n]
        quads = _group_quads(res)
        # psi and chi1: defined by backbone atoms, all known in the backbone frame.
        default[r, 3] = _to4x4(psi_default_frame(pos["N"], pos["CA"], pos["C"]))
        if len(quads) > 1:
            a, b, c, _ = quads[1]
            default[r, 4] = _to4x4(from_3_points(pos[b], pos[c], pos[a]))
        # chi2..4: a = b of the previous chi (on its -x axis), b = its origin, c = its last atom.
        for k in range(2, len(quads)):
            prev_a, prev_b, prev_c, prev_d = quads[k - 1]
            bond = _bond_length(res, pos, quads[k - 1])
            a_local = torch.tensor([-bond, 0.0, 0.0])
            default[r, 3 + k] = _to4x4(from_3_points(torch.zeros(3), pos[prev_d], a_local))
    return {"default_frames": default, "atom14_local": local}


def _bond_length(res: str, pos: dict[str, torch.Tensor], quad: list[str]) -> float:
    """|c - b| of a chi's atoms, read from the measured coordinates (b and c share a frame or c is
    the origin of b's group)."""
    _, b, c, _ = quad
    gb, gc = rc.rigid_group(res, b), rc.rigid_group(res, c)
    if gb == gc:
        return float((pos[c] - pos[b]).norm())
    return float(pos[c].norm())  # c is the last atom of b's group's child: b sits at that group's origin


def _to4x4(rigid: Rigid) -> torch.Tensor:
    m = torch.eye(4)
    m[:3, :3], m[:3, 3] = rigid.rot, rigid.trans
    return m


def _from4x4(m: torch.Tensor) -> Rigid:
    return Rigid(m[..., :3, :3], m[..., :3, 3])


# --------------------------------------------------------------------------- building atoms
def group_frames(backbone: Rigid, torsions: torch.Tensor, aatype: torch.Tensor,
                 tables: dict[str, torch.Tensor]) -> Rigid:
    """Global frames of the 8 rigid groups [..., L, 8] from backbone frames [..., L] and torsions
    as (sin, cos) [..., L, 7, 2] (AlphaFold's order: omega, phi, psi, chi1..chi4)."""
    default = _from4x4(tables["default_frames"].to(torsions.device, torsions.dtype)[aatype])  # [..., L, 8]
    sin, cos = torsions[..., 0], torsions[..., 1]
    frames = [backbone]
    identity = Rigid.identity(backbone.shape, torsions.device, torsions.dtype)
    frames += [identity, identity]  # pre-omega, phi: hydrogens only
    frames.append(backbone.compose(default[..., 3].compose(rot_x(sin[..., 2], cos[..., 2]))))  # psi
    parent = backbone
    for k in range(4):
        g = 4 + k
        parent = parent.compose(default[..., g].compose(rot_x(sin[..., 3 + k], cos[..., 3 + k])))
        frames.append(parent)
    return Rigid(torch.stack([f.rot for f in frames], dim=-3), torch.stack([f.trans for f in frames], dim=-2))


def atom14_positions(frames: Rigid, aatype: torch.Tensor, tables: dict[str, torch.Tensor]) -> torch.Tensor:
    """[..., L, 14, 3] atom positions from the group frames [..., L, 8]."""
    group = torch.as_tensor(rc.TABLES["atom14_group"], device=aatype.device)[aatype]           # [..., L, 14]
    local = tables["atom14_local"].to(frames.trans.device, frames.trans.dtype)[aatype]         # [..., L, 14, 3]
    idx = group[..., None, None].expand(*group.shape, 3, 3)
    rot = torch.gather(frames.rot, -3, idx)
    trans = torch.gather(frames.trans, -2, group[..., None].expand(*group.shape, 3))
    mask = torch.as_tensor(rc.TABLES["atom14_mask"], device=aatype.device, dtype=local.dtype)[aatype]
    return (torch.einsum("...ij,...j->...i", rot, local) + trans) * mask[..., None]


def atom14_to_atom37(atom14: torch.Tensor, aatype: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([..., L, 37, 3] positions, [..., L, 37] mask) from atom14 positions."""
    idx = torch.as_tensor(rc.TABLES["atom37_to_14"], device=aatype.device)[aatype]
    mask = torch.as_tensor(rc.TABLES["atom37_mask"], device=aatype.device, dtype=atom14.dtype)[aatype]
    out = torch.gather(atom14, -2, idx[..., None].expand(*idx.shape, 3))
    return out * mask[..., None], mask


def atom37_to_atom14(atom37: torch.Tensor, mask37: torch.Tensor, aatype: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.as_tensor(rc.TABLES["atom14_to_37"], device=aatype.device)[aatype]
    mask14 = torch.as_tensor(rc.TABLES["atom14_mask"], device=aatype.device, dtype=atom37.dtype)[aatype]
    pos = torch.gather(atom37, -2, idx[..., None].expand(*idx.shape, 3))
    m = torch.gather(mask37, -1, idx) * mask14
    return pos * m[..., None], m


def true_torsions(atom14: torch.Tensor, mask14: torch.Tensor, aatype: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ground-truth torsions of a chain [L]: (sin/cos [L, 7, 2], alternative for pi-periodic chis
    [L, 7, 2], mask [L, 7]). omega and phi need the previous residue (masked for the first)."""
    n, ca, c = atom14[:, 0], atom14[:, 1], atom14[:, 2]
    prev_ca, prev_c = torch.roll(ca, 1, 0), torch.roll(c, 1, 0)
    bb = mask14[:, :3].prod(-1)
    prev_ok = torch.roll(bb, 1, 0) * bb
    prev_ok[0] = 0
    angles = [dihedral(prev_ca, prev_c, n, ca), dihedral(prev_c, n, ca, c), psi_torsion(n, ca, c, atom14[:, 3])]
    masks = [prev_ok, prev_ok, bb * mask14[:, 3]]
    quads = torch.as_tensor(rc.TABLES["chi_atom14"], device=aatype.device)[aatype]  # [L, 4, 4]
    chi_mask = torch.as_tensor(rc.TABLES["chi_mask"], device=aatype.device, dtype=atom14.dtype)[aatype]
    for k in range(4):
        pts = [torch.gather(atom14, 1, quads[:, k, j][:, None, None].expand(-1, 1, 3))[:, 0] for j in range(4)]
        present = torch.stack([torch.gather(mask14, 1, quads[:, k, j][:, None])[:, 0] for j in range(4)]).prod(0)
        angles.append(dihedral(*pts))
        masks.append(chi_mask[:, k] * present)
    angle = torch.stack(angles, -1)
    mask = torch.stack(masks, -1)
    periodic = torch.zeros_like(angle)
    periodic[:, 3:] = torch.as_tensor(rc.TABLES["chi_pi_periodic"], device=aatype.device, dtype=angle.dtype)[aatype]
    alt = angle + np.pi * periodic
    as_sc = lambda t: torch.stack([torch.sin(t), torch.cos(t)], -1)  # noqa: E731
    return as_sc(angle) * mask[..., None], as_sc(alt) * mask[..., None], mask


if __name__ == "__main__":
    from apps.protein.data_sets import training_chains

    out = write_ideal_geometry(training_chains())
    print(f"wrote {out}")
