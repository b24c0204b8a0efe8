"""Tiny diffusion components (a 2-level UNet on 8x8 latents, a 1-layer text encoder) and one
trained-for-2-steps pipeline shared by the tests of this folder; a tiny random Stable Diffusion
directory in the real diffusers layout."""
from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_tiny import build_tiny_sd_pipeline, tiny_config


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a shared 2-core machine a second thread
    per op mostly waits (the app README measured steps 8x slower that way)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def sd_pipeline_dir(tmp_path_factory) -> Path:
    """A random tiny Stable Diffusion 1.x directory (UNet2DConditionModel, AutoencoderKL,
    CLIPTextModel, CLIP tokenizer, PNDM), as `save_pretrained` lays it out."""
    return build_tiny_sd_pipeline(tmp_path_factory.mktemp("sd_layout"))


@pytest.fixture(scope="session")
def sdxl_pipeline_dir(tmp_path_factory) -> Path:
    """A random tiny SDXL directory (two CLIP encoders, a size / crop-conditioned UNet), as
    `StableDiffusionXLPipeline.save_pretrained` lays it out."""
    from diffusion_tiny import build_tiny_sdxl_pipeline

    return build_tiny_sdxl_pipeline(tmp_path_factory.mktemp("sdxl_layout"))
