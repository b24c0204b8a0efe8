"""The tiny video recipe the tests use (importable by spawned ranks too)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "apps" / "video_gen" / "configs" / "tiny.yaml"
TINY_DATA = ["data.shapes_videos=24", "data.shapes_images=16", "data.clips_per_video=2",
             "data.buckets=[[1,16,16,8],[8,16,16,4],[8,16,28,2]]"]
TINY_MODEL = ["model.num_layers=2", "model.num_heads=2", "model.head_dim=8", "model.ffn_dim=32",
              "model.freq_dim=16", "model.text_hidden_size=32", "model.text_layers=1", "model.text_heads=2"]
TINY_RUN = ["train.max_steps=3", "train.save_every=0", "train.log_every=1", "train.warmup_steps=0",
            "train.progress_bar=false", "train.plot=false", "eval.motion_samples=0", "eval.max_clips=8"]


def tiny_config(output_dir, *overrides: str):
    from apps.video_gen.config import load_recipe

    return load_recipe(TINY, [*TINY_DATA, *TINY_MODEL, *TINY_RUN, f"train.output_dir={output_dir}", *overrides])
