"""Text-to-image fine-tuning (or training from scratch) of a Stable Diffusion UNet.

    python -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/tiny_emoji.yaml
    phalanx run -n 2 -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/tiny_emoji.yaml train.plugin=zero2
    torchrun --nproc-per-node 8 -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/sd15_text_to_image.yaml

Flow: components (built from config, or a local diffusers directory) -> every image encoded once
by the frozen VAE (cached) -> `phalanx.train.fit` on the DiffusionTrainModel with EMA as a hook
and a validation grid as eval -> the final weights (EMA) saved as a diffusers pipeline in
`final_dir` (default `<output_dir>/pipeline`). Re-running continues from the latest checkpoint.
"""
from __future__ import annotations

import time
from pathlib import Path

from phalanx.observe import is_main_process

from .components import load_components
from .config import RecipeConfig, resolve
from .data import LatentCaptionDataset, cached_latents, read_captioned_folder, tokenize
from .recipe import (build_train_model, cache_dir, export_pipeline, fit_with_validation, latent_scaling_factor,
                     record_scaling_factor, run_script)

VAL_SAMPLES = 16


def prepare_dataset(cfg: RecipeConfig, parts) -> LatentCaptionDataset:
    pairs = read_captioned_folder(resolve(cfg.data.root), cfg.data.max_images, cfg.data.exclude)
    latents = cached_latents(parts.vae, [p for p, _ in pairs], cfg.data.resolution,
                             cache_dir(cfg), tuple(cfg.data.background))
    factor = latent_scaling_factor(cfg, parts, latents)
    record_scaling_factor(Path(cfg.train.output_dir), factor)
    return LatentCaptionDataset(latents, tokenize(parts.tokenizer, [c for _, c in pairs]), factor)


def train(cfg: RecipeConfig):
    """Train as `cfg` says; returns (TrainResult, path of the saved pipeline or None off rank 0)."""
    from phalanx.launch import seed_everything

    t0 = time.perf_counter()
    seed_everything(cfg.train.seed)  # the same initial weights on every rank and every run
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    dataset = prepare_dataset(cfg, parts)
    model = build_train_model(cfg, parts)
    n = min(VAL_SAMPLES, len(dataset))
    val_batch = {"latents": dataset.latents[:n], "prompt_ids": dataset.prompt_ids[:n]}
    result = fit_with_validation(cfg, parts, model, dataset, cfg.validation.prompts, val_batch)
    final = None
    if is_main_process():
        final = export_pipeline(cfg, result.checkpoint_dir, cfg.final_path)
        print(f"pipeline saved to {final} ({time.perf_counter() - t0:.0f} s in all)")
    return result, final


def main(argv: list[str] | None = None) -> None:
    run_script("Text-to-image training of a Stable Diffusion UNet.", train, argv)


if __name__ == "__main__":
    main()
