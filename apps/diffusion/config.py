"""The diffusion recipe's config: one dataclass per section, filled from YAML + `key=value`.

    python -m apps.diffusion.train_text_to_image --config apps/diffusion/configs/tiny_emoji.yaml train.max_steps=50

Every option is documented where it is declared. Relative paths are resolved against the
repository root, so the commands work from any directory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from phalanx.config import ConfigError, load_config, parse_config_args, resolve_path
from phalanx.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]
APP_DATA = Path(__file__).resolve().parent / "data"


def resolve(path: str | Path) -> Path:
    """Absolute paths stay; relative ones are taken from the repository root."""
    return resolve_path(path, REPO)


@dataclass
class ModelConfig:
    # A local diffusers Stable Diffusion 1.x / 2.x directory (model_index.json, unet/ =
    # UNet2DConditionModel, vae/ = AutoencoderKL, text_encoder/ = CLIPTextModel, tokenizer/,
    # scheduler/), e.g. stable-diffusion-v1-5, or an SDXL one (also text_encoder_2/ =
    # CLIPTextModelWithProjection and tokenizer_2/; text-to-image and LoRA, not DreamBooth). Its
    # VAE's scaling_factor scales the latents and its scheduler's noise schedule is the training
    # one; the exports keep that layout (plain diffusers opens them, no remote code). null: build
    # the components below from their configs (the tiny default).
    pretrained_dir: str | None = None
    # When building from config:
    vae: str = "apps/diffusion/data/vae"               # TAEF2 weights (taef2_{encoder,decoder}.safetensors)
    vae_scaling_factor: float | None = None            # latents * factor go to the UNet; null: 1/std of the data's latents
    tokenizer_dir: str = "apps/diffusion/data/tokenizer"  # CLIP-format vocab.json + merges.txt
    max_prompt_tokens: int = 16                        # tokenizer model_max_length for the small text encoder
    text_hidden_size: int = 128
    text_layers: int = 2
    text_heads: int = 4
    unet_channels: list[int] = field(default_factory=lambda: [64, 128, 128])
    unet_layers_per_block: int = 1
    unet_attention_head_dim: int = 8
    unet_norm_groups: int = 16
    init_from: str | None = None                       # a saved pipeline dir to start from (DreamBooth on the tiny model)
    gradient_checkpointing: bool = False               # recompute UNet activations in backward (memory for time)
    train_text_encoder: bool = False                   # train the text encoder too (DreamBooth with LoRA: its adapters)


@dataclass
class NoiseConfig:
    # The schedule of a model built from config; a pretrained directory's scheduler/ brings its own.
    num_train_timesteps: int = 1000
    beta_schedule: str = "scaled_linear"               # DDPM betas (SD uses scaled_linear 0.00085..0.012)
    # What the UNet predicts; must match a pretrained directory's scheduler (SD 1.5: epsilon, SD 2.1-768: v_prediction).
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    snr_gamma: float | None = None                     # Min-SNR weighting (Hang et al. 2023), e.g. 5.0; null: off
    noise_offset: float = 0.0                          # add offset * N(0,1) per (sample, channel): darker/brighter images


@dataclass
class DataConfig:
    root: str = "apps/diffusion/data/noto_emoji_64"    # folder with metadata.jsonl ({file_name, text}) and the images
    resolution: int = 128                              # images are resized to resolution x resolution
    background: list[int] = field(default_factory=lambda: [255, 255, 255])  # RGB behind transparent pixels
    caption_dropout: float = 0.1                       # share of empty prompts (enables classifier-free guidance)
    # Augmentation, drawn per sample and step on the training RNG stream (exact resume covers it).
    # Images are resized so their shorter side is resolution x resize_scale, then a square is cut:
    # the centre one, or with random_crop a resolution x resolution square at a random place of the
    # centre square (random_crop needs resize_scale > 1, e.g. 1.125).
    random_flip: bool = False                          # mirror left-right with probability 1/2
    random_crop: bool = False
    resize_scale: float = 1.0
    # Every image is encoded once by the frozen VAE (exact: nothing random happens before it) and
    # training runs on the cached latents. With random_flip both views are cached (the plain and the
    # mirrored image, each encoded); with random_crop no training latents are cached: each step's
    # crops are encoded by the VAE inside the training step. Held-out images: the plain view, cached.
    cache_dir: str | None = None                       # where the latent cache lives; default <train.output_dir>/cache
    max_images: int | None = None                      # use only the first N training images (tests)
    # metadata.jsonl lines left out, as "field=value" filters (any field of a line, e.g.
    # "subcategory=cat-face", "file_name=images/1f431.png"); a filter that matches nothing is an error.
    exclude: list[str] = field(default_factory=list)


@dataclass
class EMAConfig:
    enabled: bool = True
    decay: float = 0.999
    warmup: bool = True                                # decay ramps up as (1+n)/(10+n)


@dataclass
class ValidationConfig:
    prompts: list[str] = field(default_factory=lambda: ["dog face", "red apple", "grinning face", "rocket",
                                                        "cat face", "green heart", "sun", "pizza"])
    every: int = 0                                     # steps between grids (0: only at the end)
    # The validation loss (eval/loss): held-out images that training never sees, at fixed noise and
    # evenly spread timesteps (the same draw at every evaluation, so the values compare across steps).
    # `held_out` images are drawn (seeded by `seed`) from data.root before data.max_images applies,
    # or, with `root`, taken from another captioned folder (metadata.jsonl). 0 and no root: no loss.
    held_out: int = 16
    root: str | None = None
    held_out_prompts: int = 0                          # also draw the first N held-out captions in the grid
    num_inference_steps: int = 25
    guidance_scale: float = 3.0
    scheduler: Literal["ddim", "dpm"] = "dpm"
    seed: int = 0
    use_ema: bool = True                               # draw with the EMA weights when EMA is on


@dataclass
class DreamBoothConfig:
    instance_dir: str = "apps/diffusion/data/dreambooth_dog"   # the subject's photos (jpg/png)
    instance_prompt: str = "a photo of sks dog"
    class_prompt: str = "a photo of dog"
    with_prior_preservation: bool = True
    prior_loss_weight: float = 1.0
    num_class_images: int = 16                         # generated by the model itself before training (cached)
    class_dir: str | None = None                       # default: <train.output_dir>/class_images
    class_generation_steps: int = 20
    validation_prompts: list[str] = field(default_factory=lambda: ["a photo of sks dog", "a photo of dog"])
    # Images of the instance prompt drawn before and after training (same seeds), scored by their
    # latent distance to the instance and the class images: <output_dir>/fidelity.json + .png. 0: off.
    fidelity_samples: int = 8


@dataclass
class LoRAConfig:
    # > 0: the base weights freeze and only LoRA adapters train (peft), on the UNet's attention
    # projections to_q / to_k / to_v / to_out.0 and, with model.train_text_encoder, the text
    # encoder's q/k/v/out_proj. Both trainers (text-to-image, DreamBooth) then write
    # <output_dir>/lora/pytorch_lora_weights.safetensors, which diffusers' load_lora_weights reads.
    rank: int = 0
    alpha: int | None = None                           # default: rank (scale alpha / rank = 1)


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    dreambooth: DreamBoothConfig = field(default_factory=DreamBoothConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    final_dir: str | None = None                       # the saved pipeline; default <train.output_dir>/pipeline

    def validate(self) -> None:
        def need(ok: bool, key: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"config '{key}'={value!r}: {why}")

        m, d, n = self.model, self.data, self.noise
        need(d.resolution % 8 == 0 and d.resolution >= 32, "data.resolution", d.resolution,
             "must be a multiple of 8 (the VAE downsamples 8x) and at least 32")
        down = 2 ** (len(m.unet_channels) - 1)
        need(m.pretrained_dir is not None or m.init_from is not None or (d.resolution // 8) % down == 0, "model.unet_channels", m.unet_channels,
             f"{len(m.unet_channels)} levels halve the {d.resolution // 8}px latent {len(m.unet_channels) - 1} times: "
             "use fewer levels or a larger data.resolution")
        need(all(c % m.unet_norm_groups == 0 for c in m.unet_channels), "model.unet_norm_groups", m.unet_norm_groups,
             "must divide every entry of model.unet_channels")
        need(0.0 <= d.caption_dropout < 1.0, "data.caption_dropout", d.caption_dropout, "must be in [0, 1)")
        need(n.snr_gamma is None or n.snr_gamma > 0, "noise.snr_gamma", n.snr_gamma, "must be positive or null")
        need(n.noise_offset >= 0, "noise.noise_offset", n.noise_offset, "must be 0 or more")
        need(0.0 <= self.ema.decay < 1.0, "ema.decay", self.ema.decay, "must be in [0, 1)")
        need(self.dreambooth.fidelity_samples >= 0, "dreambooth.fidelity_samples", self.dreambooth.fidelity_samples,
             "must be 0 (off) or positive")
        need(self.lora.rank >= 0, "lora.rank", self.lora.rank, "must be 0 (off) or positive")
        need(d.resize_scale >= 1.0, "data.resize_scale", d.resize_scale, "must be at least 1 (the shorter side is "
             "resized to resolution x resize_scale before the crop)")
        need(not d.random_crop or round(d.resolution * d.resize_scale) > d.resolution, "data.random_crop", d.random_crop,
             f"needs room to move: set data.resize_scale above 1 (e.g. 1.125: a {d.resolution}px crop of a "
             f"{round(d.resolution * 1.125)}px square)")
        v = self.validation
        need(v.held_out >= 0, "validation.held_out", v.held_out, "must be 0 (no held-out images) or positive")
        need(0 <= v.held_out_prompts, "validation.held_out_prompts", v.held_out_prompts, "must be 0 or positive")
        need(self.validation.num_inference_steps >= 1, "validation.num_inference_steps",
             self.validation.num_inference_steps, "must be at least 1")

    @property
    def final_path(self) -> Path:
        return resolve(self.final_dir) if self.final_dir else resolve(self.train.output_dir) / "pipeline"


MOVED_KEYS = {"dreambooth.lora_rank": "lora.rank", "dreambooth.lora_alpha": "lora.alpha"}


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> RecipeConfig:
    try:
        cfg = load_config(RecipeConfig, resolve(path) if path is not None else None, overrides)
    except ConfigError as exc:
        for old, new in MOVED_KEYS.items():
            if f"'{old}'" in str(exc):
                raise ConfigError(f"config key '{old}' is now '{new}' (one LoRA section for text-to-image and "
                                  f"DreamBooth): rename it") from exc
        raise
    cfg.train.output_dir = str(resolve(cfg.train.output_dir))
    cfg.train.eval_every = cfg.validation.every  # the loop's eval is the validation grid
    cfg.validate()
    return cfg


def parse_args(description: str, argv: list[str] | None = None) -> RecipeConfig:
    return parse_config_args(description, load_recipe, argv, example="apps/diffusion/configs/tiny_emoji.yaml")[0]
