"""The video recipe's config: one dataclass per section, filled from YAML + `key=value`.

    python -m apps.video_gen.train --config apps/video_gen/configs/tiny.yaml train.max_steps=50

Relative paths are resolved against the repository root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.config import ConfigError, load_config, parse_config_args, resolve_path
from phalanx.data.buckets import Bucket, BucketConfigError
from phalanx.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]

# The plugins that run data x sequence parallelism (parallel.sp_size > 1; sequence_replicas.py): each deals one
# micro-batch per SP group and shards over every rank (the plugins' ranks_per_replica).
# "hybrid" has its own sequence parallelism for causal LMs and does not take this model.


def resolve(path: str | Path) -> Path:
    return resolve_path(path, REPO)


@dataclass
class DataConfig:
    # Generated "moving shapes": a coloured shape moving in a named direction; captions from the generator.
    shapes_videos: int = 512                    # clips
    shapes_images: int = 128                    # single frames ("a red square"): joint image + video training
    shapes_frames: int = 8
    shapes_size: int = 16                       # height = width of the generated frames
    shapes_seed: int = 0
    # Real clips: a folder with captions.jsonl ({"file": ..., "text": ...}) and the video files
    # (decoded with PyAV); each is cut into clips of `clip_frames` frames. null: none.
    clips_dir: str | None = "apps/video_gen/data/clips"
    clip_frames: int = 8
    clip_stride: int = 2                        # keep every n-th frame (motion per frame at low fps)
    clips_per_video: int = 8
    clip_height: int = 16                       # real clips are resized to this height (aspect kept)
    # A manifest of real clips for datasets of any size: CSV / JSONL / parquet in Open-Sora's layout (path, text,
    # optional num_frames, height, width, fps, aes, score; see manifest.py). Only paths and captions are kept; clips
    # are decoded when drawn (on train.num_workers DataLoader workers), every clip_stride-th frame from a random
    # offset, cropped to the bucket's aspect and resized. data.held_out of its videos are held out. null: none.
    manifest: str | None = None
    manifest_root: str | None = None            # the base of the manifest's relative paths (null: its folder)
    min_aesthetic: float | None = None          # keep only rows whose aes / aesthetic column is at least this
    min_score: float | None = None              # keep only rows whose score column is at least this
    clip_fps: float | None = None               # manifest clips: stride = the video's fps / this (null: clip_stride)
    crop: str = "center"                        # manifest clips: crop to the bucket's aspect at the centre, or "random"
    # With vae.from_dir: a folder of the manifest's latents written by `python -m apps.video_gen.latents`
    # (safetensors shards), read back in training instead of decoding and encoding clips. null: none.
    latent_cache: str | None = None
    latent_views: int = 1                       # precomputed views per row (each its own offset / crop)
    # Buckets [frames, height, width, batch_size]: each sample goes to the nearest by aspect and length.
    buckets: list[list[int]] = field(default_factory=lambda: [[1, 16, 16, 16], [8, 16, 16, 8], [8, 16, 28, 4]])
    held_out: float = 0.1                       # share of the shapes clips (and of a manifest's videos) held out
    held_out_combos: bool = False               # no training clip of shapes.HELD_OUT_COMBOS (the motion check's held-out prompts)
    caption_dropout: float = 0.1                # empty prompt instead of the caption (classifier-free guidance)
    max_prompt_tokens: int = 12


@dataclass
class ModelConfig:
    # A local pipeline directory this recipe exported (transformer/, text_encoder/, tokenizer/, vae/?):
    # start from its weights. null: build the tiny models below, randomly initialised.
    init_from: str | None = None
    # With init_from: the flow settings (timesteps, shift, skip ...) of the next stage. "keep": the saved pipeline's
    # (where this config's flow section differs, the differences are printed and ignored); "config": this config's
    # flow section (each changed setting printed, saved -> new). The export records the settings trained with.
    init_flow: str = "keep"
    # A pretrained start from diffusers: a local WanTransformer3DModel directory (config.json + weights saved with
    # save_pretrained), or a diffusers Wan pipeline directory with transformer/ inside. Its sizes replace the tiny
    # ones below (patch_size must still match it); its text_dim must equal the text encoder's hidden size (pair it
    # with model.text_encoder_dir, e.g. the same pipeline directory) and its channels the autoencoder's z_dim
    # (vae.from_dir, e.g. <pipeline>/vae). null: build the tiny transformer below.
    transformer_dir: str | None = None
    patch_size: list[int] = field(default_factory=lambda: [1, 2, 2])
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 16
    ffn_dim: int = 256
    freq_dim: int = 64
    text_hidden_size: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_token_embedding_std: float = 1.0       # init std of the word embeddings (CLIP's 0.02 left the direction words alike)
    # Concatenate (frame, row, column) planes to the input: absolute positions, which Wan's relative 3D RoPE
    # cannot give from noise (issue 16; on its own it has not yet made the direction word learned, see README).
    position_channels: bool = False
    # With position_channels: also frame x row and frame x column planes, the coordinates in which a straight
    # motion's direction shows (issue 16; see `model.position_planes`).
    motion_channels: bool = False
    # Add the pooled prompt to Wan's time embedding (global AdaLN conditioning, as SD3/Flux do with pooled
    # text; `model.PooledTextConditioning`): true / "mean": the mean of the text encoder's states; "flat": the
    # states flattened (max_prompt_tokens x text_hidden_size: the mean dilutes a single word). false: the prompt
    # reaches Wan through cross-attention only.
    # "attention": `pooled_text_queries` learned queries attend over the states (inputs text_dim x queries, sized
    # independently of max_prompt_tokens; flat's text_dim x max_prompt_tokens is billions of weights with UMT5-XXL).
    pooled_text: bool | str = False
    pooled_text_queries: int = 4
    # With pooled_text: also a prompt-dependent absolute position embedding added to the tokens, linear in the
    # (frame, row, column[, frame x row, frame x column]) planes (`PooledTextConditioning.position_embedding`).
    prompt_position: bool = False
    gradient_checkpointing: bool = False        # recompute each transformer block in backward (memory for time)
    # A local Hugging Face text encoder instead of the small CLIP trained from scratch: a directory saved with
    # save_pretrained (T5EncoderModel, UMT5EncoderModel, CLIPTextModel, ...; or a diffusers pipeline directory with
    # text_encoder/ and tokenizer/). Loaded offline; the transformer's text_dim follows its hidden size, and the
    # text_* sizes above are then unused. null: the from-scratch CLIP.
    text_encoder_dir: str | None = None
    tokenizer_dir: str | None = None            # its tokenizer (null: the same directory, or its tokenizer/)
    freeze_text_encoder: bool = False           # keep the text encoder's weights fixed (eval mode, no gradients)
    # Zero the text encoder's padding states before cross-attention, as WanPipeline does. null: for T5 / UMT5 / mT5
    # always, for other encoders when model.pooled_text is off (the plain Wan model; the toy configs' CLIP + pooled
    # text keep them, as their figures were measured).
    zero_text_padding: bool | None = None
    # Image-to-video (Open-Sora 2.0's / Wan's i2v): the clip's first (latent) frame is given clean, concatenated on
    # the channels with a mask, and the loss covers the other frames (`first_frame.py`). Every bucket needs 2 or
    # more (latent) frames; sampling takes a first frame (VideoPipeline(..., first_frame=...)).
    i2v: bool = False


@dataclass
class FlowConfig:
    # Rectified flow: x_t = (1 - t) x0 + t noise, velocity target noise - x0.
    timesteps: str = "logit_normal"             # logit_normal | uniform
    logit_mean: float = 0.0
    logit_std: float = 1.0
    # A share of the samples drawn from a second, high-noise logit-normal instead (before the shift): the motion
    # direction is decided at t near 1, which the distributions above rarely draw (issue 16). 0: off.
    high_noise_share: float = 0.0
    high_noise_logit_mean: float = 2.5
    high_noise_logit_std: float = 0.5
    # Resolution/length shift sqrt(tokens / shift_base_tokens) (Open-Sora, SD3); 0 turns it off.
    shift_base_tokens: int = 64
    max_shift: float = 3.0
    # The velocity as skip + network: v = c(t) x_t + F(x_t), c(t) = the best linear guess of the velocity from
    # x_t for data of std `skip_data_std` (1 at t = 1: the noise is passed through, not copied by the network).
    # 0: off, v = F(x_t).
    skip_data_std: float = 0.0


@dataclass
class EvalConfig:
    every: int = 0                              # steps between evaluations (0: only at the end)
    timesteps: int = 10                         # Open-Sora's evaluation loss: this many fixed t per held-out clip
    max_clips: int = 32                         # held-out clips per bucket scored
    motion_samples: int = 0                     # clips sampled for the motion check at the end (0: off)
    sample_steps: int = 24
    guidance_scale: float = 2.0
    seed: int = 0
    # The sampler's timestep grid (recorded in the export): "scheduler": the saved FlowMatchEulerDiscreteScheduler's
    # sigmas, the steps WanPipeline takes; "linear": the older grid 1 - k / steps (shifted), kept for the toy configs'
    # documented motion figures.
    sampler: str = "scheduler"
    ema_decay: float = 0.0                      # > 0: an EMA of the weights (phalanx.train.EMA) is evaluated and exported


@dataclass
class ParallelConfig:
    # Ulysses sequence parallelism over the video tokens: groups of sp_size consecutive ranks share one micro-batch
    # and each computes 1/sp_size of its tokens; the world / sp_size groups are the data-parallel replicas (data x
    # sequence). sp_size must divide the world size; 1: off. Under ddp, zero1, zero2, fsdp or gemini: the sharding
    # plugins shard over every rank (dp x sp), as all of them hold the same parameters.
    sp_size: int = 1


@dataclass
class VAEConfig:
    # `python -m apps.video_gen.train`: a local diffusers AutoencoderKLWan directory (a train_vae output
    # <output_dir>/vae, or real weights such as Wan 2.1's vae/): the transformer then trains on its latents, each
    # clip encoded once by the frozen autoencoder and normalised with the config's latents_mean / latents_std;
    # sampling decodes through it, and the exported pipeline carries it (vae/). null: pixel space.
    from_dir: str | None = None
    sample_posterior: bool = False              # with from_dir: a fresh draw from the latent posterior each step (false: its mode)
    # `python -m apps.video_gen.train_vae`: a tiny AutoencoderKLWan (causal 3D) trained on the same clips.
    pretrained_dir: str | None = None           # a local diffusers AutoencoderKLWan directory to start from
    base_dim: int = 16
    z_dim: int = 4
    dim_mult: list[int] = field(default_factory=lambda: [1, 2])                 # 2 levels: 2x spatial downsampling
    temporal_downsample: list[bool] = field(default_factory=lambda: [True])     # 2x temporal (clips of 1 + 2k frames)
    num_res_blocks: int = 1
    l2_weight: float = 1.0
    foreground_weight: float = 9.0              # extra loss weight of non-black pixels (1 + 9 = 10x; 0: unweighted)
    kl_weight: float = 1.0e-3                   # x KL per element of the input
    temporal_weight: float = 0.5                # L1 between frame-to-frame changes (0: off)
    held_out_clips: int = 16                    # clips scored for the held-out PSNR


@dataclass
class RecipeConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    final_dir: str | None = None                # the exported pipeline; default <train.output_dir>/pipeline

    @property
    def buckets(self) -> list[Bucket]:
        return [Bucket.parse(b) for b in self.data.buckets]

    @property
    def final_path(self) -> Path:
        return resolve(self.final_dir) if self.final_dir else resolve(self.train.output_dir) / "pipeline"

    def validate(self) -> None:
        def need(ok: bool, key: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"config '{key}'={value!r}: {why}")

        d, m, f = self.data, self.model, self.flow
        try:
            buckets = self.buckets
        except (BucketConfigError, TypeError) as exc:
            raise ConfigError(f"config 'data.buckets'={d.buckets!r}: {exc}") from exc
        need(bool(buckets), "data.buckets", d.buckets, "give at least one [frames, height, width, batch_size]")
        pt, ph, pw = m.patch_size
        for b in buckets if not self.vae.from_dir else []:  # latent buckets are checked against the autoencoder
            need(b.height % ph == 0 and b.width % pw == 0 and b.frames % pt == 0, "data.buckets", d.buckets,
                 f"bucket {b.shape} is not divisible by model.patch_size {m.patch_size}")
        need(0.0 <= self.eval.ema_decay < 1.0, "eval.ema_decay", self.eval.ema_decay, "must be in [0, 1) (0: off)")
        need(0.0 <= d.caption_dropout < 1.0, "data.caption_dropout", d.caption_dropout, "must be in [0, 1)")
        need(0.0 < d.held_out < 1.0, "data.held_out", d.held_out, "must be in (0, 1)")
        need(d.shapes_size >= 8, "data.shapes_size", d.shapes_size, "must be at least 8 pixels")
        need(m.init_flow in ("keep", "config"), "model.init_flow", m.init_flow,
             "choose keep (the saved pipeline's flow settings) or config (this config's flow section)")
        need(d.crop in ("center", "random"), "data.crop", d.crop, "choose center or random")
        need(d.latent_views >= 1, "data.latent_views", d.latent_views, "must be at least 1")
        need(not d.latent_cache or bool(d.manifest), "data.latent_cache", d.latent_cache,
             "caches a manifest's latents: give data.manifest too, or set it to null")
        need(d.clip_stride >= 1, "data.clip_stride", d.clip_stride, "must be at least 1")
        need(d.clip_fps is None or d.clip_fps > 0, "data.clip_fps", d.clip_fps, "must be positive (or null)")
        need(bool(d.shapes_videos or d.shapes_images or d.clips_dir or d.manifest), "data.manifest", d.manifest,
             "no training data: give a manifest, a clips_dir or moving shapes (data.shapes_videos)")
        need(d.shapes_videos > 0 or not self.eval.motion_samples, "eval.motion_samples", self.eval.motion_samples,
             "the motion check samples moving-shapes prompts; set it to 0 when data.shapes_videos=0")
        need(f.timesteps in ("logit_normal", "uniform"), "flow.timesteps", f.timesteps, "choose logit_normal or uniform")
        need(f.logit_std > 0, "flow.logit_std", f.logit_std, "must be positive")
        need(0.0 <= f.high_noise_share <= 1.0, "flow.high_noise_share", f.high_noise_share, "must be in [0, 1]")
        need(f.high_noise_logit_std > 0, "flow.high_noise_logit_std", f.high_noise_logit_std, "must be positive")
        need(m.position_channels or not m.motion_channels, "model.motion_channels", m.motion_channels,
             "needs model.position_channels=true")
        need(bool(m.pooled_text) or not m.prompt_position, "model.prompt_position", m.prompt_position,
             "needs model.pooled_text")
        need(m.pooled_text in (True, False, "mean", "flat", "attention"), "model.pooled_text", m.pooled_text,
             "choose true (mean), false, 'mean', 'flat' or 'attention'")
        need(m.pooled_text_queries >= 1, "model.pooled_text_queries", m.pooled_text_queries, "must be at least 1")
        need(not (m.init_from and m.text_encoder_dir), "model.text_encoder_dir", m.text_encoder_dir,
             "model.init_from already brings its text encoder; set one of the two to null")
        need(not (m.init_from and m.transformer_dir), "model.transformer_dir", m.transformer_dir,
             "model.init_from already brings its transformer; set one of the two to null")
        need(self.eval.sampler in ("scheduler", "linear"), "eval.sampler", self.eval.sampler,
             "choose scheduler (the exported scheduler's grid, as WanPipeline) or linear")
        need(m.text_hidden_size % m.text_heads == 0, "model.text_heads", m.text_heads,
             "must divide model.text_hidden_size")
        need(m.text_token_embedding_std > 0, "model.text_token_embedding_std", m.text_token_embedding_std,
             "must be positive")
        need(not m.i2v or min(b.frames for b in buckets) >= 2, "data.buckets", d.buckets,
             "model.i2v predicts the frames after the first: every bucket needs 2 or more frames")
        need(not m.i2v or d.shapes_images == 0, "data.shapes_images", d.shapes_images,
             "model.i2v trains on clips (the first frame given): set it to 0")
        need(not m.i2v or not self.eval.motion_samples, "eval.motion_samples", self.eval.motion_samples,
             "the motion check samples from prompts alone; an i2v model needs a first frame: set it to 0")
        need(self.parallel.sp_size >= 1, "parallel.sp_size", self.parallel.sp_size, "must be at least 1")
        self.train.with_replica_groups(self.parallel.sp_size, "parallel.sp_size")  # raises if the plugin cannot
        need(self.eval.timesteps >= 1, "eval.timesteps", self.eval.timesteps, "must be at least 1")


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> RecipeConfig:
    cfg = load_config(RecipeConfig, resolve(path) if path is not None else None, overrides)
    cfg.train.output_dir = str(resolve(cfg.train.output_dir))
    cfg.train.eval_every = cfg.eval.every
    cfg.validate()
    return cfg


def parse_args(description: str, argv: list[str] | None = None) -> RecipeConfig:
    return parse_config_args(description, load_recipe, argv, example="apps/video_gen/configs/tiny.yaml")[0]
