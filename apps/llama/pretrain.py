"""Step 4a: continual pre-training through `phalanx.train.fit`.

    python -m apps.llama.pretrain --config apps/llama/configs/tiny.yaml
    phalanx run -n 2 -m apps.llama.pretrain --config apps/llama/configs/tiny.yaml train.plugin=zero2
    torchrun --nproc-per-node 8 -m apps.llama.pretrain --config apps/llama/configs/llama2_7b_zero2.yaml

The app supplies the model (`<work_dir>/model_init`), the packed rows (`<work_dir>/data/train`) and
an eval function (held-out bits per character per category); the loop, the parallel plugin
(`train.plugin`), checkpoints, resume, logging and metrics come from phalanx. Re-running the same
command continues from the latest checkpoint in `train.output_dir`.

With `lora.enabled: true` (the config's `lora:` section) the base is frozen and only LoRA adapters
train; the adapter is written to `<train.output_dir>/adapter` (and merged, with `lora.merge`).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from phalanx.booster.lora import with_lora

from .config import EvalConfig, LoRAConfig, RecipeConfig, parse_args
from .evaluate import Chunk, bits_per_char, flat_metrics, load_heldout_chunks
from .rows import TokenRows
from .tokenizer_io import load_tokenizer


def bpc_eval_fn(tokenizer, chunks: list[Chunk], ecfg: EvalConfig) -> Callable:
    """eval_fn(model, step) for fit: bits per character (and char perplexity, token loss) per category.

    Every rank scores the same chunks, so the number of forward passes is equal on all ranks
    (FSDP gathers parameters inside forward; tensor and pipeline peers run together) and every
    rank returns the same numbers."""
    def eval_fn(model, step: int) -> dict[str, float]:
        return flat_metrics(bits_per_char(model, tokenizer, chunks, ecfg.batch_size, ecfg.precision))
    return eval_fn


def load_model(model_dir: Path, plugin: str | None = None, lora: bool = False):
    """The model in `model_dir`, in fp32; on the meta device when `plugin` shards parameters (the
    plugin then reads only each rank's part: phalanx.booster.plugins.builds_lazily, phalanx.lazy;
    with `lora` the adapters are added to the lazy base, docs/lora.md)."""
    from transformers import AutoModelForCausalLM

    from phalanx.booster.plugins import builds_lazily

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {model_dir}: run `python -m apps.llama.init_model` with the same config first")
    if builds_lazily(plugin, lora=lora):
        from phalanx import lazy
        return lazy.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def export_lora(model, lora: LoRAConfig, result, output_dir: Path, tokenizer=None) -> None:
    """After a LoRA run: rank 0 writes `<output_dir>/adapter` (PEFT's format) and, with `lora.merge`,
    `<output_dir>/merged` (plain HF) from the run's last checkpoint; every rank waits for it."""
    if not lora.enabled:
        return
    from phalanx.booster.lora import export_from_checkpoint
    from phalanx.checkpoint.atomic import atomic_directory

    if result.checkpoint_dir is None:
        raise RuntimeError(f"LoRA run in {output_dir} ended without a checkpoint to export the adapter from")
    model_dir = Path(result.checkpoint_dir) / "model"
    targets = [("adapter", False)] + ([("merged", True)] if lora.merge else [])
    for name, merge in targets:
        with atomic_directory(output_dir / name) as tmp:  # collective: rank 0 writes, the others wait
            if torch.distributed.get_rank() == 0:
                export_from_checkpoint(model, model_dir, tmp, merge=merge, tokenizer=tokenizer)


def pretrain(cfg: RecipeConfig, model=None, with_eval: bool = True):
    """Train as `cfg.train` says; returns phalanx's TrainResult (on every rank).

    `model`: an already loaded model (default: `<work_dir>/model_init`); `with_eval=False` skips the
    held-out evaluation inside the loop (the demo measures before and after itself)."""
    from phalanx.train import fit

    tokenizer = load_tokenizer(cfg.model_init_dir if (cfg.model_init_dir / "tokenizer_config.json").exists()
                               else cfg.tokenizer_dir)
    model = model if model is not None else load_model(cfg.model_init_dir, cfg.train.plugin, lora=cfg.lora.enabled)
    model = with_lora(model, cfg.lora)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise ValueError(f"the model has {model.get_input_embeddings().weight.shape[0]} embedding rows but the tokenizer "
                         f"{len(tokenizer)} tokens: re-run init_model after expand_vocab")
    rows = TokenRows(cfg.data_dir / "train")
    eval_fn = None
    if with_eval:
        chunks = load_heldout_chunks(cfg.data_dir, cfg.eval.chunk_chars, cfg.eval.max_chars_per_category)
        eval_fn = bpc_eval_fn(tokenizer, chunks, cfg.eval) if chunks else None
    result = fit(cfg.train, model, rows, eval_fn=eval_fn, tokenizer=tokenizer)
    export_lora(model, cfg.lora, result, Path(cfg.train.output_dir), tokenizer)
    return result


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    from phalanx.launch import barrier

    from .steps import prepare_missing

    cfg, _ = parse_args("Continual pre-training of the initialised model on the prepared data.", argv)
    with launched(seed=cfg.train.seed) as ctx:
        if ctx.is_main:  # a fresh checkout: the tokenizer, initial model and rows are made first
            prepare_missing(cfg, log=lambda line: print(f"[llama] {line}", flush=True))
        barrier()
        result = pretrain(cfg)
        if ctx.is_main:
            evals = ", ".join(f"{k}={v:.3f}" for k, v in sorted(result.last_eval.items()) if k.endswith("bpc"))
            print(f"pre-training done at step {result.final_step}: loss {result.losses[-1] if result.losses else float('nan'):.4f}"
                  f"{', ' + evals if evals else ''}; checkpoint {result.checkpoint_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
