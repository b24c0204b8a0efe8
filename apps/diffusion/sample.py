"""Generate images from a trained pipeline into PNG files.

    python -m apps.diffusion.sample --pipeline runs/diffusion/tiny_emoji/pipeline --prompt "dog face" --prompt "red apple"
    python -m apps.diffusion.sample --pipeline runs/diffusion/tiny_emoji/pipeline --lora runs/diffusion/dreambooth_tiny/lora \
        --prompt "sks cat face" --scheduler ddim --steps 50 --guidance 5 --seed 1 --out samples/

One PNG per prompt and image (`<out>/<index>-<prompt>.png`) and a grid of all of them (`grid.png`).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from phalanx.device import current_device
from phalanx.diffusion import save_grid

from .components import SCHEDULERS, make_scheduler, open_pipeline


def sample(pipeline_dir: str | Path, prompts: list[str], out_dir: str | Path, *, lora: str | Path | None = None,
           scheduler: str = "dpm", steps: int = 25, guidance: float = 3.0, seed: int = 0, per_prompt: int = 1,
           size: int | None = None) -> list[Path]:
    pipe = open_pipeline(pipeline_dir).to(current_device())
    pipe.set_progress_bar_config(disable=True)
    if lora:
        lora = Path(lora)
        if not lora.exists():
            raise FileNotFoundError(f"LoRA weights {lora} not found: pass the folder train_dreambooth wrote (<output_dir>/lora)")
        pipe.load_lora_weights(str(lora))
    pipe.scheduler = make_scheduler(scheduler, pipe.scheduler)
    size = size or pipe.unet.config.sample_size * pipe.vae_scale_factor
    generator = torch.Generator("cpu").manual_seed(seed)
    images = pipe(prompts, num_images_per_prompt=per_prompt, num_inference_steps=steps, guidance_scale=guidance,
                  generator=generator, height=size, width=size).images
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [p for p in prompts for _ in range(per_prompt)]
    paths = []
    for i, (image, prompt) in enumerate(zip(images, labels)):
        path = out_dir / f"{i:03d}-{re.sub(r'[^a-z0-9]+', '_', prompt.lower()).strip('_')[:40]}.png"
        image.save(path)
        paths.append(path)
    save_grid(images, labels, out_dir / "grid.png")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate images from a saved Stable Diffusion pipeline.")
    parser.add_argument("--pipeline", required=True, help="a diffusers pipeline directory (e.g. <output_dir>/pipeline)")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--lora", default=None, help="a folder with pytorch_lora_weights.safetensors")
    parser.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="dpm", help="dpm: DPM-Solver++; ddim; ddpm")
    parser.add_argument("--steps", type=int, default=25, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-prompt", type=int, default=1, help="images per prompt")
    parser.add_argument("--size", type=int, default=None, help="pixels (default: the UNet's training size)")
    parser.add_argument("--out", default="samples", help="output folder")
    args = parser.parse_args(argv)
    paths = sample(args.pipeline, args.prompt, args.out, lora=args.lora, scheduler=args.scheduler, steps=args.steps,
                   guidance=args.guidance, seed=args.seed, per_prompt=args.per_prompt, size=args.size)
    print(f"wrote {len(paths)} images and grid.png to {args.out}")


if __name__ == "__main__":
    main()
