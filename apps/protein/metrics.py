"""Structure metrics on Ca coordinates: lDDT-Ca, RMSD after Kabsch superposition, TM-score, GDT-TS.

All take predicted and true coordinates [..., L, 3] and a mask [..., L]; tests check them against
biotite's implementations and hand-built structures with known answers.
"""
from __future__ import annotations

import torch


def lddt(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor, cutoff: float = 15.0,
         per_residue: bool = False) -> torch.Tensor:
    """lDDT (Mariani et al. 2013) without stereochemistry checks: for every pair of residues closer
    than `cutoff` in the true structure, the share of the thresholds 0.5, 1, 2, 4 A that the
    predicted distance stays within. Superposition-free, so invariant to rigid motions. 0..1."""
    d_true = torch.cdist(true, true)
    d_pred = torch.cdist(pred, pred)
    n = mask.shape[-1]
    pair = (d_true < cutoff) * mask[..., :, None] * mask[..., None, :] * (1 - torch.eye(n, device=mask.device))
    err = (d_true - d_pred).abs()
    score = sum((err < t).to(pred.dtype) for t in (0.5, 1.0, 2.0, 4.0)) / 4
    if per_residue:
        return (pair * score).sum(-1) / (pair.sum(-1) + 1e-10)
    return (pair * score).sum((-1, -2)) / (pair.sum((-1, -2)) + 1e-10)


def kabsch(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotation [.., 3, 3], translation [.., 3]) moving `pred` onto `true` with the least squared
    deviation over the masked points (proper rotations only)."""
    w = mask[..., None]
    count = w.sum(-2).clamp(min=1)
    mu_p, mu_t = (pred * w).sum(-2) / count, (true * w).sum(-2) / count
    p, t = (pred - mu_p[..., None, :]) * w, (true - mu_t[..., None, :]) * w
    cov = p.transpose(-1, -2) @ t
    u, _, vh = torch.linalg.svd(cov.double())
    d = torch.sign(torch.linalg.det(u @ vh))
    fix = torch.diag_embed(torch.stack([torch.ones_like(d), torch.ones_like(d), d], -1))
    rot = (u @ fix @ vh).transpose(-1, -2).to(pred.dtype)
    return rot, mu_t - torch.einsum("...ij,...j->...i", rot, mu_p)


def superimpose(pred, true, mask):
    rot, trans = kabsch(pred, true, mask)
    return torch.einsum("...ij,...lj->...li", rot, pred) + trans[..., None, :]


def rmsd(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Root-mean-square deviation after optimal superposition (A)."""
    moved = superimpose(pred, true, mask)
    return torch.sqrt((((moved - true) ** 2).sum(-1) * mask).sum(-1) / mask.sum(-1).clamp(min=1))


def _best_superposition_score(pred, true, mask, score_fn, cutoff: float, iterations: int = 4, seeds=(4, 8, 12)):
    """max over superpositions of score_fn(distances): each fitted on a seed window of residues
    (the whole chain, and windows of 4, 8, 12), then refitted on the residues within `cutoff`
    (the heuristic of TM-score and LGA). All windows run as one batch."""
    index = torch.nonzero(mask > 0).flatten()
    n = len(index)
    windows = [mask.clone()]
    for size in seeds:
        size = min(size, n)
        if size >= 3:
            for s in range(0, n - size + 1, max(1, size // 2)):
                w = torch.zeros_like(mask)
                w[index[s:s + size]] = 1
                windows.append(w)
    sub = torch.stack(windows)                                   # [W, L]
    best = torch.zeros((), dtype=pred.dtype)
    for _ in range(iterations):
        usable = sub.sum(-1) >= 3
        if not usable.any():
            break
        sub = sub[usable]
        moved = superimpose(pred.expand(len(sub), -1, -1), true.expand(len(sub), -1, -1), sub)
        dist = torch.sqrt(((moved - true) ** 2).sum(-1))         # [W, L]
        best = torch.maximum(best, torch.stack([score_fn(d) for d in dist]).max())
        sub = ((dist < cutoff) * mask).to(mask.dtype)
    return best


def tm_score(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TM-score (Zhang & Skolnick 2004) of one chain [L, 3], normalised by the true chain's length:
    mean of 1 / (1 + (d / d0)^2) under the best superposition found."""
    n = float(mask.sum())
    d0 = max(1.24 * max(n - 15.0, 1.0) ** (1 / 3) - 1.8, 0.5)
    return _best_superposition_score(pred, true, mask, lambda d: ((1 / (1 + (d / d0) ** 2)) * mask).sum() / n,
                                     cutoff=d0)


def gdt_ts(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GDT-TS of one chain [L, 3]: the mean over 1, 2, 4, 8 A of the largest share of residues
    within that distance under one superposition (searched per cutoff)."""
    n = mask.sum()
    parts = [_best_superposition_score(pred, true, mask, lambda d, c=c: ((d < c) * mask).sum() / n, cutoff=c)
             for c in (1.0, 2.0, 4.0, 8.0)]
    return torch.stack(parts).mean()


def pae_bin_centres(bins: int = 64, max_error: float = 31.0, device=None, dtype=torch.float32) -> torch.Tensor:
    """Centres of the aligned-error head's bins (AlphaFold's _ptm models): `bins - 1` edges evenly
    over 0..max_error, each bin's centre half a step above its lower edge, the open last bin one
    step above the one before (0.25, 0.75, ..., 31.75 A for 64 bins)."""
    edges = torch.linspace(0.0, max_error, bins - 1, device=device, dtype=dtype)
    step = edges[1] - edges[0]
    return torch.cat([edges + step / 2, (edges[-1:] + step * 1.5)])


def predicted_aligned_error(pae_logits: torch.Tensor) -> torch.Tensor:
    """Expected aligned error [.., L, L] (A) of residue j in residue i's frame: sum over bins of
    probability x bin centre."""
    centres = pae_bin_centres(pae_logits.shape[-1], device=pae_logits.device, dtype=torch.float32)
    return (torch.softmax(pae_logits.float(), -1) * centres).sum(-1)


def predicted_tm_score(pae_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """pTM (AlphaFold 2 supplement 1.9.7): for each aligned residue i, the expected TM-score term
    1 / (1 + (e_ij / d0)^2) under the head's error distribution, averaged over residues j; the
    best i. d0 = 1.24 (N - 15)^(1/3) - 1.8 with N the residue count, at least 19."""
    centres = pae_bin_centres(pae_logits.shape[-1], device=pae_logits.device, dtype=torch.float32)
    if mask is None:
        mask = torch.ones(pae_logits.shape[:-2], device=pae_logits.device)
    mask = mask.float()
    n = mask.sum(-1).clamp(min=19)
    d0 = 1.24 * (n - 15) ** (1 / 3) - 1.8
    term = 1 / (1 + (centres / d0[..., None]) ** 2)                           # [.., bins]
    expected = (torch.softmax(pae_logits.float(), -1) * term[..., None, None, :]).sum(-1)  # [.., L, L]
    per_alignment = (expected * mask[..., None, :]).sum(-1) / (mask.sum(-1, keepdim=True) + 1e-8)
    return (per_alignment * mask).amax(-1)
