"""The exported pipeline: a directory of diffusers / transformers components plus the sampler.

    pipeline/
      model_index.json   what is inside (for people and tools)
      video_gen.json     sample shape (in pixels), flow shift: what the sampler needs
      transformer/       WanTransformer3DModel (diffusers; from_pretrained opens it)
      text_encoder/      CLIPTextModel, or the user's T5EncoderModel / UMT5EncoderModel ... (transformers)
      pooled_text/       PooledTextConditioning (this recipe; diffusers ModelMixin), when model.pooled_text
      tokenizer/         PreTrainedTokenizerFast
      scheduler/         FlowMatchEulerDiscreteScheduler with the shift of the default clip size
      vae/               AutoencoderKLWan, when the model works in latent space (`vae.from_dir`)

A plain model (no position planes, no pooled_text/, no velocity skip, latent space, padding states
zeroed, the scheduler's grid) is exported as a diffusers WanPipeline: model_index.json names
WanPipeline, and `WanPipeline.from_pretrained(dir)` samples the same clip for a seed (pass
`max_sequence_length=` the tokenizer's length and `guidance_scale=`); video_gen.json lists what blocks
it otherwise ("wan_pipeline_blockers").

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
from .first_frame import first_frame_condition
from .model import PooledTextConditioning, VideoFlowModel
from .text import load_text_encoder, load_tokenizer, tokenize
from .vae import decode_latents, frames_ok, vae_factors

META = "video_gen.json"


SAMPLERS = ("scheduler", "linear")


def flow_scheduler(shift: float):
    """diffusers' FlowMatchEulerDiscreteScheduler with a fixed `shift`: the scheduler the exported
    pipeline carries (WanPipeline steps with it), and the grid the recipe's sampler follows."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=False)


def euler_timesteps(steps: int, shift: float, grid: str = "scheduler") -> torch.Tensor:
    """steps + 1 times from 1 (noise) to 0 (data), shifted like the training timesteps: "scheduler":
    exactly the sigmas of `flow_scheduler(shift)` (steps points from 1 to its smallest sigma, then 0), so
    WanPipeline with the exported scheduler takes the same steps; "linear": the recipe's older grid
    1 - k / steps, shifted (the README's motion figures were measured with it)."""
    if grid == "linear":
        return shift_timesteps(torch.linspace(1.0, 0.0, steps + 1), shift)
    if grid != "scheduler":
        raise ValueError(f"unknown sampler grid {grid!r}: choose one of {SAMPLERS}")
    scheduler = flow_scheduler(shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float()


@torch.no_grad()
def euler_sample(model: VideoFlowModel, prompt_ids: torch.Tensor, shape: tuple[int, ...], steps: int,
                 guidance: float, generator: torch.Generator, grid: str = "scheduler",
                 first: torch.Tensor | None = None) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t = 1 to 0 with Euler steps; guidance > 1 mixes in the
    empty-prompt velocity (classifier-free guidance). An i2v model is given `first` [B, C, 1, H, W]
    (in the model's space) on every step, with and without the prompt, and it is the result's first frame."""
    device = next(model.parameters()).device
    x = torch.randn(shape, generator=generator).to(device)
    cond = first_frame_condition(first.to(device), shape[2]) if model.i2v else None
    text = model.encode_prompts(prompt_ids.to(device))
    uncond = model.encode_prompts(model.empty_prompt_ids.expand(shape[0], -1)) if guidance != 1.0 else None
    ts = euler_timesteps(steps, sampling_shift(model, shape), grid).to(device)
    for t0, t1 in zip(ts[:-1], ts[1:]):
        t = t0.expand(shape[0])
        v = model.velocity(x, t, text, cond)
        if uncond is not None:
            v = guided_prediction(v, model.velocity(x, t, uncond, cond), guidance)
        x = x + (t1 - t0) * v
    if cond is not None:
        x = torch.cat([cond[:, :shape[1], :1], x[:, :, 1:]], dim=2)
    return x


def sampling_shift(model: VideoFlowModel, shape: tuple[int, ...]) -> float:
    """The timestep shift for sampling at `shape` (what the model trained with at that size)."""
    f = model.fcfg
    return resolution_shift(model.tokens(shape), f.shift_base_tokens, f.max_shift) if f.shift_base_tokens else 1.0


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
                 guidance: float, generator: torch.Generator, vae=None, grid: str = "scheduler",
                 first_frame: torch.Tensor | None = None) -> torch.Tensor:
    """Clips [B, 3, F, H, W] in [-1, 1]: Euler sampling, then decoding through `vae` when given. An i2v
    model needs `first_frame` [B, 3, H, W] in [-1, 1] (encoded alone through `vae` in latent space)."""
    channels = model.transformer.config.out_channels
    first = None
    if model.i2v:
        if first_frame is None:
            raise ValueError("this pipeline is image-to-video (model.i2v): give first_frame=[B, 3, H, W] in [-1, 1]")
        first = first_frame.unsqueeze(2)
        if vae is not None:
            from .vae import encode_latents
            first = encode_latents(vae.to(first_frame.device), first.to(first_frame.device))[0]
    x = euler_sample(model, prompt_ids, sample_shape(len(prompt_ids), channels, frames, height, width, vae),
                     steps, guidance, generator, grid, first)
    if vae is not None:
        x = decode_latents(vae.to(x.device), x)
    return x.clamp(-1, 1)


class VideoPipeline:
    def __init__(self, model: VideoFlowModel, tokenizer, meta: dict, vae=None):
        self.model, self.tokenizer, self.meta, self.vae = model.eval(), tokenizer, meta, vae
        self.meta.setdefault("zero_text_padding", model.zero_padding)

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
                                    "`python -m apps.video_gen.train` (it writes <output_dir>/pipeline); to fine-tune a "
                                    "diffusers Wan pipeline directory, set model.transformer_dir, model.text_encoder_dir "
                                    "and vae.from_dir to it")
        meta = json.loads((directory / META).read_text())
        tokenizer = load_tokenizer(directory / "tokenizer")
        transformer = WanTransformer3DModel.from_pretrained(str(directory / "transformer"))
        text_encoder = load_text_encoder(directory / "text_encoder")
        empty = tokenize(tokenizer, [""])[0]
        pooled = PooledTextConditioning.from_pretrained(str(directory / "pooled_text")) \
            if (directory / "pooled_text").is_dir() else None
        model = VideoFlowModel(transformer, text_encoder, empty, tokenizer.pad_token_id, FlowConfig(**meta["flow"]),
                               pooled_text=pooled, zero_padding=meta.get("zero_text_padding"), i2v=meta.get("i2v", False))
        vae = None
        if (directory / "vae").is_dir():
            from diffusers import AutoencoderKLWan
            vae = AutoencoderKLWan.from_pretrained(str(directory / "vae")).eval().requires_grad_(False)
        return cls(model, tokenizer, meta, vae)

    def save_pretrained(self, directory: str | Path) -> Path:
        """The pipeline directory; when `wan_blockers` finds nothing it is also a diffusers WanPipeline
        (model_index.json names WanPipeline; `WanPipeline.from_pretrained(dir)` opens it without custom code)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.transformer.save_pretrained(str(directory / "transformer"))
        self.model.text_encoder.save_pretrained(str(directory / "text_encoder"))
        if self.model.pooled_text is not None:
            self.model.pooled_text.save_pretrained(str(directory / "pooled_text"))
        self.tokenizer.save_pretrained(str(directory / "tokenizer"))
        self.meta["scheduler_shift"] = self.default_shift()
        flow_scheduler(self.meta["scheduler_shift"]).save_pretrained(str(directory / "scheduler"))
        if self.vae is not None:
            self.vae.save_pretrained(str(directory / "vae"))
        self.meta["wan_pipeline_blockers"] = wan_blockers(self.model, self.vae, self.meta)
        (directory / META).write_text(json.dumps(self.meta, indent=2))
        (directory / "model_index.json").write_text(json.dumps(self.model_index(), indent=2))
        return directory

    def default_shift(self) -> float:
        """The shift of the default clip size, the one the saved scheduler carries."""
        m = self.meta
        channels = self.model.transformer.config.out_channels
        return sampling_shift(self.model, sample_shape(1, channels, m["frames"], m["height"], m["width"], self.vae))

    def model_index(self) -> dict:
        import diffusers

        text = {"tokenizer": ["transformers", type(self.tokenizer).__name__],
                "text_encoder": ["transformers", type(self.model.text_encoder).__name__],
                "transformer": ["diffusers", "WanTransformer3DModel"],
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
        if not self.meta["wan_pipeline_blockers"]:
            return {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__, **text,
                    "vae": ["diffusers", "AutoencoderKLWan"], "transformer_2": [None, None],
                    "boundary_ratio": None, "expand_timesteps": False}
        return {"_class_name": "VideoGenPipeline (apps.video_gen.pipeline)", **text,
                "pooled_text": (["apps.video_gen.model", "PooledTextConditioning"]
                                if self.model.pooled_text is not None else [None, None]),
                "vae": ["diffusers", "AutoencoderKLWan"] if self.vae is not None else [None, None]}

    @torch.no_grad()
    def __call__(self, prompts: list[str], seed: int = 0, steps: int = 24, guidance: float = 2.0,
                 frames: int | None = None, height: int | None = None, width: int | None = None,
                 first_frame: torch.Tensor | None = None) -> torch.Tensor:
        """Clips [B, 3, F, H, W] in [-1, 1] for the prompts; an i2v pipeline starts them from `first_frame`
        [B, 3, H, W] in [-1, 1] (its size sets the clip's)."""
        m = self.meta
        if first_frame is not None:
            height, width = first_frame.shape[-2:]
            first_frame = first_frame.to(self.model.device)
        ids = tokenize(self.tokenizer, prompts)
        return sample_clips(self.model, ids, frames or m["frames"], height or m["height"], width or m["width"], steps,
                            guidance, torch.Generator().manual_seed(seed), self.vae, m.get("sampler", "linear"),
                            first_frame)


def wan_blockers(model: VideoFlowModel, vae, meta: dict) -> list[str]:
    """Why diffusers' WanPipeline could not sample this model as the recipe does (empty: it can)."""
    out = []
    extra = model.transformer.config.in_channels - model.transformer.config.out_channels
    if model.i2v:
        out.append("first-frame conditioning (model.i2v): WanPipeline is text-to-video")
    elif extra:
        out.append(f"the transformer takes {extra} position-plane input channels (model.position_channels)")
    if model.pooled_text is not None:
        out.append("the pooled-text module (model.pooled_text) needs this recipe's code")
    if model.fcfg.skip_data_std:
        out.append("flow.skip_data_std adds c(t) x_t to the transformer's output")
    if vae is None:
        out.append("pixel space: WanPipeline decodes through an AutoencoderKLWan (set vae.from_dir)")
    elif vae_factors(vae)[0] == 1:
        out.append("an autoencoder without temporal downsampling (WanPipeline rounds the frame count)")
    if not model.zero_padding:
        out.append("the text encoder's padding states are kept (WanPipeline zeroes them; model.zero_text_padding)")
    if meta.get("sampler", "linear") != "scheduler":
        out.append("eval.sampler=linear (WanPipeline steps on the scheduler's grid)")
    return out


def make_meta(fcfg: FlowConfig, channels: int, frames: int, height: int, width: int, vae=None,
              sampler: str = "scheduler", i2v: bool = False) -> dict:
    """What the sampler needs: the flow settings, the sampler's timestep grid and the default clip size in
    pixels (`channels`: what the transformer outputs, latent channels with `vae`)."""
    meta = {"flow": asdict(fcfg), "channels": channels, "frames": frames, "height": height, "width": width,
            "sampler": sampler, "i2v": i2v}
    if vae is not None:
        meta["vae_temporal"], meta["vae_spatial"] = vae_factors(vae)
    return meta
