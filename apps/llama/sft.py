"""Step 4b: supervised fine-tuning on chat data through `phalanx.train.fit`.

    python -m apps.llama.prepare_data --config apps/llama/configs/tiny.yaml --sft
    python -m apps.llama.sft --config apps/llama/configs/tiny.yaml
    phalanx run -n 2 -m apps.llama.sft --config apps/llama/configs/tiny.yaml sft.plugin=fsdp

Starts from `sft_init` (default: the latest pre-training checkpoint, else `<work_dir>/model_init`),
trains on `<work_dir>/sft_data/train` (labels only on assistant tokens) with the `sft` section of
the config, and reports the held-out assistant-token loss. Checkpoints carry the tokenizer with
the chat template the labels were made with.

    python -m apps.llama.sft --config apps/llama/configs/tiny.yaml lora.enabled=true lora.merge=true

trains LoRA adapters only (the config's `lora:` section) and writes `<sft.output_dir>/adapter`
(PEFT's format) and `<sft.output_dir>/merged` (the base with the adapter merged in).
"""
from __future__ import annotations

import sys
from pathlib import Path

from .config import RecipeConfig, parse_args
from .pretrain import export_lora, load_model, with_lora
from .rows import TokenRows
from .tokenizer_io import load_tokenizer


def sft_start_model(cfg: RecipeConfig) -> Path:
    """The model directory SFT starts from."""
    if cfg.sft_init:
        from .generate import resolve_model_dir
        return resolve_model_dir(cfg.sft_init, Path(cfg.train.output_dir))
    from phalanx.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(Path(cfg.train.output_dir))
    if ckpt is None:
        return cfg.model_init_dir
    model_dir, merged = Path(ckpt) / "model", Path(cfg.train.output_dir) / "merged"
    if not (model_dir / "config.json").is_file():  # a LoRA pre-training run: its checkpoints hold base + adapters
        if (merged / "config.json").is_file():
            return merged
        raise FileNotFoundError(f"the latest pre-training checkpoint {ckpt} holds a LoRA model (base + adapters), not "
                                f"a model SFT can start from: run pretrain with lora.merge=true (it writes {merged}), "
                                "or set sft_init to a model directory")
    return model_dir


def sft(cfg: RecipeConfig, model=None):
    from phalanx.train import causal_lm_eval, fit

    data_dir = cfg.sft_data_dir
    tokenizer = load_tokenizer(data_dir / "tokenizer")  # carries the chat template used for the labels
    model = model if model is not None else load_model(sft_start_model(cfg), cfg.sft.plugin, lora=cfg.lora.enabled)
    model = with_lora(model, cfg.lora)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise ValueError(f"the model has {model.get_input_embeddings().weight.shape[0]} embedding rows but the SFT "
                         f"tokenizer {len(tokenizer)} tokens: prepare the SFT data with the model's own tokenizer")
    train_rows, heldout = TokenRows(data_dir / "train"), TokenRows(data_dir / "heldout")
    eval_fn = causal_lm_eval(heldout, batch_size=cfg.eval.batch_size) if len(heldout) else None
    result = fit(cfg.sft, model, train_rows, eval_fn=eval_fn, tokenizer=tokenizer)
    export_lora(model, cfg.lora, result, Path(cfg.sft.output_dir), tokenizer)
    return result


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg, _ = parse_args("Supervised fine-tuning on chat data (labels on assistant turns only).", argv)
    with launched(seed=cfg.sft.seed) as ctx:
        result = sft(cfg)
        if ctx.is_main:
            held = result.last_eval.get("loss")
            print(f"SFT done at step {result.final_step}: train loss {result.losses[-1] if result.losses else float('nan'):.4f}"
                  + (f", held-out assistant-token loss {held:.4f}" if held is not None else "")
                  + f"; checkpoint {result.checkpoint_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
