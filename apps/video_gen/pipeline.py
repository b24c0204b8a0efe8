"""The exported pipeline: a directory of diffusers / transformers components plus the sampler.

    pipeline/
      model_index.json   what is inside (for people and tools)
      video_gen.json     sample shape (in pixels), flow shift: what the sampler needs
      transformer/       WanTransformer3DModel (diffusers; from_pretrained opens it)
      text_encoder/      CLIPTextModel, or the user's T5EncoderModel / UMT5EncoderModel ... (transformers)
      pooled_text/       PooledTextConditioning (this recipe; diffusers ModelMixin), when model.pooled_text
      tokenizer/         PreTrainedTokenizerFast
      scheduler/         FlowMatchEulerDiscreteScheduler config (the sampler below follows it)
      vae/               AutoencoderKLWan, when the model works in latent space (`vae.from_dir`)

`VideoPipeline.from_pretrained(dir)(prompts, seed=...)` samples with the Euler flow sampler and
classifier-free guidance (in latent space and then decoded, when there is a vae/); the same
directory and seed give the same clips.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from phalanx.diffusion import guided_prediction, resolution_shift, shift_timesteps

from .config import FlowConfig
from .model import PooledTextConditioning, VideoFlowModel
from .text import load_text_encoder, load_tokenizer, tokenize
from .vae import decode_latents, frames_ok, vae_factors

META = "video_gen.json"


def euler_timesteps(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 times from 1 (noise) to 0 (data), shifted like the training timesteps."""
    return shift_timesteps(torch.linspace(1.0, 0.0, steps + 1), shift)


@torch.no_grad()
def euler_sample(model: VideoFlowModel, prompt_ids: torch.Tensor, shape: tuple[int, ...], steps: int,
                 guidance: float, generator: torch.Generator) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t = 1 to 0 with Euler steps; guidance > 1 mixes in the
    empty-prompt velocity (classifier-free guidance)."""
    device = next(model.parameters()).device
    x = torch.randn(shape, generator=generator).to(device)
    text = model.encode_prompts(prompt_ids.to(device))
    uncond = model.encode_prompts(model.empty_prompt_ids.expand(shape[0], -1)) if guidance != 1.0 else None
    f = model.fcfg
    shift = resolution_shift(model.tokens(shape), f.shift_base_tokens, f.max_shift) if f.shift_base_tokens else 1.0
    ts = euler_timesteps(steps, shift).to(device)
    for t0, t1 in zip(ts[:-1], ts[1:]):
        t = t0.expand(shape[0])
        v = model.velocity(x, t, text)
        if uncond is not None:
            v = guided_prediction(v, model.velocity(x, t, uncond), guidance)
        x = x + (t1 - t0) * v
    return x


def sample_shape(batch: int, channels: int, frames: int, height: int, width: int, vae=None) -> tuple[int, ...]:
    """The shape the flow samples in: the clip's, or its latent's when there is an autoencoder."""
    if vae is None:
        return batch, channels, frames, height, width
    tf, sf = vae_factors(vae)
    if not frames_ok(frames, tf) or height % sf or width % sf:
        raise ValueError(f"the autoencoder takes 1 + k x {tf} frames and sizes divisible by {sf}; asked for "
                         f"{frames} frames of {height}x{width}")
    return batch, channels, (frames - 1) // tf + 1, height // sf, width // sf


@torch.no_grad()
def sample_clips(model: VideoFlowModel, prompt_ids: torch.Tensor, frames: int, height: int, width: int, steps: int,
                 guidance: float, generator: torch.Generator, vae=None) -> torch.Tensor:
    """Clips [B, 3, F, H, W] in [-1, 1]: Euler sampling, then decoding through `vae` when given."""
    channels = model.transformer.config.out_channels
    x = euler_sample(model, prompt_ids, sample_shape(len(prompt_ids), channels, frames, height, width, vae),
                     steps, guidance, generator)
    if vae is not None:
        x = decode_latents(vae.to(x.device), x)
    return x.clamp(-1, 1)


class VideoPipeline:
    def __init__(self, model: VideoFlowModel, tokenizer, meta: dict, vae=None):
        self.model, self.tokenizer, self.meta, self.vae = model.eval(), tokenizer, meta, vae

    def to(self, device: torch.device | str) -> "VideoPipeline":
        """The model (and the autoencoder) on `device`; sampling runs where the model is."""
        self.model.to(device)
        if self.vae is not None:
            self.vae.to(device)
        return self

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "VideoPipeline":
        from diffusers import WanTransformer3DModel

        directory = Path(directory)
        if not (directory / META).is_file():
            raise FileNotFoundError(f"{directory} is not a video_gen pipeline (no {META}): export one with "
                                    "`python -m apps.video_gen.train` (it writes <output_dir>/pipeline)")
        meta = json.loads((directory / META).read_text())
        tokenizer = load_tokenizer(directory / "tokenizer")
        transformer = WanTransformer3DModel.from_pretrained(str(directory / "transformer"))
        text_encoder = load_text_encoder(directory / "text_encoder")
        empty = tokenize(tokenizer, [""])[0]
        pooled = PooledTextConditioning.from_pretrained(str(directory / "pooled_text")) \
            if (directory / "pooled_text").is_dir() else None
        model = VideoFlowModel(transformer, text_encoder, empty, tokenizer.pad_token_id, FlowConfig(**meta["flow"]),
                               pooled_text=pooled)
        vae = None
        if (directory / "vae").is_dir():
            from diffusers import AutoencoderKLWan
            vae = AutoencoderKLWan.from_pretrained(str(directory / "vae")).eval().requires_grad_(False)
        return cls(model, tokenizer, meta, vae)

    def save_pretrained(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.transformer.save_pretrained(str(directory / "transformer"))
        self.model.text_encoder.save_pretrained(str(directory / "text_encoder"))
        if self.model.pooled_text is not None:
            self.model.pooled_text.save_pretrained(str(directory / "pooled_text"))
        self.tokenizer.save_pretrained(str(directory / "tokenizer"))
        write_scheduler_config(directory / "scheduler", self.meta)
        if self.vae is not None:
            self.vae.save_pretrained(str(directory / "vae"))
        (directory / META).write_text(json.dumps(self.meta, indent=2))
        index = {"_class_name": "VideoGenPipeline (apps.video_gen.pipeline)",
                 "transformer": ["diffusers", "WanTransformer3DModel"], "text_encoder": ["transformers", type(self.model.text_encoder).__name__],
                 "tokenizer": ["transformers", type(self.tokenizer).__name__],
                 "pooled_text": (["apps.video_gen.model", "PooledTextConditioning"]
                                 if self.model.pooled_text is not None else [None, None]),
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "vae": ["diffusers", "AutoencoderKLWan"] if self.vae is not None else [None, None]}
        (directory / "model_index.json").write_text(json.dumps(index, indent=2))
        return directory

    @torch.no_grad()
    def __call__(self, prompts: list[str], seed: int = 0, steps: int = 24, guidance: float = 2.0,
                 frames: int | None = None, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Clips [B, 3, F, H, W] in [-1, 1] for the prompts."""
        m = self.meta
        ids = tokenize(self.tokenizer, prompts)
        return sample_clips(self.model, ids, frames or m["frames"], height or m["height"], width or m["width"], steps,
                            guidance, torch.Generator().manual_seed(seed), self.vae)


def write_scheduler_config(directory: Path, meta: dict) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    f = meta["flow"]
    FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False).save_pretrained(str(directory))
    note = {"note": "apps.video_gen samples with its own Euler loop: t from 1 to 0, shifted by "
                    "sqrt(tokens / shift_base_tokens) (see video_gen.json)", "shift_base_tokens": f["shift_base_tokens"]}
    (directory / "video_gen_note.json").write_text(json.dumps(note, indent=2))


def make_meta(fcfg: FlowConfig, channels: int, frames: int, height: int, width: int, vae=None) -> dict:
    """What the sampler needs: the flow settings and the default clip size in pixels (`channels`: what
    the transformer outputs, latent channels with `vae`)."""
    meta = {"flow": asdict(fcfg), "channels": channels, "frames": frames, "height": height, "width": width}
    if vae is not None:
        meta["vae_temporal"], meta["vae_spatial"] = vae_factors(vae)
    return meta
