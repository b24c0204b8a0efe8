"""Train the text-to-video model: rectified flow on bucketed clips through `phalanx.train.fit`.

    python -m apps.video_gen.train --config apps/video_gen/configs/tiny.yaml
    torchrun --nproc-per-node 2 -m apps.video_gen.train --config apps/video_gen/configs/tiny.yaml \
        train.plugin=zero2 parallel.sp_size=2

The flow: data (moving shapes + real clips, tokenizer from the captions) -> buckets -> model
(diffusers' Wan transformer + a small CLIP text encoder, or `model.init_from`) -> fit (eval: the
rectified-flow loss at fixed timesteps on held-out clips, per bucket; at the end the motion check)
-> the exported pipeline directory (rank 0).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx.config import ConfigError
from phalanx.diffusion import fixed_eval_timesteps, save_gif
from phalanx.observe import get_logger, is_main_process

from .config import RecipeConfig, parse_args
from .data import BucketedClips, check_buckets_cover, load_all_clips, training_batches
from .model import MOTION_CHANNELS, POSITION_CHANNELS, PooledTextConditioning, VideoFlowModel, build_transformer
from .motion import motion_prompts, motion_score
from .pipeline import VideoPipeline, euler_sample, make_meta
from .sensitivity import direction_gap
from .text import build_text_encoder, build_tokenizer, tokenize

log = get_logger("apps.video_gen")


def build_model(cfg: RecipeConfig, captions: list[str], channels: int = 3, tokenizer=None):
    """(VideoFlowModel, tokenizer): from `model.init_from` (an exported pipeline) or built tiny
    (with `tokenizer`, or one built from the captions)."""
    m = cfg.model
    if m.init_from:
        pipe = VideoPipeline.from_pretrained(m.init_from)
        model, tokenizer = pipe.model, pipe.tokenizer
        model.fcfg, model.caption_dropout = cfg.flow, cfg.data.caption_dropout
    else:
        tokenizer = tokenizer or build_tokenizer(captions, cfg.data.max_prompt_tokens)
        text_encoder = build_text_encoder(tokenizer, m.text_hidden_size, m.text_layers, m.text_heads,
                                          m.text_token_embedding_std)
        transformer = build_transformer(m, channels, m.text_hidden_size)
        pooled = build_pooled_text(cfg, transformer.config.num_attention_heads * transformer.config.attention_head_dim)
        model = VideoFlowModel(transformer, text_encoder, tokenize(tokenizer, [""])[0], tokenizer.pad_token_id,
                               cfg.flow, cfg.data.caption_dropout, pooled_text=pooled)
    if m.gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    return model.train(), tokenizer


def build_pooled_text(cfg: RecipeConfig, dim: int) -> PooledTextConditioning | None:
    """The prompt's global conditioning (`model.pooled_text`, `model.prompt_position`), or None."""
    m = cfg.model
    if not m.pooled_text:
        return None
    planes = POSITION_CHANNELS + MOTION_CHANNELS * m.motion_channels if m.prompt_position else 0
    return PooledTextConditioning(m.text_hidden_size, dim, tokens=cfg.data.max_prompt_tokens if m.pooled_text == "flat"
                                  else 0, position_planes=planes)


def prepare(cfg: RecipeConfig):
    """(model, tokenizer, training batches, held-out clips); data and bucket errors come before the
    model is built."""
    train_clips, held_clips = load_all_clips(cfg.data)
    captions = [c.caption for c in train_clips + held_clips]
    if cfg.model.init_from:
        model, tokenizer = build_model(cfg, captions)
    else:
        tokenizer = build_tokenizer(captions, cfg.data.max_prompt_tokens)
    train = BucketedClips(train_clips, cfg.buckets, tokenizer)
    held = BucketedClips(held_clips, cfg.buckets, tokenizer)
    check_buckets_cover(held, "held-out")
    batches = training_batches(train, seed=cfg.train.seed)  # raises BucketConfigError when it yields no batch
    if not cfg.model.init_from:
        model, tokenizer = build_model(cfg, captions, tokenizer=tokenizer)
    return model, tokenizer, batches, held


@torch.no_grad()
def heldout_flow_loss(model: VideoFlowModel, held: BucketedClips, timesteps: int, max_clips: int,
                      seed: int = 0) -> dict[str, float]:
    """Open-Sora's evaluation loss: the rectified-flow loss at `timesteps` fixed t for every held-out
    clip, with fixed noise, per bucket ("loss/<F>x<H>x<W>") and over all ("loss")."""
    out, total, count = {}, 0.0, 0
    for bucket, index in held.per_bucket().items():
        index = index[:max_clips]
        g = torch.Generator().manual_seed(seed)
        video = torch.stack([held[i]["video"] for i in index])
        ids = torch.stack([held[i]["prompt_ids"] for i in index])
        noise = torch.randn(video.shape, generator=g)
        losses = [model.per_sample_loss(video, ids, t.expand(len(index)), noise).mean().item()
                  for t in fixed_eval_timesteps(timesteps)]
        out[f"loss/{bucket.frames}x{bucket.height}x{bucket.width}"] = sum(losses) / len(losses)
        total += sum(losses) / len(losses) * len(index)
        count += len(index)
    out["loss"] = total / count
    return out


@torch.no_grad()
def motion_check(model: VideoFlowModel, tokenizer, cfg: RecipeConfig, out_dir: Path | None = None) -> dict[str, float]:
    """Sample `eval.motion_samples` clips of moving-shapes prompts and track their objects."""
    e, d = cfg.eval, cfg.data
    prompts = motion_prompts(e.motion_samples, seed=e.seed)
    videos = []
    for start in range(0, len(prompts), 16):
        chunk = prompts[start:start + 16]
        ids = tokenize(tokenizer, [p for p, _, _ in chunk])
        shape = (len(chunk), 3, d.shapes_frames, d.shapes_size, d.shapes_size)
        videos += list(euler_sample(model, ids, shape, e.sample_steps, e.guidance_scale,
                                    torch.Generator().manual_seed(e.seed + start)).clamp(-1, 1))
    score = motion_score(videos, [c for _, c, _ in prompts], [dd for _, _, dd in prompts])
    if out_dir is not None:
        grid = torch.cat([torch.cat(videos[r * 4:(r + 1) * 4], dim=3) for r in range(min(2, len(videos) // 4))], dim=2)
        save_gif(grid, out_dir / "motion_samples.gif", fps=4, scale=6)
        (out_dir / "motion_prompts.txt").write_text("\n".join(p for p, _, _ in prompts[:8]) + "\n")
    return score


def make_eval_fn(cfg: RecipeConfig, tokenizer, held: BucketedClips, output_dir: Path):
    def eval_fn(model: VideoFlowModel, step: int) -> dict[str, float]:
        metrics = heldout_flow_loss(model, held, cfg.eval.timesteps, cfg.eval.max_clips, cfg.eval.seed)
        if cfg.eval.motion_samples and step == cfg.train.max_steps and is_main_process():
            metrics.update(direction_gap(model, tokenizer, cfg.data.shapes_frames, cfg.data.shapes_size))
            metrics.update(motion_check(model, tokenizer, cfg, output_dir / "eval"))
        return metrics
    return eval_fn


def setup_sequence_parallel(cfg: RecipeConfig, model: VideoFlowModel) -> None:
    sp = cfg.parallel.sp_size
    if sp == 1:
        return
    world = dist.get_world_size()
    if sp != world:
        raise ConfigError(f"config 'parallel.sp_size'={sp}: sequence parallelism here spans all ranks; launch "
                          f"{sp} ranks (now {world}) or set parallel.sp_size=1")
    model.sp_group = dist.group.WORLD
    log.info(f"Ulysses sequence parallelism over {sp} ranks: each rank computes 1/{sp} of every clip's tokens")


def train(cfg: RecipeConfig):
    from phalanx.checkpoint.hf import load_hf_state_dict
    from phalanx.train import fit

    from phalanx.data.buckets import unwrap_single

    model, tokenizer, batches, held = prepare(cfg)
    setup_sequence_parallel(cfg, model)
    if cfg.train.micro_batch_size != 1:
        raise ConfigError(f"config 'train.micro_batch_size'={cfg.train.micro_batch_size}: batches come whole from "
                          "the buckets (data.buckets sets each bucket's batch size); set train.micro_batch_size=1")
    output_dir = Path(cfg.train.output_dir)
    initial = heldout_flow_loss(model.eval(), held, cfg.eval.timesteps, cfg.eval.max_clips, cfg.eval.seed)
    model.train()
    log.info("held-out flow loss before training: " + ", ".join(f"{k}={v:.4f}" for k, v in initial.items()))
    result = fit(cfg.train, model, batches, collate_fn=unwrap_single, loss_fn=lambda m, b: m(**b),
                 eval_fn=make_eval_fn(cfg, tokenizer, held, output_dir), tokenizer=None)
    if is_main_process():
        model.sp_group = None
        model.load_state_dict(load_hf_state_dict(result.checkpoint_dir / "model"), strict=True)
        d = cfg.data
        meta = make_meta(cfg.flow, 3, d.shapes_frames, d.shapes_size, d.shapes_size)
        VideoPipeline(model, tokenizer, meta).save_pretrained(cfg.final_path)
        summary = {"initial": initial, "final": result.last_eval,
                   "loss_drop": 1 - result.last_eval["loss"] / initial["loss"], "steps": result.final_step,
                   "wall_time_s": result.wall_time_s, "pipeline": str(cfg.final_path)}
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info(f"exported {cfg.final_path}; held-out loss {initial['loss']:.4f} -> {result.last_eval['loss']:.4f} "
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
