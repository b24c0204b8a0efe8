"""AlphaFold's training losses (supplement section 1.9): FAPE on backbone frames and on all atoms
(clamped), torsion angles, distogram, masked MSA and pLDDT.

`alphafold_loss(out, batch, weights)` returns the weighted total and each term (for logging).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from apps.protein import constants as rc
from apps.protein.metrics import lddt
from apps.protein.model.alphafold import DISTOGRAM_BINS, PLDDT_BINS
from apps.protein.rigid import Rigid
from apps.protein.sidechains import group_frames


@dataclass
class LossWeights:
    fape_backbone: float = 0.5     # averaged over structure-module layers (AlphaFold's aux FAPE)
    fape_sidechain: float = 0.5    # all atoms in all rigid-group frames, final layer
    torsion: float = 1.0           # AlphaFold weights it inside the aux loss (x0.5)
    distogram: float = 0.3
    masked_msa: float = 2.0
    plddt: float = 0.01
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


def _group_mask(aatype: torch.Tensor, torsion_mask: torch.Tensor, backbone_mask: torch.Tensor) -> torch.Tensor:
    """[B, L, 8]: which rigid groups exist (backbone, psi, and the residue's chis)."""
    chi = torch.as_tensor(rc.TABLES["chi_mask"], device=aatype.device, dtype=backbone_mask.dtype)[aatype]
    zero = torch.zeros_like(backbone_mask)
    return torch.stack([backbone_mask, zero, zero, torsion_mask[..., 2], *chi.unbind(-1)], -1) * backbone_mask[..., None]


def sidechain_fape(out, batch, tables, w: LossWeights) -> torch.Tensor:
    """All-atom FAPE of the final structure; for residues with a symmetric side chain (ASP, GLU,
    PHE, TYR) the truth takes the naming of those atoms that fits the prediction better."""
    aatype = batch["aatype"]
    pred14, exists = out["atom14"], batch["atom14_gt_exists"]
    gt, alt = batch["atom14_gt_positions"], batch["atom14_alt_gt_positions"]
    err_gt = (((pred14 - gt) ** 2).sum(-1) * exists).sum(-1)
    err_alt = (((pred14 - alt) ** 2).sum(-1) * exists).sum(-1)
    truth = torch.where((err_alt < err_gt)[..., None, None], alt, gt)
    true_bb = _frames(batch["backbone_rot"], batch["backbone_trans"])
    true_groups = group_frames(true_bb, batch["torsion_sin_cos"], aatype, tables)
    pred_groups = _frames(out["group_rot"], out["group_trans"])
    gmask = _group_mask(aatype, batch["torsion_mask"], batch["backbone_mask"])
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
    edges = torch.linspace(2.3125, 21.6875, DISTOGRAM_BINS - 1, device=out["distogram_logits"].device)
    x, m = batch["pseudo_beta"], batch["pseudo_beta_mask"]
    d2 = ((x[:, :, None] - x[:, None]) ** 2).sum(-1, keepdim=True)
    target = (d2 > edges ** 2).sum(-1)
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


def alphafold_loss(out, batch, tables, w: LossWeights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    terms = {"fape_backbone": backbone_fape(out, batch, w), "fape_sidechain": sidechain_fape(out, batch, tables, w),
             "torsion": torsion_loss(out, batch), "distogram": distogram_loss(out, batch),
             "masked_msa": masked_msa_loss(out, batch), "plddt": plddt_loss(out, batch)}
    total = sum(getattr(w, k) * v for k, v in terms.items())
    return total, terms
