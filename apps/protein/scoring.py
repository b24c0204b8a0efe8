"""Predict fixed crops and score them: lDDT-Ca, RMSD, TM-score, GDT-TS (the training eval), and
the trivial baselines any held-out figure should be read against: an ideal alpha-helix and a
random coil of the crop's length, scored by the same code."""
from __future__ import annotations

import math

import torch

from apps.protein import constants as rc
from apps.protein.metrics import gdt_ts, lddt, rmsd, tm_score
from apps.protein.violations import violation_metrics
from phalanx.booster import unwrap_model
from phalanx.device import to_device
from phalanx.train.data import default_collate

CA = rc.ATOM37_INDEX["CA"]


def ca_metrics(pred_ca: torch.Tensor, true_ca: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """All four metrics of one chain [L, 3] (float64 for the superpositions)."""
    p, t, m = pred_ca.double(), true_ca.double(), mask.double()
    return {"lddt_ca": lddt(p, t, m).item(), "rmsd": rmsd(p, t, m).item(), "tm_score": tm_score(p, t, m).item(),
            "gdt_ts": gdt_ts(p, t, m).item()}


@torch.no_grad()
def score_crops(model, crops, recycles: int, batch_size: int = 4) -> dict[str, dict[str, float]]:
    """{chain name: metrics (+ mean pLDDT and the structural violation counts)} for (name, features)
    crops."""
    device = next(model.parameters()).device
    results = {}
    for start in range(0, len(crops), batch_size):
        part = crops[start:start + batch_size]
        batch = to_device(default_collate([f for _, f in part]), device)
        out = model(**batch, recycles=recycles)
        inner = unwrap_model(model)
        tables = {"default_frames": inner.default_frames, "atom14_local": inner.atom14_local}
        violations = violation_metrics(out["atom14"], batch, tables)
        for i, (name, feats) in enumerate(part):
            mask = feats["all_atom_mask"][:, CA]
            metrics = ca_metrics(out["atom37"][i, :, CA].cpu(), feats["all_atom_positions"][:, CA], mask)
            metrics["plddt"] = float((out["plddt"][i].cpu() * mask).sum() / mask.sum())
            metrics |= confidence_metrics(out["plddt"][i].cpu(), out["atom37"][i, :, CA].cpu(),
                                          feats["all_atom_positions"][:, CA], mask)
            results[name] = metrics | violations[i]
    return results


def true_plddt(pred_ca: torch.Tensor, true_ca: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[.., L] the per-residue lDDT-Ca of a prediction x 100: what pLDDT should say."""
    return lddt(pred_ca.double(), true_ca.double(), mask.double(), per_residue=True) * 100


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D samples (0 when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else 0.0


def confidence_metrics(plddt: torch.Tensor, pred_ca: torch.Tensor, true_ca: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, float]:
    """How well pLDDT [L] tracks the true per-residue lDDT-Ca x 100 over the observed residues: the
    mean absolute difference (points) and the Pearson correlation."""
    keep = mask > 0
    truth = true_plddt(pred_ca, true_ca, mask)[keep]
    said = plddt.double()[keep]
    return {"plddt_error": float((said - truth).abs().mean()), "plddt_lddt_pearson": pearson(said, truth)}


def summarise(results: dict[str, dict[str, float]], prefix: str) -> dict[str, float]:
    keys = next(iter(results.values())).keys()
    return {f"{prefix}_{k}": sum(r[k] for r in results.values()) / len(results) for k in keys}


def ideal_helix_ca(n: int) -> torch.Tensor:
    """[n, 3] Ca of an ideal alpha-helix: radius 2.3 A, 1.5 A rise and 100 degrees per residue
    (Ca-Ca 3.83 A, i to i+3 5.05 A, i to i+4 6.2 A)."""
    t = torch.arange(n, dtype=torch.float64)
    angle = torch.deg2rad(100.0 * t)
    return torch.stack([2.3 * torch.cos(angle), 2.3 * torch.sin(angle), 1.5 * t], -1)


def random_coil_ca(n: int, generator: torch.Generator) -> torch.Tensor:
    """[n, 3] Ca of a freely rotating chain: 3.8 A steps, 120 degree Ca-Ca-Ca angles, dihedrals
    uniform at random (no self-avoidance)."""
    x = [torch.zeros(3, dtype=torch.float64), torch.tensor([3.8, 0.0, 0.0], dtype=torch.float64),
         torch.tensor([3.8 + 3.8 * math.cos(math.radians(60)), 3.8 * math.sin(math.radians(60)), 0.0],
                      dtype=torch.float64)]
    torsions = (torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * math.pi
    theta = math.radians(120.0)
    for i in range(3, n):
        a, b, c = x[-3], x[-2], x[-1]
        bc = (c - b) / (c - b).norm()
        normal = torch.linalg.cross(b - a, bc)
        normal = normal / normal.norm()
        frame = torch.stack([bc, torch.linalg.cross(normal, bc), normal], -1)
        sin_t = 3.8 * math.sin(theta)
        step = torch.stack([torsions.new_tensor(-3.8 * math.cos(theta)), sin_t * torch.cos(torsions[i]),
                            sin_t * torch.sin(torsions[i])])
        x.append(c + frame @ step)
    return torch.stack(x[:n])


def score_baselines(crops, coil_samples: int = 10, seed: int = 0) -> dict[str, dict[str, float]]:
    """{"helix": mean Ca metrics, "coil": mean over `coil_samples` random coils} over the crops,
    against each crop's true Ca (its own length and mask)."""
    g = torch.Generator().manual_seed(seed)
    helix, coil = [], []
    for _, feats in crops:
        true, mask = feats["all_atom_positions"][:, CA].cpu(), feats["all_atom_mask"][:, CA].cpu()
        n = true.shape[0]
        helix.append(ca_metrics(ideal_helix_ca(n), true, mask))
        coil += [ca_metrics(random_coil_ca(n, g), true, mask) for _ in range(coil_samples)]
    mean = lambda rows: {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}  # noqa: E731
    return {"helix": mean(helix), "coil": mean(coil)}
