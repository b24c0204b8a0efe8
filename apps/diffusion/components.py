"""The parts of a Stable Diffusion pipeline: built small from the config, or loaded from a local
diffusers directory; and the pipeline saved so plain diffusers opens it.

    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    pipe = make_pipeline(parts, "dpm")
    save_pipeline(pipe, "runs/x/pipeline")
    StableDiffusionPipeline.from_pretrained("runs/x/pipeline", trust_remote_code=True)  # TAEF2 is a custom component

With `model.pretrained_dir` the parts are a user's Stable Diffusion 1.x / 2.x directory (AutoencoderKL,
CLIPTextModel, ...): what the recipe saves from it is that same layout, which plain
`StableDiffusionPipeline.from_pretrained(dir)` opens without remote code. An SDXL directory
(`StableDiffusionXLPipeline` layout: text_encoder_2 = CLIPTextModelWithProjection, tokenizer_2, a
UNet with size / crop conditioning) loads as the same Components with the second encoder set, and
is saved back as an SDXL pipeline.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, NoiseConfig, resolve
from .taef2 import TAEF2Autoencoder

TAEF2_FILES = ("taef2_encoder.safetensors", "taef2_decoder.safetensors")
SCHEDULERS = {"ddim": "DDIMScheduler", "dpm": "DPMSolverMultistepScheduler", "ddpm": "DDPMScheduler"}


@dataclass
class Components:
    unet: Any
    text_encoder: Any
    tokenizer: Any
    vae: Any
    noise_scheduler: Any  # DDPM, for training
    text_encoder_2: Any = None  # SDXL only: CLIPTextModelWithProjection (its pooled embedding conditions the UNet)
    tokenizer_2: Any = None
    force_zeros_for_empty_prompt: bool = True  # SDXL pipeline option, kept as the source directory set it

    @property
    def is_xl(self) -> bool:
        return self.text_encoder_2 is not None

    @property
    def tokenizers(self) -> list:
        """The tokenizers whose ids `prompt_ids` concatenates (SDXL: both, first encoder's first)."""
        return [self.tokenizer, self.tokenizer_2] if self.is_xl else [self.tokenizer]

    def to(self, device: torch.device | str) -> "Components":
        """The UNet, text encoder(s) and VAE on `device` (see `on_device`): where sampling runs."""
        for module in (self.unet, self.text_encoder, self.text_encoder_2, self.vae):
            if module is not None:
                on_device(module, device)
        return self


def on_device(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`module` moved to `device` unless its weights are there already: a model that `fit` placed
    (and DDP / ZeRO / FSDP hold) is left as it is."""
    param = next(module.parameters(), None)
    if param is not None and param.device != torch.device(device):
        module.to(device)
    return module


def load_taef2(directory: str | Path, scaling_factor: float = 1.0) -> TAEF2Autoencoder:
    """TAEF2 from its two original safetensors files (keys `<layer index>.<...>` of each half)."""
    from safetensors.torch import load_file

    directory = resolve(directory)
    missing = [f for f in TAEF2_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"TAEF2 weights {missing} not found in {directory}: set model.vae to the folder that "
                                "holds taef2_encoder.safetensors and taef2_decoder.safetensors")
    vae = TAEF2Autoencoder(scaling_factor=scaling_factor)
    state = {}
    for half, name in zip(("encoder", "decoder"), TAEF2_FILES):
        state.update({f"{half}.{k}": v.float() for k, v in load_file(str(directory / name)).items()})
    vae.load_state_dict(state, strict=True)
    return vae.eval().requires_grad_(False)


def build_tokenizer(mcfg: ModelConfig):
    from transformers import CLIPTokenizer

    directory = resolve(mcfg.tokenizer_dir)
    if not (directory / "vocab.json").is_file():
        raise FileNotFoundError(f"no tokenizer in {directory}: run `python -m apps.diffusion.build_tokenizer` "
                                "or set model.tokenizer_dir")
    return CLIPTokenizer.from_pretrained(str(directory), model_max_length=mcfg.max_prompt_tokens)


def build_text_encoder(mcfg: ModelConfig, tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=mcfg.text_hidden_size,
                            intermediate_size=4 * mcfg.text_hidden_size, num_hidden_layers=mcfg.text_layers,
                            num_attention_heads=mcfg.text_heads, max_position_embeddings=mcfg.max_prompt_tokens,
                            projection_dim=mcfg.text_hidden_size, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModel(config)


def build_unet(mcfg: ModelConfig, latent_channels: int, latent_size: int, cross_attention_dim: int):
    from diffusers import UNet2DConditionModel

    levels = len(mcfg.unet_channels)
    # Attention at every level but the first (full-resolution attention costs most on CPU).
    down = ["DownBlock2D"] + ["CrossAttnDownBlock2D"] * (levels - 1)
    up = ["CrossAttnUpBlock2D"] * (levels - 1) + ["UpBlock2D"]
    return UNet2DConditionModel(sample_size=latent_size, in_channels=latent_channels, out_channels=latent_channels,
                                block_out_channels=tuple(mcfg.unet_channels), down_block_types=tuple(down),
                                up_block_types=tuple(up), layers_per_block=mcfg.unet_layers_per_block,
                                cross_attention_dim=cross_attention_dim,
                                attention_head_dim=mcfg.unet_attention_head_dim, norm_num_groups=mcfg.unet_norm_groups)


def build_noise_scheduler(ncfg: NoiseConfig):
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=ncfg.num_train_timesteps, beta_schedule=ncfg.beta_schedule,
                         beta_start=0.00085, beta_end=0.012, prediction_type=ncfg.prediction_type,
                         steps_offset=1, clip_sample=False)


def load_components(mcfg: ModelConfig, ncfg: NoiseConfig, resolution: int) -> Components:
    """From `pretrained_dir` / `init_from` (a diffusers directory) if set, else built from the config
    (UNet and text encoder randomly initialised; TAEF2 with its pretrained weights)."""
    source = mcfg.init_from or mcfg.pretrained_dir
    if source:
        pipe = open_pipeline(source)
        parts = Components(pipe.unet, pipe.text_encoder, pipe.tokenizer, pipe.vae,
                           training_scheduler(pipe, ncfg, source))
        if hasattr(pipe, "text_encoder_2"):  # SDXL
            parts.text_encoder_2, parts.tokenizer_2 = pipe.text_encoder_2, pipe.tokenizer_2
            parts.force_zeros_for_empty_prompt = bool(pipe.config.get("force_zeros_for_empty_prompt", True))
        return parts
    tokenizer = build_tokenizer(mcfg)
    text_encoder = build_text_encoder(mcfg, tokenizer)
    vae = load_taef2(mcfg.vae, scaling_factor=mcfg.vae_scaling_factor or 1.0)
    unet = build_unet(mcfg, vae.config.latent_channels, resolution // 8, mcfg.text_hidden_size)
    return Components(unet, text_encoder, tokenizer, vae, build_noise_scheduler(ncfg))


def training_scheduler(pipe, ncfg: NoiseConfig, source: str | Path):
    """DDPM on the noise schedule the pipeline's own scheduler config names (the betas and
    timesteps its UNet was trained with); the config's `noise.prediction_type` must match it."""
    from diffusers import DDPMScheduler

    trained_for = pipe.scheduler.config.get("prediction_type", "epsilon")
    if trained_for != ncfg.prediction_type:
        raise ValueError(f"{source} was trained for prediction_type={trained_for!r} but "
                         f"noise.prediction_type={ncfg.prediction_type!r}: set the config to match the weights")
    return DDPMScheduler.from_config(pipe.scheduler.config, clip_sample=False)  # latents are never clipped


REQUIRED_PARTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
XL_PARTS = ("text_encoder_2", "tokenizer_2")


def is_xl_index(index: dict) -> bool:
    return "text_encoder_2" in index or "XL" in str(index.get("_class_name", ""))


def open_pipeline(directory: str | Path, dtype: torch.dtype = torch.float32):
    """A local diffusers Stable Diffusion 1.x / 2.x or SDXL directory (a user's, or one this recipe
    saved). Remote code runs only for a component that ships its own module in its folder (our TAEF2 VAE)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    directory = resolve(directory)
    index = check_pipeline_dir(directory)
    remote = bool(custom_components(directory, index))
    if is_xl_index(index):
        return StableDiffusionXLPipeline.from_pretrained(str(directory), dtype=dtype, add_watermarker=False,
                                                         trust_remote_code=remote)
    return StableDiffusionPipeline.from_pretrained(str(directory), dtype=dtype, safety_checker=None,
                                                   requires_safety_checker=False, trust_remote_code=remote)


def check_pipeline_dir(directory: Path) -> dict:
    """model_index.json of a Stable Diffusion (or SDXL) directory with every part the recipe needs;
    one clear error for anything else (not a pipeline, a missing folder)."""
    index_path = directory / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"{directory} is not a diffusers pipeline directory (no model_index.json): point "
                                "model.pretrained_dir / model.init_from at a Stable Diffusion directory")
    index = json.loads(index_path.read_text())
    required = REQUIRED_PARTS + (XL_PARTS if is_xl_index(index) else ())
    missing = [p for p in required if not isinstance(index.get(p), list) or None in index[p]
               or not (directory / p).is_dir()]
    if missing:
        kind = "an SDXL" if is_xl_index(index) else "a Stable Diffusion"
        raise FileNotFoundError(f"{directory} lacks {missing} (model_index.json entries and folders): {kind} "
                                f"directory holds {', '.join(required)}")
    return index


def custom_components(directory: Path, index: dict) -> list[str]:
    """Components whose class comes from a module file inside their own folder (diffusers' custom
    components, e.g. vae/taef2.py), which only `trust_remote_code=True` loads."""
    return [name for name, entry in index.items()
            if isinstance(entry, list) and entry[0] and (directory / name / f"{entry[0]}.py").is_file()]


def make_scheduler(kind: str, train_scheduler):
    import diffusers

    if kind not in SCHEDULERS:
        raise ValueError(f"scheduler {kind!r}: choose one of {', '.join(SCHEDULERS)}")
    return getattr(diffusers, SCHEDULERS[kind]).from_config(train_scheduler.config)


def make_pipeline(parts: Components, scheduler: str = "dpm"):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    if parts.is_xl:
        pipe = StableDiffusionXLPipeline(vae=parts.vae, text_encoder=parts.text_encoder,
                                         text_encoder_2=parts.text_encoder_2, tokenizer=parts.tokenizer,
                                         tokenizer_2=parts.tokenizer_2, unet=parts.unet,
                                         scheduler=make_scheduler(scheduler, parts.noise_scheduler),
                                         force_zeros_for_empty_prompt=parts.force_zeros_for_empty_prompt,
                                         add_watermarker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe
    pipe = StableDiffusionPipeline(vae=parts.vae, text_encoder=parts.text_encoder, tokenizer=parts.tokenizer,
                                   unet=parts.unet, scheduler=make_scheduler(scheduler, parts.noise_scheduler),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_pipeline(pipe, directory: str | Path) -> Path:
    """`pipe.save_pretrained`, plus the TAEF2 class file as a custom component when it is the VAE."""
    directory = Path(directory)
    pipe.save_pretrained(str(directory), safe_serialization=True)
    if isinstance(pipe.vae, TAEF2Autoencoder):
        module = Path(__file__).with_name("taef2.py")
        shutil.copyfile(module, directory / "vae" / module.name)
        index_path = directory / "model_index.json"
        index = json.loads(index_path.read_text())
        index["vae"] = [module.stem, TAEF2Autoencoder.__name__]  # diffusers imports vae/taef2.py
        index_path.write_text(json.dumps(index, indent=2))
    return directory
