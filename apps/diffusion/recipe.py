"""What both training scripts share: components -> latents -> train model -> fit -> export."""
from __future__ import annotations

from pathlib import Path

import torch

from phalanx.observe import is_main_process
from phalanx.train import EMA

from .components import Components, load_components, make_pipeline, save_pipeline
from .config import RecipeConfig, resolve
from .data import tokenize
from .loss import DiffusionTrainModel

CACHE_DIR = "cache"


def cache_dir(cfg: RecipeConfig) -> Path:
    return resolve(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.train.output_dir) / CACHE_DIR


def latent_scaling_factor(cfg: RecipeConfig, parts: Components, latents: torch.Tensor) -> float:
    """The config's factor, the VAE's own (a pretrained SD VAE: 0.18215), or 1/std of our latents
    (TAEF2 has none: this makes the UNet's inputs unit-variance, like SD's factor does)."""
    if cfg.model.vae_scaling_factor is not None:
        factor = cfg.model.vae_scaling_factor
    elif cfg.model.pretrained_dir or cfg.model.init_from:
        factor = float(parts.vae.config.scaling_factor)
    else:
        factor = float(1.0 / latents.std())
    parts.vae.register_to_config(scaling_factor=factor)  # saved with the pipeline, used when sampling
    return factor


def build_train_model(cfg: RecipeConfig, parts: Components, prior_loss_weight: float = 1.0) -> DiffusionTrainModel:
    """The objective around the components; the text encoder trains when `model.train_text_encoder`
    (whole, or only its LoRA adapters when they were added before)."""
    if cfg.model.gradient_checkpointing:
        parts.unet.enable_gradient_checkpointing()
    parts.unet.train()
    return DiffusionTrainModel(parts.unet, parts.text_encoder, parts.noise_scheduler, cfg.noise,
                               empty_prompt_ids=tokenize(parts.tokenizer, [""])[0],
                               caption_dropout=cfg.data.caption_dropout, train_text_encoder=cfg.model.train_text_encoder,
                               prior_loss_weight=prior_loss_weight)


def make_ema(cfg: RecipeConfig) -> EMA | None:
    return EMA(decay=cfg.ema.decay, warmup=cfg.ema.warmup) if cfg.ema.enabled else None


def fit_with_validation(cfg: RecipeConfig, parts: Components, model, dataset, prompts: list[str],
                        val_batch: dict | None = None, collate_fn=None):
    """`phalanx.train.fit` with the EMA hook (when enabled) and the validation grid as eval."""
    from phalanx.train import fit

    from .loss import diffusion_loss
    from .validation import validation_eval_fn

    ema = make_ema(cfg)
    eval_fn = validation_eval_fn(parts, cfg.validation, prompts, Path(cfg.train.output_dir), val_batch, ema,
                                 cfg.train.wandb)
    return fit(cfg.train, model, dataset, collate_fn=collate_fn, loss_fn=diffusion_loss, eval_fn=eval_fn,
               tokenizer=parts.tokenizer, hooks=[ema] if ema else [])


def load_trained_weights(model: torch.nn.Module, checkpoint_dir: Path, with_ema: bool) -> None:
    """The weights `fit` saved in a checkpoint (`model/`, full, any plugin) and, with_ema, the EMA
    average on top of the parameters it tracks."""
    from phalanx.checkpoint.hf import load_hf_state_dict
    from phalanx.train.ema import EMA_FILE

    state = load_hf_state_dict(checkpoint_dir / "model")
    model.load_state_dict(state, strict=True)
    ema_file = checkpoint_dir / EMA.name / EMA_FILE
    if with_ema:
        from safetensors.torch import load_file
        if not ema_file.is_file():
            raise FileNotFoundError(f"{ema_file} missing: the run had EMA off; export with ema.enabled=false")
        avg = load_file(str(ema_file))
        params = dict(model.named_parameters())
        for name, value in avg.items():
            params[name].data.copy_(value.to(params[name].dtype))


def export_pipeline(cfg: RecipeConfig, checkpoint_dir: Path, out_dir: Path) -> Path:
    """Rank 0: fresh components + the checkpoint's (EMA) weights -> a diffusers directory."""
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    model = build_train_model(cfg, parts)
    load_trained_weights(model, checkpoint_dir, with_ema=cfg.ema.enabled)
    parts.vae.register_to_config(scaling_factor=saved_scaling_factor(checkpoint_dir, parts))
    return save_pipeline(make_pipeline(parts, "dpm"), out_dir)  # `model` trains parts' own UNet / text encoder


SCALE_FILE = "latent_scaling_factor.txt"


def record_scaling_factor(output_dir: Path, factor: float) -> None:
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / SCALE_FILE).write_text(repr(factor))


def saved_scaling_factor(checkpoint_dir: Path, parts: Components) -> float:
    path = checkpoint_dir.parent.parent / SCALE_FILE
    return float(path.read_text()) if path.is_file() else float(parts.vae.config.scaling_factor)


def run_script(description: str, train_fn, argv: list[str] | None = None) -> None:
    """The scripts' `main`: parse `--config FILE key=value...`, launch, train, print, shut down."""
    from phalanx.launch import launched

    from .config import parse_args

    cfg = parse_args(description, argv)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    with launched(seed=cfg.train.seed):
        result, _ = train_fn(cfg)
        if is_main_process() and result.losses:
            print(f"done at step {result.final_step}: loss {result.losses[0]:.4f} (first step) -> "
                  f"{result.losses[-1]:.4f} (last); eval {result.last_eval}")
