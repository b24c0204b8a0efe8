"""The tiny diffusion recipe used by these tests (importable by spawned ranks too)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "apps" / "diffusion" / "configs" / "tiny_emoji.yaml"
DREAMBOOTH = REPO / "apps" / "diffusion" / "configs" / "dreambooth_tiny.yaml"

TINY_MODEL = ["model.unet_channels=[32,32]", "model.unet_norm_groups=8", "model.unet_attention_head_dim=8",
              "model.text_hidden_size=32", "model.text_layers=1", "model.text_heads=2", "data.resolution=64"]
TINY_RUN = ["data.max_images=8", "train.micro_batch_size=4", "train.log_every=1", "train.progress_bar=false",
            "train.plot=false", "train.save_every=0", "train.warmup_steps=0",
            "validation.num_inference_steps=2", "validation.prompts=[dog face,red apple]"]


def tiny_config(output_dir: Path, *overrides: str, config: Path = TINY):
    from apps.diffusion.config import load_recipe

    return load_recipe(config, [*TINY_MODEL, *TINY_RUN, f"train.output_dir={output_dir}", *overrides])
