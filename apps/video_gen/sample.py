"""Sample clips from an exported pipeline and write MP4 and GIF files.

    python -m apps.video_gen.sample "a red square moving left" "a blue circle moving up" \
        --pipeline runs/video_tiny/pipeline --out runs/video_tiny/samples --seed 0
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from phalanx.device import current_device
from phalanx.diffusion import save_gif, save_video

from .pipeline import VideoPipeline


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60] or "empty"


def sample(pipeline_dir: str | Path, prompts: list[str], out_dir: str | Path, *, seed: int = 0, steps: int = 24,
           guidance: float = 2.0, frames: int | None = None, fps: int = 4, scale: int = 8) -> list[Path]:
    pipe = VideoPipeline.from_pretrained(pipeline_dir).to(current_device())
    clips = pipe(prompts, seed=seed, steps=steps, guidance=guidance, frames=frames).cpu()  # one copy to the host
    out_dir = Path(out_dir)
    written = []
    for k, (prompt, clip) in enumerate(zip(prompts, clips)):
        stem = out_dir / f"{k:02d}_{slug(prompt)}"
        written += [save_video(clip, stem.with_suffix(".mp4"), fps=fps, scale=scale),
                    save_gif(clip, stem.with_suffix(".gif"), fps=fps, scale=scale)]
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Sample text-to-video clips from a video_gen pipeline directory")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--pipeline", default="runs/video_tiny/pipeline")
    p.add_argument("--out", default="runs/video_tiny/samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--guidance", type=float, default=2.0)
    p.add_argument("--frames", type=int, default=None, help="frames (default: the training clip length)")
    p.add_argument("--fps", type=int, default=4)
    p.add_argument("--scale", type=int, default=8, help="nearest-neighbour upscaling of the written files")
    args = p.parse_args(argv)
    for path in sample(args.pipeline, args.prompts, args.out, seed=args.seed, steps=args.steps,
                       guidance=args.guidance, frames=args.frames, fps=args.fps, scale=args.scale):
        print(path)


if __name__ == "__main__":
    main()
