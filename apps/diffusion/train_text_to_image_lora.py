"""Text-to-image LoRA: `train_text_to_image` with `lora.rank` on (default 4 when the config leaves it
at 0), as diffusers' train_text_to_image_lora.py does. The base pipeline stays as it is; the adapters
are written to `<output_dir>/lora/pytorch_lora_weights.safetensors`, which plain diffusers opens:

    python -m apps.diffusion.train_text_to_image_lora --config apps/diffusion/configs/sd15_text_to_image_lora.yaml
    python -m apps.diffusion.train_text_to_image_lora --config apps/diffusion/configs/tiny_emoji.yaml \\
        model.init_from=runs/diffusion/tiny_emoji/pipeline train.output_dir=runs/diffusion/tiny_emoji_lora
    pipe = StableDiffusionPipeline.from_pretrained(base); pipe.load_lora_weights("<output_dir>/lora")
"""
from __future__ import annotations

from phalanx.observe import is_main_process

from .config import RecipeConfig
from .recipe import run_script
from .train_text_to_image import train

DEFAULT_RANK = 4


def lora_on(cfg: RecipeConfig) -> None:
    """`lora.rank` = DEFAULT_RANK when the config left LoRA off; LoRA needs a base model to adapt."""
    if not (cfg.model.pretrained_dir or cfg.model.init_from):
        raise ValueError("text-to-image LoRA adapts an existing pipeline: set model.pretrained_dir (a diffusers "
                         "Stable Diffusion directory) or model.init_from (e.g. runs/diffusion/tiny_emoji/pipeline)")
    if cfg.lora.rank == 0:
        cfg.lora.rank = DEFAULT_RANK
        if is_main_process():
            print(f"lora.rank not set: training rank-{DEFAULT_RANK} adapters")


def main(argv: list[str] | None = None) -> None:
    run_script("Text-to-image LoRA training on a Stable Diffusion pipeline.", train, argv, adjust=lora_on)


if __name__ == "__main__":
    main()
