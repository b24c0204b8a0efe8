"""Score a predicted structure against a reference: lDDT-Ca, RMSD, TM-score, GDT-TS.

    python -m apps.protein.evaluate --pred runs/protein/pred/x.pdb --ref apps/protein/data/structures/2q2k.cif.gz --ref-chain A

Residues are matched by position in the sequence; the reference's unobserved residues are left out.
"""
from __future__ import annotations

import argparse
import json

import torch

from apps.protein import constants as rc
from apps.protein.io import ProteinInputError, read_structure
from apps.protein.scoring import ca_metrics

CA = rc.ATOM37_INDEX["CA"]


def score_files(pred_path, ref_path, pred_chain: str | None = None, ref_chain: str | None = None) -> dict[str, float]:
    pred = read_structure(pred_path, pred_chain)
    ref = read_structure(ref_path, ref_chain)
    if pred.sequence != ref.sequence:
        raise ProteinInputError(f"{pred_path} ({len(pred.sequence)} residues) and {ref_path} ({len(ref.sequence)}) "
                                "have different sequences: predict the reference's full sequence (entity_poly)")
    mask = torch.as_tensor(ref.atom37_mask[:, CA] * pred.atom37_mask[:, CA])
    if mask.sum() < 3:
        raise ProteinInputError(f"{ref_path}: fewer than 3 residues observed in both structures")
    result = ca_metrics(torch.as_tensor(pred.atom37[:, CA]), torch.as_tensor(ref.atom37[:, CA]), mask)
    result["residues_scored"] = int(mask.sum())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Score a predicted protein structure against a reference.")
    parser.add_argument("--pred", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--pred-chain")
    parser.add_argument("--ref-chain")
    args = parser.parse_args(argv)
    print(json.dumps(score_files(args.pred, args.ref, args.pred_chain, args.ref_chain), indent=1))


if __name__ == "__main__":
    main()
