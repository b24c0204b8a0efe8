"""Calibrate the pLDDT head on chains whose structure the model was not fitted to.

    python -m apps.protein.calibrate --config apps/protein/configs/tiny.yaml --checkpoint runs/protein/tiny

Why: AlphaFold trains its pLDDT head on the training structures, where a large model's accuracy
is what it will be on a new chain. A small model that memorises its few training crops learns
there that it is always right (the tiny default reports pLDDT ~89 on every chain, held-out
included, where its held-out lDDT-Ca is 0.2-0.85). What the head must see is the model's accuracy
on chains it did not fit: the shipped training chains beyond `max_train_chains` are such a set
(the structure losses never saw them), minus those from the same PDB entries as a held-out chain
(5kc1, 5zng), so the held-out chains stay unseen by the head as well.

What it does: the trunk is frozen (eval mode, EMA weights); for every calibration crop (random
windows of the calibration chains, and the fitted chains' evaluated crops and random windows,
where the model is right) it keeps the structure module's single representation, the head's
input, and the true per-residue lDDT-Ca of the model's own prediction. The pLDDT head (and only
it) is then trained on them with AlphaFold's pLDDT loss (cross-entropy over 50 bins). The atoms
do not change. Before/after figures on the held-out chains (mean pLDDT against the true lDDT,
Pearson correlation per residue) go to `<out>/calibration.json`; `<out>` holds the checkpoint with
the new head (`predict --checkpoint <out>`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from apps.protein.config import load_recipe, resolve
from apps.protein.data_sets import HELD_OUT, TRAIN
from apps.protein.dataset import fixed_crops, load_entries
from apps.protein.features import crop_window, make_features
from apps.protein.model.alphafold import PLDDT_BINS, plddt_from_logits
from apps.protein.scoring import CA, pearson, true_plddt
from phalanx.device import to_device
from phalanx.train.data import default_collate


def calibration_entries(fitted: int) -> list[tuple]:
    """The shipped training chains the structure losses did not see (beyond the first `fitted`),
    without the PDB entries of the held-out chains."""
    held_entries = {stem for stem, _, _ in HELD_OUT}
    if not fitted:
        raise ValueError("max_train_chains=0: every shipped chain was fitted, none is left to calibrate on; "
                         "train with max_train_chains < 12 (tiny.yaml: 4)")
    return [e for e in TRAIN[fitted:] if e[0] not in held_entries]


def random_crops(chains, data_cfg, per_chain: int, seed: int) -> list[tuple[str, dict]]:
    clean = replace(data_cfg, masked_msa_fraction=0.0)
    rng = np.random.default_rng(seed)
    return [(f"{chain.name}#{k}", make_features(chain, alignment, clean, rng, crop_window(chain, data_cfg.crop_size, rng)))
            for chain, alignment in chains for k in range(per_chain)]


@torch.no_grad()
def head_inputs(model, crops, recycles: int, batch_size: int = 4):
    """(single [N, L, c_s], target pLDDT [N, L] = 100 x true per-residue lDDT-Ca, mask [N, L],
    the head's current pLDDT [N, L]) of each crop."""
    device = next(model.parameters()).device
    singles, targets, masks, said = [], [], [], []
    for start in range(0, len(crops), batch_size):
        part = [f for _, f in crops[start:start + batch_size]]
        batch = to_device(default_collate(part), device)
        out = model(**batch, recycles=recycles)
        mask = batch["all_atom_mask"][..., CA]
        singles.append(out["single"].float().cpu())
        targets.append(true_plddt(out["atom37"][..., CA, :], batch["all_atom_positions"][..., CA, :], mask).float().cpu())
        masks.append(mask.float().cpu())
        said.append(out["plddt"].float().cpu())
    return torch.cat(singles), torch.cat(targets), torch.cat(masks), torch.cat(said)


def plddt_head_loss(head, single, target, mask) -> torch.Tensor:
    """AlphaFold's pLDDT loss: cross-entropy against the binned true lDDT, over observed residues."""
    bins = (target / 100 * PLDDT_BINS).long().clamp(0, PLDDT_BINS - 1)
    ce = F.cross_entropy(head(single).permute(0, 2, 1), bins, reduction="none")
    return (ce * mask).sum() / mask.sum().clamp(min=1)


def fit_head(head, single, target, mask, steps: int, lr: float, seed: int = 0) -> list[float]:
    """Full-batch Adam on the head only; returns the losses."""
    torch.manual_seed(seed)
    head.train()
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    device = next(head.parameters()).device
    single, target, mask = single.to(device), target.to(device), mask.to(device)
    losses = []
    for _ in range(steps):
        loss = plddt_head_loss(head, single, target, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    head.eval()
    return losses


def report(plddt: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, names: list[str]) -> dict:
    """Per chain and pooled over residues: mean pLDDT, mean true lDDT x 100, their mean absolute
    difference, and the Pearson correlation of the two per residue."""
    rows, keep = {}, mask > 0
    for i, name in enumerate(names):
        k = keep[i]
        rows[name] = {"plddt": float(plddt[i][k].mean()), "true_lddt": float(target[i][k].mean()),
                      "abs_error": float((plddt[i][k] - target[i][k]).abs().mean()),
                      "pearson": pearson(plddt[i][k], target[i][k])}
    rows["pooled"] = {"plddt": float(plddt[keep].mean()), "true_lddt": float(target[keep].mean()),
                      "abs_error": float((plddt[keep] - target[keep]).abs().mean()),
                      "pearson": pearson(plddt[keep], target[keep])}
    return rows


def calibrate(cfg, checkpoint: str, out_dir: Path, steps: int = 300, lr: float = 1e-3, windows: int = 8,
              seed: int = 0) -> dict:
    from safetensors.torch import save_file

    from apps.protein.predict import load_model

    model = load_model(cfg, checkpoint)
    fitted_entries = TRAIN[:cfg.max_train_chains or None]
    fitted = load_entries(fitted_entries)
    calibration = load_entries(calibration_entries(cfg.max_train_chains))
    crops = (random_crops(calibration, cfg.data, windows, seed) + fixed_crops(fitted, cfg.data)
             + random_crops(fitted, cfg.data, max(1, windows // 2), seed + 1))
    single, target, mask, _ = head_inputs(model, crops, cfg.eval_recycles)
    held = fixed_crops(load_entries(HELD_OUT), cfg.data)
    h_single, h_target, h_mask, h_before = head_inputs(model, held, cfg.eval_recycles)
    names = [name for name, _ in held]
    head = model.heads.plddt
    before = report(h_before, h_target, h_mask, names)
    losses = fit_head(head, single.to(next(head.parameters()).dtype), target, mask, steps, lr, seed)
    with torch.no_grad():
        h_after = plddt_from_logits(head(h_single.to(next(head.parameters()).device,
                                                       next(head.parameters()).dtype)).float()).cpu()
    after = report(h_after, h_target, h_mask, names)
    result = {"checkpoint": str(checkpoint), "calibration_chains": [f"{s}_{c}" for s, c, _ in calibration_entries(cfg.max_train_chains)],
              "calibration_crops": len(crops), "calibration_residues": int(mask.sum()),
              "calibration_true_lddt_mean": float((target * mask).sum() / mask.sum()),
              "steps": steps, "lr": lr, "loss_first_last": [losses[0], losses[-1]],
              "heldout_before": before, "heldout_after": after}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model").mkdir(exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model" / "model.safetensors"))
    (out_dir / "calibration.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Calibrate the pLDDT head on chains the model was not fitted to.")
    parser.add_argument("--config", "-c", required=True, help="the recipe YAML the checkpoint was trained with")
    parser.add_argument("--checkpoint", required=True, help="training output_dir or checkpoints/step-* directory")
    parser.add_argument("--out", help="where to write the calibrated checkpoint (default: <checkpoint>/calibrated)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--windows", type=int, default=8, help="random crops per calibration chain")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_recipe(args.config, args.overrides)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    out = resolve(args.out) if args.out else resolve(args.checkpoint) / "calibrated"
    result = calibrate(cfg, args.checkpoint, out, args.steps, args.lr, args.windows)
    print(json.dumps({k: result[k] for k in ("calibration_chains", "calibration_crops", "loss_first_last")}, indent=1))
    for when in ("before", "after"):
        print(when, json.dumps({k: {m: round(v, 3) for m, v in row.items()} for k, row in result[f"heldout_{when}"].items()}))


if __name__ == "__main__":
    main()
