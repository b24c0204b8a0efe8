"""train_vae: the causal 3D autoencoder trains through fit (2 steps), reports held-out PSNR, saves
a diffusers directory that reloads; PSNR by hand; buckets the causal VAE cannot take are refused."""
from __future__ import annotations

import json
import math

import pytest
import torch

from video_tiny import tiny_config

VAE = ["data.shapes_frames=9", "data.clip_frames=9", "data.buckets=[[1,16,16,8],[9,16,16,4],[9,16,28,2]]",
       "vae.base_dim=8", "vae.z_dim=4", "train.max_steps=2", "train.lr=2e-3"]


def test_train_vae_saves_a_reloadable_autoencoder(tmp_path):
    from diffusers import AutoencoderKLWan

    from apps.video_gen.train_vae import train_vae
    from apps.video_gen.vae import psnr

    cfg = tiny_config(tmp_path, *VAE)
    result = train_vae(cfg)
    summary = json.loads((tmp_path / "vae_summary.json").read_text())
    assert result.final_step == 2 and math.isfinite(summary["final"]["psnr"])
    assert set(summary["final"]) >= {"psnr/9x16x16", "psnr/1x16x16"}
    vae = AutoencoderKLWan.from_pretrained(str(tmp_path / "vae")).eval()
    clip = torch.rand(1, 3, 9, 16, 16) * 2 - 1
    z = vae.encode(clip).latent_dist.mode()
    assert z.shape == (1, 4, 5, 8, 8)  # causal: 1 + 8/2 latent frames, 2x spatial
    # PSNR by hand: an autoencoder whose reconstruction is off by 0.2 everywhere (0.1 in [0, 1] units) -> 20 dB
    shifted = type("Shift", (), {"encode": lambda self, x: type("E", (), {"latent_dist": type("D", (), {
        "mode": lambda s: x})()})(), "decode": lambda self, z: type("O", (), {"sample": z + 0.2})()})()
    assert abs(psnr(shifted, torch.zeros(2, 3, 1, 4, 4)) - 20.0) < 1e-4


def test_buckets_the_causal_vae_cannot_take(tmp_path):
    from phalanx.config import ConfigError

    from apps.video_gen.train_vae import train_vae

    cfg = tiny_config(tmp_path, *VAE[3:], "data.buckets=[[8,16,16,4]]")
    with pytest.raises(ConfigError, match=r"1 \+ k x 2 frames"):
        train_vae(cfg)
