"""Writing predictions: PDB and mmCIF through biotite (pLDDT in the B-factor column), a PNG of
per-residue pLDDT next to the predicted distogram, and with the PAE head a PNG of the predicted
aligned error."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from apps.protein import constants as rc


def to_atom_array(sequence: str, atom37: np.ndarray, mask37: np.ndarray, plddt: np.ndarray, chain_id: str = "A"):
    """A biotite AtomArray of the atoms with mask 1; b_factor holds each residue's pLDDT."""
    import biotite.structure as struc

    rows = [(i, j) for i in range(len(sequence)) for j in range(37) if mask37[i, j] > 0]
    arr = struc.AtomArray(len(rows))
    arr.add_annotation("b_factor", float)
    for k, (i, j) in enumerate(rows):
        name = rc.ATOM37[j]
        aa = sequence[i]
        arr.res_name[k] = rc.THREE[rc.ONE_TO_INDEX[aa]] if aa in rc.ONE_TO_INDEX else "UNK"
        arr.res_id[k] = i + 1
        arr.atom_name[k] = name
        arr.element[k] = name[0]
        arr.chain_id[k] = chain_id
        arr.b_factor[k] = float(plddt[i])
    arr.coord = np.array([atom37[i, j] for i, j in rows], np.float32).reshape(-1, 3)
    arr.hetero[:] = False
    return arr


def write_structure(arr, path: Path) -> Path:
    """PDB (.pdb) or mmCIF (.cif), decided by the suffix."""
    path = Path(path)
    if path.suffix == ".pdb":
        import biotite.structure.io.pdb as pdb
        f = pdb.PDBFile()
        f.set_structure(arr)
        f.write(str(path))
    elif path.suffix == ".cif":
        import biotite.structure.io.pdbx as pdbx
        f = pdbx.CIFFile()
        pdbx.set_structure(f, arr)
        f.write(str(path))
    else:
        raise ValueError(f"{path}: write .pdb or .cif")
    return path


def plot_confidence(plddt: np.ndarray, distogram_logits: np.ndarray, path: Path, title: str = "") -> Path:
    """Left: pLDDT per residue (AlphaFold's colour bands); right: expected distance per pair (A)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from apps.protein.model.alphafold import DISTOGRAM_BINS

    edges = np.linspace(2.3125, 21.6875, DISTOGRAM_BINS - 1)
    centres = np.concatenate([[edges[0] - 0.3], (edges[:-1] + edges[1:]) / 2, [edges[-1] + 0.3]])
    p = np.exp(distogram_logits - distogram_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = (p * centres).sum(-1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = np.arange(1, len(plddt) + 1)
    for lo, hi, colour in ((90, 100, "#0053d6"), (70, 90, "#65cbf3"), (50, 70, "#ffdb13"), (0, 50, "#ff7d45")):
        a.axhspan(lo, hi, color=colour, alpha=0.15, lw=0)
    a.plot(x, plddt, color="k", lw=1.2)
    a.set(xlabel="residue", ylabel="pLDDT", ylim=(0, 100), title="per-residue confidence")
    im = b.imshow(expected, cmap="viridis_r", origin="upper")
    b.set(title="predicted distogram (expected CB-CB distance)", xlabel="residue", ylabel="residue")
    fig.colorbar(im, ax=b, label="A")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_pae(pae: np.ndarray, path: Path, title: str = "", max_error: float = 31.75) -> Path:
    """The predicted aligned error [L, L] (A) as AlphaFold shows it: entry (i, j) is the expected
    error at residue j when the prediction and the truth are aligned on residue i."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.6))
    im = ax.imshow(pae, cmap="Greens_r", vmin=0.0, vmax=max_error, origin="upper")
    ax.set(xlabel="scored residue", ylabel="aligned residue", title=title or "predicted aligned error")
    fig.colorbar(im, ax=ax, label="expected position error (A)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
