"""Tiny diffusion components (a 2-level UNet on 8x8 latents, a 1-layer text encoder) and one
trained-for-2-steps pipeline shared by the tests of this folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_tiny import tiny_config


@pytest.fixture(scope="session")
def make_config():
    return tiny_config


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory) -> Path:
    """train_text_to_image for 2 steps on 8 emoji; returns the saved pipeline directory."""
    from apps.diffusion.train_text_to_image import train

    out = tmp_path_factory.mktemp("tiny_emoji")
    cfg = tiny_config(out, "train.max_steps=2")
    result, pipeline = train(cfg)
    assert result.final_step == 2 and pipeline is not None
    return pipeline
