"""Latent training (`vae.from_dir`): the transformer trains on the cached, normalised latents of a
frozen causal 3D autoencoder (a tiny AutoencoderKLWan built here and saved to tmp_path), the
exported pipeline carries vae/ and reproduces a sample bit for bit; frame counts the autoencoder
cannot take stop with a ConfigError before any work."""
from __future__ import annotations

import json

import pytest
import torch

from video_tiny import tiny_config

LATENT = ["data.shapes_frames=9", "data.clip_frames=9", "data.buckets=[[1,16,16,8],[9,16,16,4],[9,16,28,2]]",
          "model.patch_size=[1,2,2]"]


def _tiny_vae(directory, z_dim: int = 4):
    """A random tiny AutoencoderKLWan (2x temporal, 2x spatial) with latent stats measured on moving shapes."""
    from apps.video_gen.config import VAEConfig
    from apps.video_gen.shapes import moving_shapes
    from apps.video_gen.vae import build_vae, measure_latent_stats

    torch.manual_seed(0)
    vae = build_vae(VAEConfig(base_dim=8, z_dim=z_dim)).eval()
    videos = torch.stack([c.video for c in moving_shapes(4, 9, 16, seed=5)])
    mean, std = measure_latent_stats(vae, [videos])
    vae.register_to_config(latents_mean=mean, latents_std=std)
    vae.save_pretrained(str(directory))
    return vae, videos


def test_latents_are_normalised_with_the_configs_stats_and_decode_back(tmp_path):
    from diffusers import AutoencoderKLWan

    from apps.video_gen.vae import decode_latents, encode_latents, vae_factors

    _, videos = _tiny_vae(tmp_path / "vae")
    vae = AutoencoderKLWan.from_pretrained(str(tmp_path / "vae")).eval()
    assert vae_factors(vae) == (2, 2)
    z, std = encode_latents(vae, videos)
    assert z.shape == std.shape == (4, 4, 5, 8, 8)
    per_channel = z.transpose(0, 1).flatten(1)
    assert per_channel.mean(1).abs().max() < 1e-4 and (per_channel.std(1) - 1).abs().max() < 1e-3
    raw = vae.encode(videos).latent_dist.mean
    mean = torch.tensor(vae.config["latents_mean"]).view(1, -1, 1, 1, 1)
    scale = torch.tensor(vae.config["latents_std"]).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(z, (raw - mean) / scale)
    torch.testing.assert_close(decode_latents(vae, z), vae.decode(raw).sample, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_latent_training_encodes_once_and_the_pipeline_with_vae_reproduces(tmp_path, monkeypatch):
    """3 steps on latents: batches are [B, 4, 5, 8, 8] latents encoded before fit (no encode during
    fit), the held-out loss is the latent one, and the exported pipeline (vae/ inside) reloads and
    gives the same decoded clip for a seed, bit for bit."""
    import phalanx.train
    from diffusers import AutoencoderKLWan

    from apps.video_gen.pipeline import VideoPipeline
    from apps.video_gen.sample import sample
    from apps.video_gen.train import prepare, train

    _tiny_vae(tmp_path / "vae")
    cfg = tiny_config(tmp_path / "run", *LATENT, f"vae.from_dir={tmp_path / 'vae'}")

    model, _, batches, held, vae = prepare(cfg)
    assert model.transformer.config.out_channels == 4 and vae.config["z_dim"] == 4
    assert not any(p.requires_grad for p in vae.parameters())
    shapes = {tuple(batches[k]["video"].shape[1:]) for k in range(len(batches))}
    assert shapes == {(4, 5, 8, 8), (4, 1, 8, 8), (4, 5, 8, 14)}, shapes

    calls, phase, fit = [], ["prepare"], phalanx.train.fit
    encode = AutoencoderKLWan.encode

    def counting_encode(self, *args, **kwargs):
        calls.append(phase[0])
        return encode(self, *args, **kwargs)

    def fit_phase(*args, **kwargs):
        phase[0] = "fit"
        try:
            return fit(*args, **kwargs)
        finally:
            phase[0] = "export"

    monkeypatch.setattr(AutoencoderKLWan, "encode", counting_encode)
    monkeypatch.setattr(phalanx.train, "fit", fit_phase)
    result = train(cfg)
    assert result.final_step == 3 and "prepare" in calls and "fit" not in calls, calls
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["space"] == "latent space" and set(summary["final"]) >= {"loss/9x16x16", "loss/1x16x16"}

    pipe_dir = cfg.final_path
    assert (pipe_dir / "vae" / "config.json").is_file()
    assert json.loads((pipe_dir / "model_index.json").read_text())["vae"] == ["diffusers", "AutoencoderKLWan"]
    a = VideoPipeline.from_pretrained(pipe_dir)(["a red square moving left"], seed=3, steps=3)
    b = VideoPipeline.from_pretrained(pipe_dir)(["a red square moving left"], seed=3, steps=3)
    c = VideoPipeline.from_pretrained(pipe_dir)(["a red square moving left"], seed=4, steps=3)
    assert a.shape == (1, 3, 9, 16, 16) and torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max() <= 1.0
    files = sample(pipe_dir, ["a blue circle moving up"], tmp_path / "samples", steps=2, scale=2)
    assert sorted(p.suffix for p in files) == [".gif", ".mp4"]


def test_posterior_sampling_keeps_the_std_and_draws_each_step(tmp_path):
    """vae.sample_posterior: the cached batch carries the posterior std, and each step's loss is the
    loss of mean + std x a fresh normal draw."""
    from apps.video_gen.train import batch_loss, prepare

    _tiny_vae(tmp_path / "vae")
    cfg = tiny_config(tmp_path / "run", *LATENT, f"vae.from_dir={tmp_path / 'vae'}", "vae.sample_posterior=true",
                      "data.clips_dir=null", "data.buckets=[[1,16,16,8],[9,16,16,4]]")
    model, _, batches, _, _ = prepare(cfg)
    batch = batches[0]
    assert batch["latent_std"].shape == batch["video"].shape and float(batch["latent_std"].min()) > 0
    torch.manual_seed(7)
    got = batch_loss(model, batch)
    torch.manual_seed(7)
    draw = batch["video"] + batch["latent_std"] * torch.randn_like(batch["latent_std"])
    assert torch.equal(got, model(draw, batch["prompt_ids"]))
    torch.manual_seed(7)
    assert not torch.equal(got, model(batch["video"], batch["prompt_ids"]))


def test_frame_counts_and_directories_the_autoencoder_cannot_take(tmp_path):
    from phalanx.config import ConfigError

    from apps.video_gen.train import prepare

    _tiny_vae(tmp_path / "vae")
    vae = f"vae.from_dir={tmp_path / 'vae'}"
    with pytest.raises(ConfigError, match=r"data.buckets.*\[8\] frames.*1 \+ k x 2 frames \(e.g. 1, 3, 5, 7\)"):
        prepare(tiny_config(tmp_path / "run", *LATENT, vae, "data.buckets=[[1,16,16,8],[8,16,16,4]]"))
    with pytest.raises(ConfigError, match=r"bucket \(9, 16, 28\) gives \(5, 8, 14\) latents.*model.patch_size"):
        prepare(tiny_config(tmp_path / "run", *LATENT, vae, "model.patch_size=[1,4,4]"))
    with pytest.raises(ConfigError, match=r"'vae.from_dir'.*holds no config.json.*train_vae"):
        prepare(tiny_config(tmp_path / "run", *LATENT, f"vae.from_dir={tmp_path / 'nothing'}"))
