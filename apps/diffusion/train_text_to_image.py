"""Text-to-image fine-tuning (or training from scratch) of a Stable Diffusion UNet, or of LoRA
adapters on it (`lora.rank > 0`; `python -m apps.diffusion.train_text_to_image_lora` is this
script with LoRA on by default).

    python -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/tiny_emoji.yaml
    phalanx run -n 2 -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/tiny_emoji.yaml train.plugin=zero2
    torchrun --nproc-per-node 8 -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/sd15_text_to_image.yaml

Flow: components (built from config, or a local diffusers directory) -> the captioned images split
into training and held-out ones (`validation.held_out` drawn from `data.root`, or
`validation.root`) -> the images encoded by the frozen VAE (cached; with `data.random_flip` the
mirrored view too; with `data.random_crop` training crops are encoded in each step instead) ->
with `lora.rank` adapters added -> `phalanx.train.fit` on the DiffusionTrainModel with EMA as a hook
and as eval the fixed-noise loss of the held-out images plus a validation grid -> the final weights
(EMA) saved as a diffusers pipeline in `final_dir` (default `<output_dir>/pipeline`), or with LoRA
the adapters in `<output_dir>/lora`. Re-running continues from the latest checkpoint.

An SDXL directory trains the same way: `prompt_ids` holds both tokenizers' ids, and every sample
also carries `time_ids` (original size, crop top-left, target size; see data.size_crop_ids), which
the training step moves to the crop / flip it actually draws (data.view_time_ids).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from phalanx.observe import is_main_process

from .components import load_components
from .config import RecipeConfig, resolve
from .data import (LatentCaptionDataset, PixelCaptionDataset, TrainingViews, cached_latents, read_captioned_folder,
                   size_crop_table, split_held_out, tokenize_all)
from .recipe import (add_lora_adapters, build_train_model, cache_dir, fit_with_validation, latent_scaling_factor,
                     record_scaling_factor, run_script, save_trained, trained_model)


@dataclass
class Prepared:
    """The training set, the held-out batch (scaled plain-view latents and prompt ids; None when
    nothing is held out), the image lists of both, and the training step's views (None: no augmentation)."""
    dataset: Dataset
    val_batch: dict | None
    train_pairs: list[tuple[Path, str]]
    held_out_pairs: list[tuple[Path, str]]
    views: TrainingViews | None


def split_images(cfg: RecipeConfig) -> tuple[list, list]:
    """(training, held-out) (image, caption) pairs; held-out ones are never trained on."""
    d, v = cfg.data, cfg.validation
    pairs = read_captioned_folder(resolve(d.root), None, d.exclude)
    if v.root:
        held = read_captioned_folder(resolve(v.root))
        shared = {p.resolve() for p, _ in pairs} & {p.resolve() for p, _ in held}
        if shared:
            raise ValueError(f"validation.root {v.root} shares {len(shared)} image(s) with data.root, e.g. "
                             f"{sorted(shared)[0]}: held-out images must not be trained on; list them in "
                             "data.exclude or use another folder")
        train_pairs = pairs
    else:
        train_pairs, held = split_held_out(pairs, v.held_out, v.seed) if v.held_out else (pairs, [])
    if is_main_process():
        print(f"validation: {len(held)} held-out image(s) never trained on "
              f"({'validation.root' if v.root else 'validation.held_out'})")
    return train_pairs[:d.max_images] if d.max_images else train_pairs, held


def prepare_dataset(cfg: RecipeConfig, parts) -> Prepared:
    d, cache, background = cfg.data, cache_dir(cfg), tuple(cfg.data.background)
    train_pairs, held = split_images(cfg)
    paths, ids = [p for p, _ in train_pairs], tokenize_all(parts.tokenizers, [c for _, c in train_pairs])

    def time_ids(files: list[Path]):  # SDXL's size / crop conditioning of the centre view
        return size_crop_table(files, d.resolution, d.resize_scale) if parts.is_xl else None

    def plain(files: list[Path]):
        return cached_latents(parts.vae, files, d.resolution, cache, background, resize_scale=d.resize_scale)

    factor = latent_scaling_factor(cfg, parts, lambda: plain(paths))
    record_scaling_factor(Path(cfg.train.output_dir), factor)
    views, size = None, round(d.resolution * d.resize_scale)  # size: the resized square views are cut from
    if d.random_crop:  # a new crop every step: encoded in the step, no training latents cached
        dataset = PixelCaptionDataset(paths, ids, size, background, time_ids(paths))
        views = TrainingViews(d.resolution, d.random_flip, parts.vae, factor)
    else:
        flipped = cached_latents(parts.vae, paths, d.resolution, cache, background, flip=True,
                                 resize_scale=d.resize_scale) if d.random_flip else None
        dataset = LatentCaptionDataset(plain(paths), ids, factor, flipped, time_ids(paths))
        views = TrainingViews(d.resolution, True, square=size) if d.random_flip else None
    val_batch = None
    if held:
        val_batch = {"latents": plain([p for p, _ in held]) * factor,
                     "prompt_ids": tokenize_all(parts.tokenizers, [c for _, c in held])}
        if parts.is_xl:
            val_batch["time_ids"] = time_ids([p for p, _ in held])
    return Prepared(dataset, val_batch, train_pairs, held, views)


def grid_prompts(cfg: RecipeConfig, prepared: Prepared) -> list[str]:
    """The configured prompts, then the first `validation.held_out_prompts` held-out captions."""
    return list(cfg.validation.prompts) + [c for _, c in prepared.held_out_pairs[:cfg.validation.held_out_prompts]]


def train(cfg: RecipeConfig):
    """Train as `cfg` says; returns (TrainResult, the saved pipeline or LoRA directory; None off rank 0)."""
    from phalanx.launch import seed_everything

    t0 = time.perf_counter()
    seed_everything(cfg.train.seed)  # the same initial weights on every rank and every run
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    prepared = prepare_dataset(cfg, parts)
    add_lora_adapters(cfg, parts)
    model = build_train_model(cfg, parts, views=prepared.views)
    result = fit_with_validation(cfg, parts, model, prepared.dataset, grid_prompts(cfg, prepared), prepared.val_batch)
    final = None
    if is_main_process():
        del model, parts  # the export reloads the base and the trained weights from the checkpoint
        final = save_trained(cfg, *trained_model(cfg, result.checkpoint_dir))
        print(f"{'LoRA adapters' if cfg.lora.rank else 'pipeline'} saved to {final} "
              f"({time.perf_counter() - t0:.0f} s in all)")
    return result, final


def main(argv: list[str] | None = None) -> None:
    run_script("Text-to-image training of a Stable Diffusion UNet (lora.rank > 0: LoRA adapters only).", train, argv)


if __name__ == "__main__":
    main()
