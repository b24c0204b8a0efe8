"""Predict a structure from a sequence (+ optional MSA) with trained weights.

    python -m apps.protein.predict --config apps/protein/configs/tiny.yaml \
        --checkpoint runs/protein/tiny --fasta seq.fasta [--msa seq.a3m] --out runs/protein/pred

Weights: a training output directory or one checkpoint (its EMA average when it has one), or
--params FILE for AlphaFold 2 (.npz) or OpenFold (.pt) parameters (apps.protein.weights).
Writes <out>/<name>.pdb and .cif (pLDDT in the B-factor column), <name>_confidence.png and
<name>.json (mean pLDDT, and metrics when --reference gives the true structure). With the PAE head
(`model.pae_head: true`, the `_ptm` parameters) it also prints the pTM score and writes
<name>_pae.png and <name>_pae.json (AlphaFold's layout: predicted_aligned_error,
max_predicted_aligned_error). Long sequences: `model.evoformer.chunk_size=64` (an override)
computes attention, the outer product mean and the triangle multiplications 64 rows at a time.
`train.precision=bf16` predicts in bf16 with AlphaFold's fp32 islands. Dynamic Axial
Parallelism: `phalanx run -n 2 -m apps.protein.predict ... dap_size=2` splits the Evoformer's
activations over 2 ranks (rank 0 writes the files).

Templates (a config with `model.templates: true`, e.g. for params_model_1/2): `--template
1abc.cif.gz:A` (repeatable) aligns the query to that chain with biotite; `--hhr hits.hhr
--template-dir DIR` takes the first `data.max_templates` hits of an HHsearch file, their mmCIFs
from DIR; `--template-dir DIR [--max-template-date YYYY-MM-DD]` alone searches DIR's mmCIF files
(every chain aligned to the query, AlphaFold's hit filters, apps.protein.templates.search_templates).
Without any of them, the prediction is AlphaFold's without hits.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from apps.protein.config import RecipeConfig, load_recipe, resolve
from apps.protein.data_sets import STRUCTURES
from apps.protein.features import FeatureConfig, make_features
from apps.protein.io import ProteinChain, read_fasta, read_msa
from apps.protein.model import AlphaFold
from apps.protein.output import plot_confidence, plot_pae, to_atom_array, write_structure


def latest_weights(path: Path) -> tuple[Path, Path | None]:
    """(model.safetensors, ema.safetensors or None) of a checkpoint or of the newest one in a run."""
    from phalanx.checkpoint.train_state import latest_checkpoint

    path = Path(path)
    step = path if (path / "model").is_dir() else latest_checkpoint(path)
    if step is None or not (step / "model" / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: no checkpoint with model/model.safetensors (give a training output_dir "
                                "or one of its checkpoints/step-* directories)")
    ema = step / "ema" / "ema.safetensors"
    return step / "model" / "model.safetensors", ema if ema.is_file() else None


def load_checkpoint_weights(model: AlphaFold, path: Path, ema: bool = True, new: tuple[str, ...] = ()) -> Path:
    """The weights of a training run or checkpoint into `model` (its EMA average with `ema` when the
    checkpoint has one, else the trained weights); every parameter must fit, except those under the
    prefixes `new` (modules the checkpoint's model lacked: they keep their initialisation). Returns
    the file read."""
    from safetensors.torch import load_file

    weights, ema_file = latest_weights(path)
    state = load_file(str(weights))
    if ema and ema_file is not None:
        state.update(load_file(str(ema_file)))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [f"{k} {tuple(v.shape)} (the model's {shapes[k]})" for k, v in state.items()
             if k in shapes and tuple(v.shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{weights}: does not fit the model of this config: {len(wrong)} arrays differ in shape, e.g. "
                         f"{wrong[0]}; pass the --config it was trained with (the same model section)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(new)] if new else missing
    if missing or unexpected:
        raise ValueError(f"{weights}: does not fit the model of this config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); pass the --config it was trained with (the same model "
                         "section)")
    return weights


def load_model(cfg: RecipeConfig, checkpoint: str | None = None, af2_params: str | None = None) -> AlphaFold:
    model = AlphaFold(cfg.model)
    if af2_params:
        from apps.protein.weights import load_params
        unused = load_params(model, af2_params)
        if unused:
            print(f"{af2_params}: its template stack ({len(unused)} arrays) is not used (model.templates is off), "
                  "so the prediction is AlphaFold's for a query without template hits")
    elif checkpoint:
        load_checkpoint_weights(model, resolve(checkpoint), ema=True)
    else:
        raise ValueError("give --checkpoint (a training run) or --params (AlphaFold 2 .npz / OpenFold .pt parameters)")
    from phalanx.amp import resolve_precision
    from phalanx.device import current_device

    device = current_device()  # the accelerator when there is one (real or emulated), else the CPU
    # train.precision: bf16 runs the Evoformer in bf16 and keeps AlphaFold's fp32 islands (the
    # structure module, heads, softmax and layer-norm statistics: docs/protein.md).
    dtype = resolve_precision(cfg.train.precision, device).compute_dtype
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def predict(model: AlphaFold, cfg: RecipeConfig, name: str, sequence: str, msa_file: str | None,
            recycles: int | None = None, templates: list | None = None) -> dict[str, np.ndarray]:
    """templates: `apps.protein.templates.Template`s aligned to `sequence` (None: no template inputs)."""
    if templates is not None and not cfg.model.templates:
        raise ValueError("templates given but the config has model.templates=false: use a config with the "
                         "template stack (and its weights)")
    length = len(sequence)
    chain = ProteinChain(name, sequence, np.zeros((length, 37, 3), np.float32), np.zeros((length, 37), np.float32),
                         np.arange(length, dtype=np.int64))
    alignment = read_msa(msa_file) if msa_file else None
    # Under DAP the residues are padded to a multiple of the group's size (padding is masked: the
    # prediction of the real residues does not change); the MSA depths already are (config check).
    ranks = model.axial.size
    fcfg = FeatureConfig(crop_size=-(-length // ranks) * ranks, max_msa_clusters=cfg.data.max_msa_clusters,
                         max_extra_msa=cfg.data.max_extra_msa, masked_msa_fraction=0.0,
                         max_templates=cfg.data.max_templates)
    feats = make_features(chain, alignment, fcfg, np.random.default_rng(0), with_truth=False, templates=templates)
    from phalanx.device import to_device

    batch = to_device({k: v[None] for k, v in feats.items()}, next(model.parameters()).device)
    out = model(**batch, recycles=recycles)
    keys = ("atom37", "atom37_mask", "plddt", "distogram_logits")
    result = {k: out[k] for k in keys}
    if "pae_logits" in out:
        from apps.protein.metrics import predicted_aligned_error, predicted_tm_score
        result["pae"] = predicted_aligned_error(out["pae_logits"])
        result["ptm"] = predicted_tm_score(out["pae_logits"], batch["seq_mask"])
    real = slice(0, length)
    trimmed = {k: v[0, real, real] if k in ("pae", "distogram_logits") else v[0] if k == "ptm" else v[0, real]
               for k, v in to_device(result, "cpu").items()}
    return {k: v.numpy() for k, v in trimmed.items()}


def write_prediction(pred: dict, sequence: str, name: str, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    arr = to_atom_array(sequence, pred["atom37"], pred["atom37_mask"], pred["plddt"])
    paths = {"pdb": write_structure(arr, out_dir / f"{name}.pdb"), "cif": write_structure(arr, out_dir / f"{name}.cif"),
             "png": plot_confidence(pred["plddt"], pred["distogram_logits"], out_dir / f"{name}_confidence.png",
                                    title=f"{name}: mean pLDDT {pred['plddt'].mean():.1f}")}
    if "pae" in pred:
        from apps.protein.metrics import pae_bin_centres
        max_error = float(pae_bin_centres()[-1])
        paths["pae_png"] = plot_pae(pred["pae"], out_dir / f"{name}_pae.png", max_error=max_error,
                                    title=f"{name}: pTM {float(pred['ptm']):.3f}")
        paths["pae_json"] = out_dir / f"{name}_pae.json"
        paths["pae_json"].write_text(json.dumps([{"predicted_aligned_error": np.round(pred["pae"], 2).tolist(),
                                                  "max_predicted_aligned_error": max_error}]))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Predict a protein structure.")
    parser.add_argument("--config", "-c", required=True, help="the recipe YAML the weights were trained with")
    parser.add_argument("--checkpoint", help="training output_dir or checkpoints/step-* directory")
    parser.add_argument("--params", "--af2-params", dest="af2_params",
                        help="AlphaFold 2 parameters (params_model_*.npz) or an OpenFold state dict (.pt) of the "
                             "config's layout (apps.protein.weights)")
    parser.add_argument("--fasta", required=True)
    parser.add_argument("--msa", help="A3M or Stockholm alignment of the sequence (default: the sequence alone)")
    parser.add_argument("--out", default="runs/protein/predictions")
    parser.add_argument("--recycles", type=int, default=None)
    parser.add_argument("--reference", help="true structure (mmCIF/PDB) to score the prediction against")
    parser.add_argument("--chain", help="chain of --reference (default: its first protein chain)")
    parser.add_argument("--template", action="append", default=[], metavar="MMCIF[:CHAIN]",
                        help="a template structure, aligned to the query with biotite (repeatable; model.templates)")
    parser.add_argument("--hhr", help="HHsearch .hhr hits of the query: its first data.max_templates hits are the "
                                      "templates (mmCIFs from --template-dir)")
    parser.add_argument("--template-dir",
                        help="a folder of mmCIF files (<pdb id>.cif[.gz]): with --hhr, where its hits' files are "
                             "(default: the shipped structures); without --hhr, searched for templates (every chain "
                             "aligned to the query, AlphaFold's filters, the best data.max_templates)")
    parser.add_argument("--max-template-date", metavar="YYYY-MM-DD",
                        help="with --template-dir: use only structures released on or before this date")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_recipe(args.config, args.overrides)
    if cfg.dap_size == 1:
        run(cfg, args)
        return
    from phalanx.launch import launched

    with launched(seed=cfg.train.seed):   # the process group of the DAP ranks
        run(cfg, args)


def dap_axial(dap_size: int):
    """`DapAxial` over all ranks when `dap_size` > 1 (one sequence split over the group), else one process."""
    import torch.distributed as dist

    from apps.protein.model.dap import Axial, DapAxial

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != dap_size:
        raise ValueError(f"predict with dap_size={dap_size} runs one sequence over exactly {dap_size} ranks, got {world}: "
                         f"launch with phalanx run -n {dap_size} -m apps.protein.predict ... dap_size={dap_size}")
    return DapAxial() if dap_size > 1 else Axial()


def read_templates(args: argparse.Namespace, sequence: str, cfg: RecipeConfig) -> list | None:
    """The --template / --hhr templates (checked before any weights load), or None."""
    from apps.protein.templates import parse_date

    cutoff = parse_date(args.max_template_date, "--max-template-date")
    search = bool(args.template_dir) and not args.hhr
    if cutoff is not None and not search:
        raise ValueError("--max-template-date filters the search of --template-dir (without --hhr): give "
                         "--template-dir DIR")
    if not args.template and not args.hhr and not search:
        return None
    if not cfg.model.templates:
        raise ValueError("--template/--hhr/--template-dir need a config with model.templates=true (the template stack "
                         "of params_model_1/2, or a model trained with templates)")
    from apps.protein.io import read_structure
    from apps.protein.templates import align_to_chain, search_templates, template_from_hit, templates_from_hhr

    out = []
    if search:
        room = cfg.data.max_templates - len(args.template)
        hits = search_templates(sequence, resolve(args.template_dir), room, cutoff) if room > 0 else []
        for hit in hits:
            print(f"template hit {hit.name}: score {hit.score}, identity {hit.identity:.2f}, coverage "
                  f"{hit.coverage:.2f}, released {hit.release_date}")
        if not hits:
            print(f"no template hit in {args.template_dir}" + (f" released by {cutoff}" if cutoff else "")
                  + ": predicting without templates")
        out += [hit.template for hit in hits]
    for spec in args.template:
        path, _, chain_id = spec.partition(":")
        chain = read_structure(resolve(path), chain_id or None)
        out.append(template_from_hit(align_to_chain(sequence, chain), sequence, chain, f"--template {spec}: "))
    if args.hhr:
        structures = resolve(args.template_dir) if args.template_dir else STRUCTURES
        out += templates_from_hhr(resolve(args.hhr), sequence, structures, cfg.data.max_templates)
    if len(out) > cfg.data.max_templates:
        raise ValueError(f"{len(out)} templates given, data.max_templates={cfg.data.max_templates}: pass fewer or raise it")
    for template in out:
        print(f"template {template.name}: {len(template.pairs)} of {len(sequence)} query residues aligned")
    return out


def run(cfg: RecipeConfig, args: argparse.Namespace) -> None:
    from phalanx.observe import is_main_process

    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    (header, sequence), *_ = read_fasta(args.fasta)
    name = header.split()[0].replace("/", "_") or "prediction"
    templates = read_templates(args, sequence, cfg)
    model = load_model(cfg, args.checkpoint, args.af2_params).use_axial(dap_axial(cfg.dap_size))
    pred = predict(model, cfg, name, sequence, args.msa, args.recycles, templates)
    if not is_main_process():
        return
    paths = write_prediction(pred, sequence, name, resolve(args.out))
    summary = {"name": name, "length": len(sequence), "mean_plddt": float(pred["plddt"].mean()),
               **({"ptm": float(pred["ptm"]), "mean_pae": float(pred["pae"].mean())} if "pae" in pred else {}),
               **{k: str(v) for k, v in paths.items()}}
    if args.reference:
        from apps.protein.evaluate import score_files
        summary["metrics"] = score_files(paths["pdb"], args.reference, ref_chain=args.chain)
    (resolve(args.out) / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
