"""Predict fixed crops and score them: lDDT-Ca, RMSD, TM-score, GDT-TS (the training eval)."""
from __future__ import annotations

import torch

from apps.protein import constants as rc
from apps.protein.metrics import gdt_ts, lddt, rmsd, tm_score
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
    """{chain name: metrics (+ mean pLDDT)} for (name, features) crops."""
    device = next(model.parameters()).device
    results = {}
    for start in range(0, len(crops), batch_size):
        part = crops[start:start + batch_size]
        batch = to_device(default_collate([f for _, f in part]), device)
        out = model(**batch, recycles=recycles)
        for i, (name, feats) in enumerate(part):
            mask = feats["all_atom_mask"][:, CA]
            metrics = ca_metrics(out["atom37"][i, :, CA].cpu(), feats["all_atom_positions"][:, CA], mask)
            metrics["plddt"] = float((out["plddt"][i].cpu() * mask).sum() / mask.sum())
            results[name] = metrics
    return results


def summarise(results: dict[str, dict[str, float]], prefix: str) -> dict[str, float]:
    keys = next(iter(results.values())).keys()
    return {f"{prefix}_{k}": sum(r[k] for r in results.values()) / len(results) for k in keys}
