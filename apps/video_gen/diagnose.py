"""Why does a trained pipeline miss the prompted direction? Three cheap checks, in the order of issue 16:

1. do sampled clips move at all (centroid travel in pixels between the first and last quarter)?
2. which way do they move, per prompted direction (confusion counts), at several guidance scales?
3. does the prompt reach the model where the direction is decided: at t close to 1, the predicted
   clean clip x_t - t v for "... moving left" vs "... moving right" (column of the brightness
   centroid in the first and the last frame; 'left' should start right of where it ends).

    python -m apps.video_gen.diagnose runs/video_tiny/pipeline --samples 64 --guidance 1 2 4 --split held_out trained

`--split held_out` samples the caption combinations `data.held_out_combos` kept out of training.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from phalanx.device import current_device, to_device

from .motion import motion_prompts, track, wilson_interval
from .pipeline import VideoPipeline, sample_clips, sample_shape
from .shapes import DIRECTIONS
from .text import tokenize


@torch.no_grad()
def sample_motion(pipe: VideoPipeline, samples: int, guidance: float, steps: int = 24, seed: int = 0,
                  split: str = "all") -> dict:
    """Motion-check prompts of `split` ("all", "held_out", "trained"; motion.py) sampled at `guidance`: travel
    statistics, confusion counts, scores with the 95% Wilson interval of `both`."""
    m = pipe.meta
    prompts = motion_prompts(samples, seed=seed, split=split)
    confusion = {d: {g: 0 for g in [*DIRECTIONS, "none"]} for d in DIRECTIONS}
    travels, colour_ok, dir_ok, both_ok = [], 0, 0, 0
    for start in range(0, samples, 16):
        chunk = prompts[start:start + 16]
        ids = tokenize(pipe.tokenizer, [p for p, _, _ in chunk])
        clips = sample_clips(pipe.model, ids, m["frames"], m["height"], m["width"], steps, guidance,
                             torch.Generator().manual_seed(seed + start), pipe.vae, m.get("sampler", "linear"))
        for clip, (_, colour, direction) in zip(clips.cpu(), chunk):
            got_c, got_d, travel = track(clip)
            moved = got_d if got_d is not None and travel >= 1.0 else "none"
            confusion[direction][moved] += 1
            travels.append(travel)
            colour_ok += got_c == colour
            dir_ok += moved == direction
            both_ok += got_c == colour and moved == direction
    return {"split": split, "guidance": guidance, "both_95": [round(x, 3) for x in wilson_interval(both_ok, samples)],
            "travel_median_px": statistics.median(travels),
            "moved_share": sum(t >= 1.0 for t in travels) / samples, "colour": colour_ok / samples,
            "direction": dir_ok / samples, "both": both_ok / samples, "confusion": confusion}


@torch.no_grad()
def high_noise_prediction(pipe: VideoPipeline, t: float = 0.97, draws: int = 32, seed: int = 0) -> dict:
    """Column of the brightness centroid of the predicted clean clip in the first and the last frame,
    for each direction word (red square); flat predictions give the centre column for every word. In
    latent space the predicted latent is decoded first."""
    model, m = pipe.model, pipe.meta
    shape = sample_shape(draws, m["channels"], m["frames"], m["height"], m["width"], pipe.vae)
    device = model.device
    noise = to_device(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), device)
    tt = torch.full((draws,), t, device=device)
    out = {}
    for direction in DIRECTIONS:
        ids = to_device(tokenize(pipe.tokenizer, [f"a red square moving {direction}"] * draws), device)
        v = model.velocity(noise, tt, model.encode_prompts(ids))
        x0 = (noise - t * v).mean(0)                     # [C, F, H, W], averaged over noise draws
        if pipe.vae is not None:
            from .vae import decode_latents
            x0 = decode_latents(pipe.vae, x0[None])[0]
        bright = x0.float().cpu().max(0).values          # [F, H, W], on the host for the centroids
        w = (bright - bright.min()).clamp_min(1e-6)
        cols = torch.arange(m["width"], dtype=torch.float32)
        rows = torch.arange(m["height"], dtype=torch.float32)
        def centroid(f: int) -> tuple[float, float]:
            return float((w[f].sum(0) * cols).sum() / w[f].sum()), float((w[f].sum(1) * rows).sum() / w[f].sum())

        (c0, r0), (c1, r1) = centroid(0), centroid(-1)
        out[direction] = {"first_col_row": [round(c0, 2), round(r0, 2)], "last_col_row": [round(c1, 2), round(r1, 2)],
                          "spread": round(float(bright.std()), 4)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pipeline")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--guidance", type=float, nargs="+", default=[2.0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--split", nargs="+", default=["all"], choices=["all", "held_out", "trained"],
                   help="prompt sets: held_out = shapes.HELD_OUT_COMBOS (kept out of training by data.held_out_combos)")
    args = p.parse_args(argv)
    pipe = VideoPipeline.from_pretrained(args.pipeline).to(current_device())
    print(json.dumps({"high_noise_prediction_t0.97": high_noise_prediction(pipe)}))
    for split in args.split:
        for g in args.guidance:
            print(json.dumps(sample_motion(pipe, args.samples, g, args.steps, split=split)))


if __name__ == "__main__":
    main()
