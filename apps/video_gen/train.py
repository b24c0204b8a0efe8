"""Train the text-to-video model: rectified flow on bucketed clips through `phalanx.train.fit`.

    python -m apps.video_gen.train --config apps/video_gen/configs/tiny.yaml
    torchrun --nproc-per-node 4 -m apps.video_gen.train --config apps/video_gen/configs/tiny.yaml \
        parallel.sp_size=2          # data x sequence: 2 replicas of 2 ranks, each rank 1/2 of each clip
                                    # (DDP; or train.plugin=zero2 / fsdp / gemini, sharded over all 4 ranks)
    torchrun --nproc-per-node 2 -m apps.video_gen.train --config apps/video_gen/configs/tiny.yaml \
        train.plugin=fsdp           # or zero2, gemini (sp_size=1)

The flow: (frozen autoencoder, with `vae.from_dir`) -> data (moving shapes + real clips, and the
clips of `data.manifest`, decoded when drawn or read as latents from `data.latent_cache`; tokenizer
from the captions or `model.text_encoder_dir`) -> buckets -> model (diffusers' Wan transformer + a
small CLIP text encoder or the user's local one, or `model.init_from`; or diffusers Wan weights from
`model.transformer_dir`) -> each clip encoded to its latent once (with the autoencoder) -> fit (eval:
the rectified-flow loss at fixed timesteps on held-out clips, per bucket, in latent space when there is
an autoencoder; at the end the motion check on decoded clips) -> the exported pipeline directory (rank
0; with vae/ in latent space; a diffusers WanPipeline when the model is plain Wan, see pipeline.py).

Latent stage (2 commands; see configs/tiny_latent.yaml):

    python -m apps.video_gen.train_vae --config apps/video_gen/configs/vae_tiny.yaml
    python -m apps.video_gen.train --config apps/video_gen/configs/tiny_latent.yaml \
        vae.from_dir=runs/video_vae_tiny/vae
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx.config import ConfigError
from phalanx.device import to_device
from phalanx.diffusion import fixed_eval_timesteps, save_gif
from phalanx.observe import get_logger, is_main_process

from .config import FlowConfig, RecipeConfig, parse_args, resolve
from .data import BucketedClips, check_buckets_cover, load_all_clips, load_manifest_split, training_dataset
from .model import (MOTION_CHANNELS, POSITION_CHANNELS, PooledTextConditioning, VideoFlowModel, build_transformer,
                    load_pretrained_transformer)
from .motion import motion_check as sample_motion_check
from .pipeline import VideoPipeline, make_meta, sample_clips
from .sensitivity import direction_gap
from .sequence_parallel import sequence_layout
from .sequence_replicas import fit_data_sequence
from .text import build_text_encoder, build_tokenizer, load_local_text, tokenize
from .vae import encode_latents, frames_ok, load_vae, vae_factors

log = get_logger("apps.video_gen")


def build_model(cfg: RecipeConfig, captions: list[str], channels: int = 3, tokenizer=None, text_encoder=None):
    """(VideoFlowModel, tokenizer): from `model.init_from` (an exported pipeline), or with the transformer of
    `model.transformer_dir` (diffusers weights) or built tiny, with
    `channels` in and out (3: pixels; the autoencoder's z_dim: latents). The text side: `text_encoder`
    and `tokenizer` when given, else `model.text_encoder_dir`, else a CLIP from scratch (with
    `tokenizer`, or one built from the captions)."""
    m = cfg.model
    if m.init_from:
        pipe = VideoPipeline.from_pretrained(resolve(m.init_from))
        model, tokenizer = pipe.model, pipe.tokenizer
        model.fcfg = cfg.flow = chain_flow(model.fcfg, cfg.flow, m.init_flow)
        model.caption_dropout = cfg.data.caption_dropout
        if model.i2v != m.i2v:
            raise ConfigError(f"config 'model.i2v'={m.i2v}: the pipeline of model.init_from={m.init_from!r} was "
                              f"trained with i2v={model.i2v} (its transformer's inputs differ); set model.i2v={model.i2v}")
        if m.zero_text_padding is not None:     # else the saved pipeline's choice
            model.zero_padding = m.zero_text_padding
    else:
        if text_encoder is None and m.text_encoder_dir:
            text_encoder, tokenizer = load_local_text(m.text_encoder_dir, m.tokenizer_dir, cfg.data.max_prompt_tokens)
        tokenizer = tokenizer or build_tokenizer(captions, cfg.data.max_prompt_tokens)
        if text_encoder is None:
            text_encoder = build_text_encoder(tokenizer, m.text_hidden_size, m.text_layers, m.text_heads,
                                              m.text_token_embedding_std)
        text_dim = text_encoder.config.hidden_size  # the transformer's text_dim follows the encoder
        transformer = load_pretrained_transformer(m.transformer_dir, text_dim, m.patch_size) if m.transformer_dir \
            else build_transformer(m, channels, text_dim)
        pooled = build_pooled_text(cfg, transformer.config.num_attention_heads * transformer.config.attention_head_dim,
                                   text_dim)
        model = VideoFlowModel(transformer, text_encoder, tokenize(tokenizer, [""])[0], tokenizer.pad_token_id,
                               cfg.flow, cfg.data.caption_dropout, pooled_text=pooled, zero_padding=m.zero_text_padding,
                               i2v=m.i2v)
    if m.gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    if m.freeze_text_encoder:
        model.freeze_text_encoder()
    return model.train(), tokenizer


def chain_flow(saved: FlowConfig, stage: FlowConfig, mode: str) -> FlowConfig:
    """The flow settings a stage started from `model.init_from` trains with: the saved ones
    (mode "keep") or this stage's (mode "config"); every setting that differs is printed."""
    changed = {k: (v, getattr(stage, k)) for k, v in asdict(saved).items() if getattr(stage, k) != v}
    if not changed:
        return saved
    listed = ", ".join(f"flow.{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
    if mode == "config":
        log.info(f"model.init_flow=config: this stage changes the saved flow settings: {listed}")
        return stage
    log.info(f"model.init_flow=keep: training with the saved flow settings; this config's differ and are ignored "
             f"({listed}); set model.init_flow=config to use them")
    return saved


def build_pooled_text(cfg: RecipeConfig, dim: int, text_dim: int | None = None) -> PooledTextConditioning | None:
    """The prompt's global conditioning (`model.pooled_text`, `model.prompt_position`), or None."""
    m = cfg.model
    if not m.pooled_text:
        return None
    planes = POSITION_CHANNELS + MOTION_CHANNELS * m.motion_channels if m.prompt_position else 0
    return PooledTextConditioning(text_dim or m.text_hidden_size, dim, position_planes=planes,
                                  tokens=cfg.data.max_prompt_tokens if m.pooled_text == "flat" else 0,
                                  queries=m.pooled_text_queries if m.pooled_text == "attention" else 0)


def frozen_vae(cfg: RecipeConfig):
    """The autoencoder whose latents the transformer trains on: `vae.from_dir`, else the vae/ of the
    `model.init_from` pipeline, else None (pixel space). Its frame and size factors are checked
    against the buckets here, before any data is loaded."""
    if cfg.vae.from_dir:
        vae = load_vae(cfg.vae.from_dir)
    elif cfg.model.init_from and (resolve(cfg.model.init_from) / "vae").is_dir():
        vae = load_vae(resolve(cfg.model.init_from) / "vae", key="model.init_from")
    else:
        return None
    tf, sf = vae_factors(vae)
    pt, ph, pw = cfg.model.patch_size
    frames = [cfg.data.shapes_frames] * bool(cfg.data.shapes_videos) + [b.frames for b in cfg.buckets]
    bad = [f for f in frames if not frames_ok(f, tf)]
    if bad:
        raise ConfigError(f"config 'data.buckets'={cfg.data.buckets!r} / 'data.shapes_frames'={cfg.data.shapes_frames}: "
                          f"{sorted(set(bad))} frames; the causal autoencoder takes 1 + k x {tf} frames (e.g. "
                          f"{', '.join(str(1 + k * tf) for k in range(4))}): give every bucket and data.shapes_frames "
                          "such a count (and data.clip_frames at least the longest bucket)")
    for b in cfg.buckets:
        shape = ((b.frames - 1) // tf + 1, b.height // sf, b.width // sf)
        if b.height % sf or b.width % sf or shape[0] % pt or shape[1] % ph or shape[2] % pw:
            raise ConfigError(f"config 'data.buckets'={cfg.data.buckets!r}: bucket {b.shape} gives {shape} latents "
                              f"(autoencoder: {tf}x temporal, {sf}x spatial), which model.patch_size "
                              f"{cfg.model.patch_size} does not divide; choose sizes divisible by {sf} x the patch")
    log.info(f"latent space: {tf}x temporal, {sf}x spatial, {vae.config['z_dim']} channels (frozen autoencoder)")
    return vae


@torch.no_grad()
def encode_clips(vae, clips: BucketedClips, keep_std: bool, batch: int = 16) -> None:
    """Replace every bucketed clip's "video" by its normalised latent (posterior mean), once: the
    autoencoder is frozen, so the transformer trains on cached latents. With `keep_std` the
    posterior std is kept too ("latent_std"), for a fresh draw each step (`vae.sample_posterior`)."""
    from phalanx.launch import context

    device = context().device
    vae.to(device)
    for index in clips.per_bucket().values():
        for start in range(0, len(index), batch):
            chunk = index[start:start + batch]
            mean, std = encode_latents(vae, torch.stack([clips[i]["video"] for i in chunk]).to(device))
            for i, z, s in zip(chunk, mean.cpu(), std.cpu()):
                clips.items[i]["video"] = z
                if keep_std:
                    clips.items[i]["latent_std"] = s
    vae.cpu()


def load_trained(model: VideoFlowModel, state: dict[str, torch.Tensor]) -> None:
    """The trained weights back into `model`. The checkpoint holds tied weights once (T5's
    encoder.embed_tokens is its shared embedding), so those may be missing; nothing else may."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    owners: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owners.setdefault(tensor.data_ptr(), []).append(name)
    tied = {n for names in owners.values() if len(names) > 1 for n in names}
    if [n for n in missing if n not in tied] or unexpected:
        raise RuntimeError(f"the checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def batch_loss(model: VideoFlowModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flow loss of a batch; cached latents with their posterior std get a fresh draw first."""
    video, std = batch["video"], batch.get("latent_std")
    if std is not None:
        video = video + std * torch.randn_like(std)
    return model(video, batch["prompt_ids"])


def prepare(cfg: RecipeConfig):
    """(model, tokenizer, training batches, held-out clips, frozen autoencoder or None); autoencoder,
    data, bucket and text-encoder errors come before the model is built and the clips are encoded."""
    vae = frozen_vae(cfg)
    train_clips, held_clips = load_all_clips(cfg.data)
    manifest, rows = None, None
    if cfg.data.manifest:
        if vae is not None and not cfg.data.latent_cache:
            raise ConfigError("config 'data.latent_cache'=null: latent training on data.manifest reads its latents "
                              "from disk; write them with `python -m apps.video_gen.latents` (same config) and set "
                              "data.latent_cache to that folder, or set vae.from_dir=null for pixel space")
        if vae is None and cfg.data.latent_cache:
            raise ConfigError(f"config 'data.latent_cache'={cfg.data.latent_cache!r}: the cache holds latents but "
                              "there is no autoencoder; set vae.from_dir to the one that wrote it, or the cache to "
                              "null")
        manifest, rows, manifest_held, probed = load_manifest_split(cfg.data, cfg.buckets, cfg.eval.max_clips)
        held_clips += manifest_held
        log.info(f"manifest {manifest.source}: {len(manifest)} rows ({manifest.dropped} left out by the score "
                 f"filters, {probed} files probed for their sizes), {len(rows)} training rows, "
                 f"{len(manifest_held)} held-out clips decoded")
    captions = [c.caption for c in train_clips + held_clips] + (list(manifest.all_captions()) if manifest else [])
    text_encoder = None
    if cfg.model.init_from:
        model, tokenizer = build_model(cfg, captions)
    elif cfg.model.text_encoder_dir:
        text_encoder, tokenizer = load_local_text(cfg.model.text_encoder_dir, cfg.model.tokenizer_dir,
                                                  cfg.data.max_prompt_tokens)
    else:
        tokenizer = build_tokenizer(captions, cfg.data.max_prompt_tokens)
    held = BucketedClips(held_clips, cfg.buckets, tokenizer)
    check_buckets_cover(held, "held-out")
    # raises BucketConfigError when a part yields no batch
    batches, train = training_dataset(cfg.data, cfg.buckets, tokenizer, train_clips, manifest, rows, cfg.train.seed,
                                      latents=vae is not None, keep_std=cfg.vae.sample_posterior)
    channels = vae.config["z_dim"] if vae is not None else 3
    if not cfg.model.init_from:
        model, tokenizer = build_model(cfg, captions, channels, tokenizer=tokenizer, text_encoder=text_encoder)
    if model.transformer.config.out_channels != channels:
        key = "model.transformer_dir" if cfg.model.transformer_dir else "model.init_from"
        raise ConfigError(f"config '{key}'={getattr(cfg.model, key.split('.')[1])!r}: its transformer works on "
                          f"{model.transformer.config.out_channels} channels, but the clips give {channels} "
                          f"({'latents of vae.from_dir' if vae is not None else 'pixels'}); set vae.from_dir to the "
                          "autoencoder it was trained with (or null for pixels)")
    if vae is not None:
        for clips in (c for c in (train, held) if c is not None):  # manifest clips: from data.latent_cache
            encode_clips(vae, clips, cfg.vae.sample_posterior)
        some = train if train is not None else held
        z = torch.stack([some[i]["video"] for i in next(iter(some.per_bucket().values()))])
        log.info(f"encoded {len(train) if train is not None else 0} training and {len(held)} held-out clips once; "
                 f"normalised latents: mean {float(z.mean()):.3f}, std {float(z.std()):.3f}")
    return model, tokenizer, batches, held, vae


@torch.no_grad()
def heldout_flow_loss(model: VideoFlowModel, held: BucketedClips, timesteps: int, max_clips: int,
                      seed: int = 0) -> dict[str, float]:
    """Open-Sora's evaluation loss: the rectified-flow loss at `timesteps` fixed t for every held-out
    clip, with fixed noise, per bucket ("loss/<F>x<H>x<W>") and over all ("loss")."""
    out, total, count = {}, 0.0, 0
    device = model.device
    for bucket, index in held.per_bucket().items():
        index = index[:max_clips]
        g = torch.Generator().manual_seed(seed)
        video = torch.stack([held[i]["video"] for i in index])
        ids = torch.stack([held[i]["prompt_ids"] for i in index])
        noise = torch.randn(video.shape, generator=g)  # drawn on the host: the same noise on every device
        video, ids, noise, ts = to_device((video, ids, noise, fixed_eval_timesteps(timesteps)), device)
        losses = torch.stack([model.per_sample_loss(video, ids, t.expand(len(index)), noise).mean()
                              for t in ts]).tolist()  # one device->host sync per bucket
        out[f"loss/{bucket.frames}x{bucket.height}x{bucket.width}"] = sum(losses) / len(losses)
        total += sum(losses) / len(losses) * len(index)
        count += len(index)
    out["loss"] = total / count
    return out


def motion_check(model: VideoFlowModel, tokenizer, cfg: RecipeConfig, out_dir: Path | None = None,
                 vae=None) -> dict[str, float]:
    """`eval.motion_samples` sampled clips per prompt set (motion.py): the held-out caption combinations and
    the trained ones with `data.held_out_combos`, else all combinations."""
    e, d = cfg.eval, cfg.data
    return sample_motion_check(model, tokenizer, e.motion_samples, d.shapes_frames, d.shapes_size, e.sample_steps,
                               e.guidance_scale, e.seed, e.sampler, vae, out_dir=out_dir,
                               splits=("held_out", "trained") if d.held_out_combos else ("all",))


def make_eval_fn(cfg: RecipeConfig, tokenizer, held: BucketedClips, output_dir: Path, vae=None, ema=None):
    def eval_fn(model: VideoFlowModel, step: int) -> dict[str, float]:
        with ema.swapped() if ema is not None else contextlib.nullcontext():   # eval.ema_decay: the averaged weights
            return evaluate(model, step)

    def evaluate(model: VideoFlowModel, step: int) -> dict[str, float]:
        metrics = heldout_flow_loss(model, held, cfg.eval.timesteps, cfg.eval.max_clips, cfg.eval.seed)
        # every rank runs all of it (same inputs, same numbers): under FSDP2 / Gemini each forward gathers
        # parameters from every rank, so a rank-0-only evaluation would hang the others; rank 0 writes the files
        if cfg.eval.motion_samples and step == cfg.train.max_steps:
            metrics.update(direction_gap(model, tokenizer, cfg.data.shapes_frames, cfg.data.shapes_size, vae=vae))
            metrics.update(motion_check(model, tokenizer, cfg, output_dir / "eval" if is_main_process() else None,
                                        vae))
        return metrics
    return eval_fn


def sample_size(cfg: RecipeConfig) -> tuple[int, int, int]:
    """The exported pipeline's default clip (frames, height, width): the moving shapes' size, or
    without shapes the longest (then largest) bucket."""
    d = cfg.data
    if d.shapes_videos:
        return d.shapes_frames, d.shapes_size, d.shapes_size
    return max(cfg.buckets, key=lambda b: (b.frames, b.height * b.width)).shape


def setup_sequence_parallel(cfg: RecipeConfig, model: VideoFlowModel) -> None:
    """Data x sequence parallelism (`parallel.sp_size`): the model's SP group is this rank's group
    of sp consecutive ranks (see sequence_parallel.py)."""
    sp = cfg.parallel.sp_size
    if sp == 1:
        return
    heads = model.transformer.config.num_attention_heads
    if heads % sp:
        raise ConfigError(f"config 'parallel.sp_size'={sp}: Ulysses splits the {heads} attention heads over the SP "
                          f"group; choose an sp_size that divides {heads} (or model.num_heads a multiple of {sp})")
    layout = sequence_layout(sp)
    model.sp_group = layout.group
    log.info(f"data x sequence parallelism: {layout.describe()}")


def unsharded_copy(cfg: RecipeConfig, model: VideoFlowModel) -> VideoFlowModel | None:
    """Rank 0's host copy of the model for the export, under the plugins that shard the model in place
    (FSDP2's DTensor parameters, Gemini's chunk views): the trained weights are loaded into it from the
    final checkpoint. None elsewhere (the model itself is exported)."""
    import copy

    if not (is_main_process() and cfg.train.plugin in ("fsdp", "gemini")):
        return None
    with model.sequence_parallel(None):   # a process group is not copied; the export samples without SP
        return copy.deepcopy(model)


def train(cfg: RecipeConfig):
    from phalanx.checkpoint.hf import load_hf_state_dict
    from phalanx.train import EMA

    from phalanx.data.buckets import unwrap_single

    model, tokenizer, batches, held, vae = prepare(cfg)
    setup_sequence_parallel(cfg, model)
    if cfg.train.micro_batch_size != 1:
        raise ConfigError(f"config 'train.micro_batch_size'={cfg.train.micro_batch_size}: batches come whole from "
                          "the buckets (data.buckets sets each bucket's batch size); set train.micro_batch_size=1")
    output_dir = Path(cfg.train.output_dir)
    initial = heldout_flow_loss(model.eval(), held, cfg.eval.timesteps, cfg.eval.max_clips, cfg.eval.seed)
    model.train()
    space = "latent space" if vae is not None else "pixel space"
    log.info(f"held-out flow loss ({space}) before training: " + ", ".join(f"{k}={v:.4f}" for k, v in initial.items()))
    ema = EMA(cfg.eval.ema_decay) if cfg.eval.ema_decay else None
    export_model = unsharded_copy(cfg, model)
    result = fit_data_sequence(cfg.train, cfg.parallel.sp_size, model, batches, collate_fn=unwrap_single,
                               loss_fn=batch_loss,
                               eval_fn=make_eval_fn(cfg, tokenizer, held, output_dir, vae, ema), tokenizer=None,
                               hooks=[ema] if ema is not None else [])
    averaged = ema.full_state_dict() if ema is not None else None   # every rank (FSDP gathers)
    if is_main_process():
        model = export_model or model
        model.sp_group = None
        load_trained(model, load_hf_state_dict(result.checkpoint_dir / "model"))
        if averaged is not None:  # the export holds the averaged weights, as the evaluation used
            model.load_state_dict(averaged, strict=False)
        meta = make_meta(model.fcfg, model.transformer.config.out_channels, *sample_size(cfg), vae=vae,
                         sampler=cfg.eval.sampler, i2v=model.i2v)
        VideoPipeline(model, tokenizer, meta, vae).save_pretrained(cfg.final_path)
        blockers = meta["wan_pipeline_blockers"]
        log.info("the export is a diffusers WanPipeline" if not blockers else
                 "the export needs this recipe's VideoPipeline (not WanPipeline): " + "; ".join(blockers))
        summary = {"space": space, "initial": initial, "final": result.last_eval,
                   "loss_drop": 1 - result.last_eval["loss"] / initial["loss"], "steps": result.final_step,
                   "wall_time_s": result.wall_time_s, "pipeline": str(cfg.final_path)}
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info(f"exported {cfg.final_path}; held-out loss ({space}) {initial['loss']:.4f} -> {result.last_eval['loss']:.4f} "
                 f"({summary['loss_drop']:.0%} lower)")
    return result


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg = parse_args("Train the Open-Sora-style text-to-video recipe", argv)
    with launched(seed=cfg.train.seed):
        result = train(cfg)
        if is_main_process():
            print(f"done at step {result.final_step}: eval {result.last_eval}")


if __name__ == "__main__":
    main()
