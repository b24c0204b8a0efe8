"""Train the AlphaFold-style model on crops of the shipped structures, through `phalanx.train.fit`.

    python -m apps.protein.train --config apps/protein/configs/tiny.yaml
    phalanx run -n 2 -m apps.protein.train --config apps/protein/configs/tiny.yaml train.micro_batch_size=2
    phalanx run -n 2 -m apps.protein.train --config apps/protein/configs/tiny.yaml dap_size=2   # one sample, 2 ranks
    python -m apps.protein.train --config apps/protein/configs/tiny_finetune.yaml   # fine-tune runs/protein/tiny

Flow: chains + MSAs read once -> crops (random, or each chain's fixed evaluated window with
`data.random_crop: false`, as tiny.yaml; fresh MSA sampling and masking every item) ->
`fit` with the AlphaFold loss, EMA as a hook (AlphaFold averages its weights with decay 0.999) and
an eval that predicts each chain's fixed crop with the EMA weights and scores it (lDDT-Ca, RMSD,
TM-score, GDT-TS) -> `<output_dir>/eval.json`. Re-running continues from the latest checkpoint.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from apps.protein.config import RecipeConfig, parse_args
from apps.protein.dataset import CropDataset, fixed_crops, train_and_heldout
from apps.protein.losses import alphafold_loss
from apps.protein.model import AlphaFold
from apps.protein.model.dap import DapAxial
from apps.protein.scoring import score_baselines, score_crops, summarise

EVAL_FILE = "eval.json"


def build_model(cfg: RecipeConfig) -> AlphaFold:
    from phalanx.launch import seed_everything

    seed_everything(cfg.train.seed)  # the same initial weights on every rank and every run
    return AlphaFold(cfg.model)


FINE_TUNING_HEADS = ("heads.pae.",)


def initial_weights(cfg: RecipeConfig) -> Path | None:
    """The `init_from` weights to start from, or None: none given, or output_dir already holds a
    checkpoint (fit resumes from it). Checked before any data or model is built."""
    if not cfg.init_from:
        return None
    from phalanx.checkpoint.train_state import latest_checkpoint

    if Path(cfg.train.output_dir).is_dir() and latest_checkpoint(Path(cfg.train.output_dir)) is not None:
        return None
    path = Path(cfg.init_from)
    if not path.exists():
        raise FileNotFoundError(f"init_from={cfg.init_from}: no such file or directory; give the initial training's "
                                "output_dir (train.output_dir of its config), one of its checkpoints/step-* "
                                "directories, or AlphaFold .npz / OpenFold .pt parameters")
    return path


def load_initial_weights(model: AlphaFold, path: Path) -> None:
    """Fine-tuning's starting point into `model`: a training run's trained weights, or parameters."""
    if path.is_file() and path.suffix.lower() in (".npz", ".pt", ".pth", ".ckpt"):
        from apps.protein.weights import load_params
        unused = load_params(model, path)
        if unused:
            print(f"init_from {path}: {len(unused)} arrays unused (the template stack; model.templates is off)")
        return
    from apps.protein.predict import load_checkpoint_weights
    from phalanx.observe import is_main_process

    # The PAE head may be new (AlphaFold's _ptm models added it when fine-tuning): it starts fresh.
    new = FINE_TUNING_HEADS if model.cfg.pae_head else ()
    read = load_checkpoint_weights(model, path, ema=False, new=new)
    if is_main_process():
        print(f"init_from: starting from {read}")


def dap_group(size: int):
    """This rank's DAP group: consecutive ranks `size` at a time (every rank creates every group,
    as torch.distributed requires)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"dap_size={size} needs a world size that is a multiple of it, got {world} ranks: "
                         f"launch with phalanx run -n {size * max(1, world // size)} or change dap_size")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine


def with_dap_replicas(cfg: RecipeConfig):
    """The train config fit gets: with dap_size > 1, DDP whose data replicas are the DAP groups
    (`ranks_per_replica`): the ranks of a group see the same crops and random numbers, gradients
    are averaged over every rank (docs/protein.md). DAP is tested under DDP only."""
    return cfg.train.with_replica_groups(cfg.dap_size, "dap_size", plugins=("ddp",))


def make_loss_fn(cfg: RecipeConfig):
    """loss_fn(boosted model, batch) for fit: one random number of recycling passes per step
    (0..model.recycles, AlphaFold's training), the AlphaFold loss on the last pass."""
    from phalanx.booster import unwrap_model

    def loss_fn(model, batch):
        inner = unwrap_model(model)
        recycles = int(torch.randint(0, cfg.model.recycles + 1, ()).item())
        out = model(**batch, recycles=recycles)
        tables = {"default_frames": inner.default_frames, "atom14_local": inner.atom14_local}
        total, _ = alphafold_loss(out, batch, tables, cfg.loss)
        return total

    return loss_fn


def make_eval_fn(cfg: RecipeConfig, train_crops, heldout_crops, ema, output_dir: Path):
    # The trivial baselines on the same held-out crops (fixed, so scored once): the held-out
    # figures mean something only above them.
    baselines = score_baselines(heldout_crops) if heldout_crops else {}
    baseline_summary = {f"baseline_{kind}_heldout_{k}": value for kind, metrics in baselines.items()
                        for k, value in metrics.items() if k in ("lddt_ca", "tm_score")}

    def eval_fn(model, step):
        with (ema.swapped() if ema is not None else _nothing()):
            train = score_crops(model, train_crops, cfg.eval_recycles)
            held = score_crops(model, heldout_crops, cfg.eval_recycles) if heldout_crops else {}
        summary = summarise(train, "train") | (summarise(held, "heldout") | baseline_summary if held else {})
        from phalanx.observe import is_main_process
        if is_main_process():
            (output_dir / EVAL_FILE).write_text(json.dumps({"step": step, "summary": summary, "train": train,
                                                            "heldout": held, "baselines": baselines}, indent=1))
        return summary

    return eval_fn


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def train(cfg: RecipeConfig):
    from phalanx.train import EMA, fit

    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train_cfg = with_dap_replicas(cfg)
    init = initial_weights(cfg)
    train_chains, held_chains = train_and_heldout(cfg.max_train_chains, cfg.eval_heldout)
    dataset = CropDataset(train_chains, cfg.data, cfg.samples_per_epoch)
    model = build_model(cfg)
    if init is not None:
        load_initial_weights(model, init)
    if cfg.dap_size > 1:
        model.use_axial(DapAxial(dap_group(cfg.dap_size)))
    ema = EMA(cfg.ema.decay, cfg.ema.warmup) if cfg.ema.enabled else None
    output_dir = Path(cfg.train.output_dir)
    eval_fn = make_eval_fn(cfg, fixed_crops(train_chains, cfg.data), fixed_crops(held_chains, cfg.data), ema,
                           output_dir)
    result = fit(train_cfg, model, dataset, loss_fn=make_loss_fn(cfg), eval_fn=eval_fn,
                 hooks=[ema] if ema is not None else ())
    return result, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched
    from phalanx.observe import is_main_process

    cfg, _ = parse_args("Train an AlphaFold-style model on the shipped protein structures.", argv)
    with launched(seed=cfg.train.seed):
        result, seconds = train(cfg)
        if is_main_process():
            print(f"done at step {result.final_step} in {seconds:.0f} s: loss {result.losses[0]:.3f} (first) -> "
                  f"{result.losses[-1]:.3f} (last); eval {json.dumps(result.last_eval)}" if result.losses else
                  f"nothing to do: already at step {result.final_step}; eval {result.last_eval}")


if __name__ == "__main__":
    main()
