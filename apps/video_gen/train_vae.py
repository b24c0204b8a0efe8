"""Train the causal 3D video autoencoder (AutoencoderKLWan, tiny) on the recipe's clips.

    python -m apps.video_gen.train_vae --config apps/video_gen/configs/vae_tiny.yaml

L1 + L2 (non-black pixels weighted 10x) + KL (+ temporal smoothness) on the unclamped decoder
output (see vae.py) through `phalanx.train.fit`; the eval is the held-out PSNR, logged next to two
content-blind baselines (all black: what a dead autoencoder scores; each clip's mean colour).
Rank 0 saves the autoencoder as a diffusers directory (<output_dir>/vae), which
`AutoencoderKLWan.from_pretrained`, `vae.pretrained_dir` or `vae.from_dir` (latent training in
`apps.video_gen.train`) opens; its config carries latents_mean / latents_std measured on the
training clips (the normalisation diffusers' Wan pipelines apply).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from phalanx.config import ConfigError
from phalanx.device import to_device
from phalanx.observe import get_logger, is_main_process

from .config import RecipeConfig, parse_args
from .data import BucketedClips, load_all_clips, training_batches
from .text import build_tokenizer
from .vae import VAETrainModel, baseline_psnr, build_vae, frames_ok, measure_latent_stats, psnr, vae_factors

log = get_logger("apps.video_gen")


def train_vae(cfg: RecipeConfig):
    from phalanx.checkpoint.hf import load_hf_state_dict
    from phalanx.data.buckets import unwrap_single
    from phalanx.train import fit

    vae = build_vae(cfg.vae)
    factor = vae_factors(vae)[0]
    bad = [b.shape for b in cfg.buckets if not frames_ok(b.frames, factor)]
    if bad:
        raise ConfigError(f"config 'data.buckets': buckets {bad} do not have 1 + k x {factor} frames, which the "
                          f"causal autoencoder needs (e.g. {', '.join(str(1 + k * factor) for k in range(3))})")
    train_clips, held_clips = load_all_clips(cfg.data)
    tokenizer = build_tokenizer([c.caption for c in train_clips], cfg.data.max_prompt_tokens)  # batches carry ids
    train = BucketedClips(train_clips, cfg.buckets, tokenizer)
    held = BucketedClips(held_clips, cfg.buckets, tokenizer)
    held_videos = {b: torch.stack([held[i]["video"] for i in idx[:cfg.vae.held_out_clips]])
                   for b, idx in held.per_bucket().items()}
    model = VAETrainModel(vae, cfg.vae).train()

    def eval_fn(m: VAETrainModel, step: int) -> dict[str, float]:
        scores = {f"psnr/{b.frames}x{b.height}x{b.width}": psnr(m.vae, to_device(v, m.vae.device).to(m.vae.dtype))
                  for b, v in held_videos.items()}
        return {"psnr": sum(scores.values()) / len(scores), **scores}

    per_bucket = {b: baseline_psnr(v) for b, v in held_videos.items()}
    baselines = {k: sum(p[k] for p in per_bucket.values()) / len(per_bucket) for k in ("black", "clip_mean")}
    log.info(f"held-out PSNR baselines: all black {baselines['black']:.2f} dB, each clip's mean colour "
             f"{baselines['clip_mean']:.2f} dB")
    initial = eval_fn(model, 0)
    result = fit(cfg.train, model, training_batches(train, cfg.train.seed), collate_fn=unwrap_single,
                 loss_fn=lambda m, b: m(b["video"]), eval_fn=eval_fn)
    out = Path(cfg.train.output_dir) / "vae"
    if is_main_process():
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model.float()  # only when the plugin computed in bf16/fp16 (a no-op cast of device weights the plugin
            # still references is refused under PHALANX_EMULATE_GPU: "Couldn't swap")
        model.load_state_dict(load_hf_state_dict(result.checkpoint_dir / "model"), strict=True)
        vae.eval()
        mean, std = measure_latent_stats(vae, [to_device(torch.stack([train[i]["video"] for i in idx[:64]]), vae.device)
                                               for idx in train.per_bucket().values()])
        vae.register_to_config(latents_mean=mean, latents_std=std)
        vae.save_pretrained(str(out))
        summary = {"initial": initial, "final": result.last_eval, "baselines": baselines, "steps": result.final_step,
                   "vae": str(out), "latents_mean": mean, "latents_std": std}
        (Path(cfg.train.output_dir) / "vae_summary.json").write_text(json.dumps(summary, indent=2))
        log.info(f"saved {out}; held-out PSNR {initial['psnr']:.2f} -> {result.last_eval['psnr']:.2f} dB (all black: "
                 f"{baselines['black']:.2f}, clip mean colour: {baselines['clip_mean']:.2f})")
    return result


def main(argv: list[str] | None = None) -> None:
    from phalanx.launch import launched

    cfg = parse_args("Train the causal 3D video autoencoder", argv)
    with launched(seed=cfg.train.seed):
        result = train_vae(cfg)
        if is_main_process():
            print(f"done at step {result.final_step}: eval {result.last_eval}")


if __name__ == "__main__":
    main()
