"""What both training scripts share: components -> latents -> (LoRA adapters) -> train model -> fit
-> export (the whole pipeline, or with `lora.rank` the adapters only)."""
from __future__ import annotations

from pathlib import Path

import torch

from phalanx.observe import is_main_process
from phalanx.train import EMA

from .components import Components, load_components, make_pipeline, save_pipeline
from .config import RecipeConfig, resolve
from .data import tokenize_all
from .lora import add_lora, save_lora
from .loss import DiffusionTrainModel

CACHE_DIR = "cache"
LORA_DIR = "lora"


def cache_dir(cfg: RecipeConfig) -> Path:
    return resolve(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.train.output_dir) / CACHE_DIR


def latent_scaling_factor(cfg: RecipeConfig, parts: Components, latents) -> float:
    """The config's factor, the VAE's own (a pretrained SD VAE: 0.18215), or 1/std of our latents
    (TAEF2 has none: this makes the UNet's inputs unit-variance, like SD's factor does). `latents`:
    a tensor, or a function that returns one (called only when the factor is measured)."""
    if cfg.model.vae_scaling_factor is not None:
        factor = cfg.model.vae_scaling_factor
    elif cfg.model.pretrained_dir or cfg.model.init_from:
        factor = float(parts.vae.config.scaling_factor)
    else:
        factor = float(1.0 / (latents() if callable(latents) else latents).std())
    parts.vae.register_to_config(scaling_factor=factor)  # saved with the pipeline, used when sampling
    return factor


def add_lora_adapters(cfg: RecipeConfig, parts: Components) -> None:
    """With `lora.rank > 0`: freeze the UNet (and the text encoder) and add LoRA adapters to the
    UNet's attention and, with `model.train_text_encoder`, to the text encoder's (SDXL: both)."""
    if cfg.lora.rank:
        add_lora(parts.unet, cfg.lora.rank, cfg.lora.alpha)
        if cfg.model.train_text_encoder:
            for encoder in (parts.text_encoder, parts.text_encoder_2):  # SDXL: both encoders
                if encoder is not None:
                    add_lora(encoder, cfg.lora.rank, cfg.lora.alpha, text_encoder=True)


def build_train_model(cfg: RecipeConfig, parts: Components, prior_loss_weight: float = 1.0,
                      views=None) -> DiffusionTrainModel:
    """The objective around the components; the text encoder trains when `model.train_text_encoder`
    (whole, or only its LoRA adapters when they were added before). `views`: data.TrainingViews
    for augmented training (None: the batch's cached latents as they are)."""
    if cfg.model.gradient_checkpointing:
        parts.unet.enable_gradient_checkpointing()
    parts.unet.train()
    return DiffusionTrainModel(parts.unet, parts.text_encoder, parts.noise_scheduler, cfg.noise,
                               empty_prompt_ids=tokenize_all(parts.tokenizers, [""])[0],
                               caption_dropout=cfg.data.caption_dropout, train_text_encoder=cfg.model.train_text_encoder,
                               prior_loss_weight=prior_loss_weight, views=views, text_encoder_2=parts.text_encoder_2,
                               split=parts.tokenizer.model_max_length if parts.is_xl else None)


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


def trained_model(cfg: RecipeConfig, checkpoint_dir: Path, prior_loss_weight: float = 1.0):
    """Rank 0: fresh components (with LoRA adapters when `lora.rank`) holding the checkpoint's (EMA)
    weights and the run's latent scaling factor; returns (components, train model)."""
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    add_lora_adapters(cfg, parts)
    model = build_train_model(cfg, parts, prior_loss_weight)
    load_trained_weights(model, checkpoint_dir, with_ema=cfg.ema.enabled)
    parts.vae.register_to_config(scaling_factor=saved_scaling_factor(checkpoint_dir, parts))
    return parts, model


def save_trained(cfg: RecipeConfig, parts: Components, model: DiffusionTrainModel) -> Path:
    """With `lora.rank`: the adapters as diffusers' LoRA file in <output_dir>/lora (the base model
    stays where it is); otherwise the whole pipeline in `final_dir`."""
    if cfg.lora.rank:
        encoders = model.text_encoders if cfg.model.train_text_encoder else []
        return save_lora(Path(cfg.train.output_dir) / LORA_DIR, model.unet, *encoders, xl=parts.is_xl)
    return save_pipeline(make_pipeline(parts, "dpm"), cfg.final_path)  # `model` trained parts' own modules


SCALE_FILE = "latent_scaling_factor.txt"


def record_scaling_factor(output_dir: Path, factor: float) -> None:
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / SCALE_FILE).write_text(repr(factor))


def saved_scaling_factor(checkpoint_dir: Path, parts: Components) -> float:
    path = checkpoint_dir.parent.parent / SCALE_FILE
    return float(path.read_text()) if path.is_file() else float(parts.vae.config.scaling_factor)


def run_script(description: str, train_fn, argv: list[str] | None = None, adjust=None) -> None:
    """The scripts' `main`: parse `--config FILE key=value...`, `adjust(cfg)` if given, launch, train,
    print, shut down."""
    from phalanx.launch import launched

    from .config import parse_args

    cfg = parse_args(description, argv)
    if adjust is not None:
        adjust(cfg)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    with launched(seed=cfg.train.seed):
        result, _ = train_fn(cfg)
        if is_main_process() and result.losses:
            print(f"done at step {result.final_step}: loss {result.losses[0]:.4f} (first step) -> "
                  f"{result.losses[-1]:.4f} (last); eval {result.last_eval}")
