"""AlphaFold's training losses (supplement section 1.9): FAPE on backbone frames and on all atoms
(clamped), torsion angles, distogram, masked MSA, pLDDT, experimentally resolved and (with the
pTM head) predicted aligned error, and (for fine-tuning) the structural violations of
`violations.py`.

`alphafold_loss(out, batch, weights)` returns the weighted total and each term (for logging).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from apps.protein import constants as rc
from apps.protein.metrics import lddt
from apps.protein.model.alphafold import DISTOGRAM_BINS, PAE_BINS, PLDDT_BINS
from apps.protein.model.primitives import distance_bin_index
from apps.protein.rigid import Rigid
from apps.protein.sidechains import group_frames
from apps.protein.violations import structural_violations


@dataclass
class LossWeights:
    fape_backbone: float = 0.5     # averaged over structure-module layers (AlphaFold's aux FAPE)
    fape_sidechain: float = 0.5    # all atoms in all rigid-group frames, final layer
    torsion: float = 1.0           # AlphaFold weights it inside the aux loss (x0.5)
    distogram: float = 0.3
    masked_msa: float = 2.0
    plddt: float = 0.01
    experimentally_resolved: float = 0.0  # AlphaFold: 0 in initial training, 0.01 when fine-tuning
    violation: float = 0.0         # structural violations (bonds, angles, clashes); AlphaFold: 0 in initial
                                   # training, 1.0 when fine-tuning (computed only when non-zero)
    pae: float = 0.0               # with model.pae_head; AlphaFold: 0 in initial training, 0.1 when fine-tuning
    fape_clamp: float | None = 10.0  # A; FAPE errors beyond it count as the clamp (null: unclamped;
                                   # AlphaFold leaves 10% of batches unclamped)
    fape_scale: float = 10.0       # A; FAPE is divided by it


def fape(pred_frames: Rigid, true_frames: Rigid, frame_mask: torch.Tensor, pred_x: torch.Tensor,
         true_x: torch.Tensor, x_mask: torch.Tensor, clamp: float = 10.0, scale: float = 10.0,
         eps: float = 1e-4) -> torch.Tensor:
    """Frame-aligned point error: every point expressed in every frame, predicted against true,
    clamped and averaged. frames [..., F], points [..., P, 3]. Invariant to rigid motions of either
    structure (each is compared in its own frames)."""
    local_pred = pred_frames.unsqueeze(-1).invert_apply(pred_x[..., None, :, :])  # [..., F, P, 3]
    local_true = true_frames.unsqueeze(-1).invert_apply(true_x[..., None, :, :])
    err = torch.sqrt(((local_pred - local_true) ** 2).sum(-1) + eps)
    if clamp is not None:
        err = err.clamp(max=clamp)
    weight = frame_mask[..., :, None] * x_mask[..., None, :]
    return (err * weight).sum((-1, -2)) / scale / (weight.sum((-1, -2)) + 1e-8)


def _frames(rot, trans) -> Rigid:
    return Rigid(rot, trans)


def backbone_fape(out, batch, w: LossWeights) -> torch.Tensor:
    true = _frames(batch["backbone_rot"], batch["backbone_trans"])
    mask = batch["backbone_mask"]
    losses = [fape(_frames(r, t), true, mask, t, true.trans, mask, w.fape_clamp, w.fape_scale)
              for r, t in zip(out["frames_rot"], out["frames_trans"])]
    return torch.stack(losses).mean(0).mean()


def rigid_group_mask(batch) -> torch.Tensor:
    """[B, L, 8]: which true rigid-group frames exist, from the observed atoms (AlphaFold's
    rigidgroups_gt_exists): the backbone (N, CA, C), psi (with O), and each chi whose torsion and
    whose parents' torsions were measured. A chi of a residue type is not enough: a lysine with
    no atoms past CB has no chi2-4 frames to align to."""
    backbone, torsion = batch["backbone_mask"], batch["torsion_mask"]
    chis = torch.cumprod(torsion[..., 3:], -1)               # chi k needs chi 1..k-1 (its parents)
    zero = torch.zeros_like(backbone)
    return torch.stack([backbone, zero, zero, torsion[..., 2], *chis.unbind(-1)], -1) * backbone[..., None]


def _pair_distances(x: torch.Tensor) -> torch.Tensor:
    """[B, L, L, 14, 14] distances between every atom of residue i and every atom of residue j."""
    d2 = ((x[:, :, None, :, None, :] - x[:, None, :, None, :, :]) ** 2).sum(-1)
    return torch.sqrt(d2 + 1e-10)


def renamed_truth(pred14: torch.Tensor, batch) -> torch.Tensor:
    """The true atom14 positions with each symmetric side chain (ASP, GLU, PHE, TYR, ...) named as
    fits the prediction better (AlphaFold supplement, algorithm 26). The comparison is of
    distances to the non-ambiguous atoms of every residue, so it does not depend on the global
    frame the prediction and the truth happen to be in."""
    aatype, exists = batch["aatype"], batch["atom14_gt_exists"]
    gt, alt = batch["atom14_gt_positions"], batch["atom14_alt_gt_positions"]
    swap = torch.as_tensor(rc.TABLES["ambiguous_swap"], device=aatype.device)[aatype]
    ambiguous = (swap != torch.arange(14, device=aatype.device)).to(exists.dtype)
    with torch.no_grad():
        pred_d = _pair_distances(pred14.detach())
        mask = (exists * ambiguous)[:, :, None, :, None] * (exists * (1 - ambiguous))[:, None, :, None, :]
        err_gt = (torch.sqrt((pred_d - _pair_distances(gt)) ** 2 + 1e-10) * mask).sum((2, 3, 4))
        err_alt = (torch.sqrt((pred_d - _pair_distances(alt)) ** 2 + 1e-10) * mask).sum((2, 3, 4))
    return torch.where((err_alt < err_gt)[..., None, None], alt, gt)


def sidechain_fape(out, batch, tables, w: LossWeights) -> torch.Tensor:
    """All-atom FAPE of the final structure, against the truth with its symmetric atoms renamed
    to fit the prediction, over the true frames that exist."""
    aatype = batch["aatype"]
    pred14, exists = out["atom14"], batch["atom14_gt_exists"]
    truth = renamed_truth(pred14, batch)
    true_bb = _frames(batch["backbone_rot"], batch["backbone_trans"])
    true_groups = group_frames(true_bb, batch["torsion_sin_cos"], aatype, tables)
    pred_groups = _frames(out["group_rot"], out["group_trans"])
    gmask = rigid_group_mask(batch)
    b = aatype.shape[0]
    flat = lambda r: Rigid(r.rot.reshape(b, -1, 3, 3), r.trans.reshape(b, -1, 3))  # noqa: E731
    return fape(flat(pred_groups), flat(true_groups), gmask.reshape(b, -1), pred14.reshape(b, -1, 3),
                truth.reshape(b, -1, 3), exists.reshape(b, -1), w.fape_clamp, w.fape_scale).mean()


def torsion_loss(out, batch) -> torch.Tensor:
    """Squared chord distance of the normalised (sin, cos) to the truth (or its pi-shifted
    alternative for symmetric chis), plus 0.02 x how far the raw vectors are from unit length.
    Averaged over structure-module layers, as AlphaFold's auxiliary loss."""
    mask = batch["torsion_mask"]
    true, alt = batch["torsion_sin_cos"], batch["alt_torsion_sin_cos"]
    angles, raw = out["angles"], out["unnormalized_angles"]        # [layers, B, L, 7, 2]
    d = torch.minimum(((angles - true) ** 2).sum(-1), ((angles - alt) ** 2).sum(-1))
    l_torsion = (d * mask).sum((-1, -2)) / (mask.sum((-1, -2)) + 1e-8)
    norm_err = (torch.sqrt((raw ** 2).sum(-1) + 1e-8) - 1).abs()
    seq = batch["seq_mask"][..., None]
    l_norm = (norm_err * seq).sum((-1, -2)) / (seq.sum((-1, -2)) * 7 + 1e-8)
    return (l_torsion + 0.02 * l_norm).mean()


def distogram_loss(out, batch) -> torch.Tensor:
    x, m = batch["pseudo_beta"], batch["pseudo_beta_mask"]
    target = distance_bin_index(x, torch.linspace(2.3125, 21.6875, DISTOGRAM_BINS - 1))
    ce = F.cross_entropy(out["distogram_logits"].permute(0, 3, 1, 2), target, reduction="none")
    pair = m[:, :, None] * m[:, None]
    return ((ce * pair).sum((-1, -2)) / (pair.sum((-1, -2)) + 1e-6)).mean()


def masked_msa_loss(out, batch) -> torch.Tensor:
    mask = batch["bert_mask"] * batch["msa_mask"]
    ce = F.cross_entropy(out["masked_msa_logits"].permute(0, 3, 1, 2), batch["true_msa"], reduction="none")
    return ((ce * mask).sum((-1, -2)) / (mask.sum((-1, -2)) + 1e-8)).mean()


def plddt_loss(out, batch) -> torch.Tensor:
    """Cross-entropy of the pLDDT head against the binned per-residue lDDT-Ca of the prediction."""
    ca = rc.ATOM37_INDEX["CA"]
    pred, true = out["atom37"][..., ca, :].detach(), batch["all_atom_positions"][..., ca, :]
    mask = batch["all_atom_mask"][..., ca]
    score = lddt(pred, true, mask, per_residue=True)
    target = (score * PLDDT_BINS).long().clamp(max=PLDDT_BINS - 1)
    ce = F.cross_entropy(out["plddt_logits"].permute(0, 2, 1), target, reduction="none")
    return ((ce * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()


def experimentally_resolved_loss(out, batch) -> torch.Tensor:
    """Sigmoid cross-entropy of the head's per-atom37 logits against which atoms were observed,
    over the atoms each residue type has."""
    logits, target = out["experimentally_resolved_logits"], batch["all_atom_mask"]
    exists = torch.as_tensor(rc.TABLES["atom37_mask"], device=logits.device, dtype=logits.dtype)[batch["aatype"]]
    exists = exists * batch["seq_mask"][..., None]
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return ((bce * exists).sum((-1, -2)) / (exists.sum((-1, -2)) + 1e-8)).mean()


def pae_loss(out, batch) -> torch.Tensor:
    """Cross-entropy of the aligned-error head: the error of residue j's CA, seen in residue i's
    backbone frame (prediction against truth), in 64 bins of 0.5 A (the last open), as AlphaFold."""
    pred = _frames(out["frames_rot"][-1].detach(), out["frames_trans"][-1].detach())
    true = _frames(batch["backbone_rot"], batch["backbone_trans"])
    local_pred = pred.unsqueeze(-1).invert_apply(pred.trans[..., None, :, :])
    local_true = true.unsqueeze(-1).invert_apply(true.trans[..., None, :, :])
    err = ((local_pred - local_true) ** 2).sum(-1)
    edges = torch.linspace(0.0, 31.0, PAE_BINS - 1, device=err.device, dtype=err.dtype)
    target = (err[..., None] > edges ** 2).sum(-1)
    ce = F.cross_entropy(out["pae_logits"].permute(0, 3, 1, 2), target, reduction="none")
    pair = batch["backbone_mask"][:, :, None] * batch["backbone_mask"][:, None]
    return ((ce * pair).sum((-1, -2)) / (pair.sum((-1, -2)) + 1e-8)).mean()


def alphafold_loss(out, batch, tables, w: LossWeights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    terms = {"fape_backbone": backbone_fape(out, batch, w), "fape_sidechain": sidechain_fape(out, batch, tables, w),
             "torsion": torsion_loss(out, batch), "distogram": distogram_loss(out, batch),
             "masked_msa": masked_msa_loss(out, batch), "plddt": plddt_loss(out, batch),
             "experimentally_resolved": experimentally_resolved_loss(out, batch)}
    if "pae_logits" in out:
        terms["pae"] = pae_loss(out, batch)
    if w.violation:
        terms["violation"] = structural_violations(out["atom14"], batch, tables)[0].mean()
    total = sum(getattr(w, k) * v for k, v in terms.items())
    return total, terms
