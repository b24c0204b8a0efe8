"""Residue vocabulary and atom layouts as AlphaFold 2 defines them.

- `RESTYPES`: the 20 amino acids in AlphaFold's order (index = `aatype`); 20 is unknown (X) and,
  in the MSA alphabet, 21 is the gap and 22 the mask token of masked-MSA training.
- atom37: one slot per heavy-atom name of any amino acid (`ATOM37`), the layout of AlphaFold's
  output `final_atom_positions`; atom14: a residue's own atoms, backbone first (`ATOM14`).
- Rigid groups: 0 backbone (N, CA, C, CB), 3 psi (O), 4..7 chi1..chi4. Groups 1 (pre-omega) and 2
  (phi) only place hydrogens, which these layouts do not hold, so they carry no atoms here.
"""
from __future__ import annotations

import numpy as np

RESTYPES = "ARNDCQEGHILKMFPSTWYV"
THREE = ["ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE",
         "LEU", "LYS", "MET", "PHE", "PRO", "SER", "THR", "TRP", "TYR", "VAL"]
UNK = 20                      # aatype of unknown / non-standard residues
GAP, MASK_TOKEN = 21, 22      # MSA alphabet: 20 residues, X, gap, mask  -> 23 classes
MSA_CLASSES = 23
ONE_TO_INDEX = {a: i for i, a in enumerate(RESTYPES)}
THREE_TO_INDEX = {t: i for i, t in enumerate(THREE)}
# Modified residues that are standard ones with a change (how the PDB writes them).
MODIFIED = {"MSE": "MET", "SEP": "SER", "TPO": "THR", "PTR": "TYR", "HYP": "PRO", "CSO": "CYS", "MLY": "LYS"}

ATOM37 = ["N", "CA", "C", "CB", "O", "CG", "CG1", "CG2", "OG", "OG1", "SG", "CD", "CD1", "CD2", "ND1",
          "ND2", "OD1", "OD2", "SD", "CE", "CE1", "CE2", "CE3", "NE", "NE1", "NE2", "OE1", "OE2", "CH2",
          "NH1", "NH2", "OH", "CZ", "CZ2", "CZ3", "NZ", "OXT"]
ATOM37_INDEX = {a: i for i, a in enumerate(ATOM37)}

SIDE_CHAINS = {
    "ALA": [], "ARG": ["CG", "CD", "NE", "CZ", "NH1", "NH2"], "ASN": ["CG", "OD1", "ND2"],
    "ASP": ["CG", "OD1", "OD2"], "CYS": ["SG"], "GLN": ["CG", "CD", "OE1", "NE2"],
    "GLU": ["CG", "CD", "OE1", "OE2"], "GLY": [], "HIS": ["CG", "ND1", "CD2", "CE1", "NE2"],
    "ILE": ["CG1", "CG2", "CD1"], "LEU": ["CG", "CD1", "CD2"], "LYS": ["CG", "CD", "CE", "NZ"],
    "MET": ["CG", "SD", "CE"], "PHE": ["CG", "CD1", "CD2", "CE1", "CE2", "CZ"], "PRO": ["CG", "CD"],
    "SER": ["OG"], "THR": ["OG1", "CG2"], "TRP": ["CG", "CD1", "CD2", "NE1", "CE2", "CE3", "CZ2", "CZ3", "CH2"],
    "TYR": ["CG", "CD1", "CD2", "CE1", "CE2", "CZ", "OH"], "VAL": ["CG1", "CG2"],
}


def atom14_names(resname: str) -> list[str]:
    """A residue's atom14 slots: N, CA, C, O, then CB and the side chain (empty names pad to 14)."""
    names = ["N", "CA", "C", "O"] + ([] if resname == "GLY" else ["CB"]) + SIDE_CHAINS.get(resname, [])
    return names + [""] * (14 - len(names))


# The four atoms whose dihedral is each chi angle.
CHI_ATOMS = {
    "ARG": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "NE"], ["CG", "CD", "NE", "CZ"]],
    "ASN": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],
    "ASP": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "OD1"]],
    "CYS": [["N", "CA", "CB", "SG"]],
    "GLN": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],
    "GLU": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "OE1"]],
    "HIS": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "ND1"]],
    "ILE": [["N", "CA", "CB", "CG1"], ["CA", "CB", "CG1", "CD1"]],
    "LEU": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "LYS": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"], ["CB", "CG", "CD", "CE"], ["CG", "CD", "CE", "NZ"]],
    "MET": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "SD"], ["CB", "CG", "SD", "CE"]],
    "PHE": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "PRO": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD"]],
    "SER": [["N", "CA", "CB", "OG"]],
    "THR": [["N", "CA", "CB", "OG1"]],
    "TRP": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "TYR": [["N", "CA", "CB", "CG"], ["CA", "CB", "CG", "CD1"]],
    "VAL": [["N", "CA", "CB", "CG1"]],
}
# Chi angles that are only defined up to pi (a symmetric ring or carboxylate flips onto itself).
PI_PERIODIC_CHI = {("ASP", 1), ("GLU", 2), ("PHE", 1), ("TYR", 1)}
# Atom pairs whose names swap under such a flip (the side-chain loss takes the better naming).
AMBIGUOUS_PAIRS = {"ASP": [("OD1", "OD2")], "GLU": [("OE1", "OE2")], "PHE": [("CD1", "CD2"), ("CE1", "CE2")],
                   "TYR": [("CD1", "CD2"), ("CE1", "CE2")]}

NUM_GROUPS = 8  # backbone, pre-omega, phi, psi, chi1..chi4
_DEPTH = {"B": 1, "G": 2, "D": 3, "E": 4, "Z": 5, "H": 6}


def rigid_group(resname: str, atom: str) -> int:
    """The rigid group that moves `atom`: 0 backbone (N, CA, C, CB), 3 psi (O), else the chi whose
    last atom lies at the same branch depth (beta, gamma, ...), capped at the residue's chi count."""
    if atom in ("N", "CA", "C", "CB"):
        return 0
    if atom in ("O", "OXT"):
        return 3
    n_chi = len(CHI_ATOMS.get(resname, []))
    depth = _DEPTH[atom[1]]
    return 4 + min(depth - 1, n_chi) - 1


def restype_tables() -> dict[str, np.ndarray]:
    """Per-residue-type lookup tables [21, ...] used to move between layouts (X gets empty rows)."""
    atom14_to_37 = np.zeros((21, 14), np.int64)
    atom14_mask = np.zeros((21, 14), np.float32)
    atom37_to_14 = np.zeros((21, 37), np.int64)
    atom37_mask = np.zeros((21, 37), np.float32)
    atom14_group = np.zeros((21, 14), np.int64)
    chi_mask = np.zeros((21, 4), np.float32)
    chi_pi_periodic = np.zeros((21, 4), np.float32)
    chi_atom14 = np.zeros((21, 4, 4), np.int64)
    ambiguous_swap = np.tile(np.arange(14), (21, 1))
    for r, res in enumerate(THREE):
        for i, name in enumerate(atom14_names(res)):
            if not name:
                continue
            atom14_to_37[r, i] = ATOM37_INDEX[name]
            atom14_mask[r, i] = 1
            atom37_to_14[r, ATOM37_INDEX[name]] = i
            atom37_mask[r, ATOM37_INDEX[name]] = 1
            atom14_group[r, i] = rigid_group(res, name)
        names = atom14_names(res)
        for k, quad in enumerate(CHI_ATOMS.get(res, [])):
            chi_mask[r, k] = 1
            chi_pi_periodic[r, k] = float((res, k) in PI_PERIODIC_CHI)
            chi_atom14[r, k] = [names.index(a) for a in quad]
        for a, b in AMBIGUOUS_PAIRS.get(res, []):
            ia, ib = names.index(a), names.index(b)
            ambiguous_swap[r, ia], ambiguous_swap[r, ib] = ib, ia
    return dict(atom14_to_37=atom14_to_37, atom14_mask=atom14_mask, atom37_to_14=atom37_to_14,
                atom37_mask=atom37_mask, atom14_group=atom14_group, chi_mask=chi_mask,
                chi_pi_periodic=chi_pi_periodic, chi_atom14=chi_atom14, ambiguous_swap=ambiguous_swap)


TABLES = restype_tables()
