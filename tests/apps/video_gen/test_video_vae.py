"""train_vae: the causal 3D autoencoder trains through fit (2 steps), reports held-out PSNR, saves
a diffusers directory that reloads; PSNR by hand; buckets the causal VAE cannot take are refused;
the training loss sees the decoder output before diffusers' clamp, and a few steps of it learn the
shapes (the session-7 autoencoder decoded everything to black); the loss weights the non-black pixels,
which brings the shapes back sooner than the plain mean (session 8's autoencoder stopped at a blur)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from video_tiny import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")  # (root conftest.py; docs/testing.md, "Suite time")


STEPS = 60
WEIGHT_STEPS = 60
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


def test_decode_unclamped_is_decode_before_the_clamp():
    """diffusers clamps the decoded clip to [-1, 1]; a decoder pushed below -1 everywhere (what the dead
    autoencoder of session 7 did on the mostly black clips) gives a clamped output with no gradient at all,
    while decode_unclamped gives the same clip before the clamp, with a gradient (batched and sliced)."""
    from apps.video_gen.config import VAEConfig
    from apps.video_gen.vae import build_vae, decode_unclamped

    torch.manual_seed(0)
    vae = build_vae(VAEConfig(base_dim=8, z_dim=4))
    with torch.no_grad():
        vae.decoder.conv_out.bias.fill_(-50.0)
    z = torch.randn(2, 4, 5, 8, 8)
    raw = decode_unclamped(vae, z)
    assert raw.shape == (2, 3, 9, 16, 16) and raw.max() < -1
    assert torch.equal(raw.clamp(-1, 1), vae.decode(z).sample)
    target = torch.zeros_like(raw)
    (vae.decode(z).sample - target).abs().mean().backward()
    assert vae.decoder.conv_out.bias.grad.abs().max() == 0  # the clamp blocks every gradient
    vae.zero_grad()
    (decode_unclamped(vae, z) - target).abs().mean().backward()
    # d mean|raw| / d bias_c = -1/3 with every raw value < 0 (a third of the elements per channel)
    torch.testing.assert_close(vae.decoder.conv_out.bias.grad, torch.full((3,), -1 / 3))
    vae.enable_slicing()
    torch.testing.assert_close(decode_unclamped(vae, z), raw, atol=1e-5, rtol=1e-5)


def test_a_few_training_steps_keep_the_decoder_alive():
    """The objective itself: Adam steps of VAETrainModel on moving-shapes clips lower the loss and keep
    a gradient, and the decoded clips are not the constant -1 of session 7's autoencoder (whose decoder
    fell below -1 everywhere within ~15 steps, where diffusers' clamp passes no gradient). The shapes
    coming back is the foreground-weight test's claim below."""
    from apps.video_gen.config import VAEConfig
    from apps.video_gen.shapes import moving_shapes
    from apps.video_gen.vae import VAETrainModel, build_vae

    torch.manual_seed(0)
    vcfg = VAEConfig(base_dim=8, z_dim=4)
    model = VAETrainModel(build_vae(vcfg), vcfg).train()
    clips = torch.stack([c.video for c in moving_shapes(4, 9, 16, seed=3)])
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        loss = model(clips)
        opt.zero_grad()
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        losses.append(loss.item())
    vae = model.vae.eval()
    with torch.no_grad():
        recon = vae.decode(vae.encode(clips).latent_dist.mode()).sample
    assert losses[-1] < 0.5 * losses[0], losses
    assert min(grad_norms[-10:]) > 0.05, grad_norms[-10:]
    assert recon.max() > -0.5 and recon.std() > 0.05, (recon.min(), recon.max(), recon.std())


def test_a_fresh_autoencoders_latents_depend_on_the_clip():
    """build_vae's init: with PyTorch's default conv init the tiny autoencoder's latents barely change
    from clip to clip (spread across clips ~5% of their size), so training first learns the average
    (black) clip; init_fresh keeps the clip in the latents."""
    from torch import nn

    from apps.video_gen.config import VAEConfig
    from apps.video_gen.shapes import moving_shapes
    from apps.video_gen.vae import build_vae

    clips = torch.stack([c.video for c in moving_shapes(8, 9, 16, seed=0)])
    torch.manual_seed(0)
    vae = build_vae(VAEConfig(base_dim=16, z_dim=4)).eval()
    convs = [m for m in vae.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    assert all(m.bias is None or not m.bias.any() for m in convs)
    with torch.no_grad():
        z = vae.encode(clips).latent_dist.mode()
    assert z.std(0).mean() > 0.3 * z.abs().mean()


def test_reconstruction_weights_by_hand():
    """1 on black pixels (every channel at -1), 1 + foreground_weight on any other; 0 turns weighting off."""
    from apps.video_gen.vae import reconstruction_weights

    video = torch.full((1, 3, 2, 2, 2), -1.0)
    video[0, 0, 1, 0, 1] = 1.0    # one red pixel in frame 1
    video[0, :, 0, 1, 1] = -0.5   # one grey pixel in frame 0
    w = reconstruction_weights(video, 9.0)
    expected = torch.ones(1, 1, 2, 2, 2)
    expected[0, 0, 1, 0, 1] = expected[0, 0, 0, 1, 1] = 10.0
    assert torch.equal(w, expected)
    assert reconstruction_weights(video, 0.0) == 1.0


def test_the_foreground_weight_brings_the_shapes_back_sooner():
    """90% of a shape image is black: with the plain mean loss (foreground_weight=0, session 8's objective)
    the tiny autoencoder's cheapest answer is a dark blur where the shape is; with the default weight the
    same init and the same Adam steps bring the shapes' colours back: a lower error on the shapes' pixels
    and a higher PSNR."""
    from apps.video_gen.config import VAEConfig
    from apps.video_gen.shapes import moving_shapes
    from apps.video_gen.vae import VAETrainModel, _psnr, build_vae

    images = torch.stack([c.video for c in moving_shapes(8, 1, 16, seed=3, moving=False)])
    shape = (images > -0.99).any(dim=1, keepdim=True).expand_as(images)

    def train(foreground_weight: float) -> tuple[float, float]:
        torch.manual_seed(0)
        vcfg = VAEConfig(base_dim=8, z_dim=4)
        model = VAETrainModel(build_vae(vcfg), vcfg, foreground_weight=foreground_weight).train()
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        for _ in range(WEIGHT_STEPS):
            loss = model(images)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        vae = model.vae.eval()
        with torch.no_grad():
            recon = vae.decode(vae.encode(images).latent_dist.mode()).sample
        return float((recon - images)[shape].abs().mean()), _psnr(recon, images)

    (old_err, old_psnr), (new_err, new_psnr) = train(0.0), train(VAEConfig().foreground_weight)
    assert new_err < 0.3 * old_err, (old_err, new_err)  # measured 0.66 -> 0.065 (PSNR 14.6 -> 16.8 dB)
    assert new_psnr > old_psnr + 1.0, (old_psnr, new_psnr)


def test_posterior_kl_sums_every_latent_dim_of_a_5d_posterior(monkeypatch):
    """KL(N(mu, sigma^2) || N(0, 1)) = 0.5 (mu^2 + sigma^2 - 1 - log sigma^2), summed per clip over channels,
    frames, rows and columns. diffusers' kl() sums dims [1, 2, 3] only ([B, W] on video latents), so its mean
    was 1/W of this; VAETrainModel's KL term is kl_weight x this / the clip's element count."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    from apps.video_gen.config import VAEConfig
    from apps.video_gen.vae import VAETrainModel, build_vae, posterior_kl

    # One posterior element differs from N(0, 1) per clip: mu = 2 (KL 2) in clip 0; sigma^2 = e (KL (e - 2)/2) in clip 1.
    mean, logvar = torch.zeros(2, 3, 2, 4, 5), torch.zeros(2, 3, 2, 4, 5)
    mean[0, 1, 1, 2, 3] = 2.0
    logvar[1, 0, 0, 3, 4] = 1.0
    posterior = DiagonalGaussianDistribution(torch.cat([mean, logvar], dim=1))
    expected = torch.tensor([2.0, 0.5 * (math.e - 2.0)])
    torch.testing.assert_close(posterior_kl(posterior), expected)
    assert posterior.kl().shape == (2, 5)  # what the loss used to average: a sum over C, F, H only
    torch.testing.assert_close(posterior.kl().mean() * 5, posterior_kl(posterior).mean())

    # The training loss's KL term, isolated: every other weight 0, a posterior mean of 1 everywhere.
    torch.manual_seed(0)
    vcfg = VAEConfig(base_dim=8, z_dim=4, l2_weight=0.0, temporal_weight=0.0, kl_weight=0.5, foreground_weight=0.0)
    model = VAETrainModel(build_vae(vcfg), vcfg)
    clip = torch.zeros(2, 3, 5, 16, 16)
    fixed = DiagonalGaussianDistribution(torch.cat([torch.ones(2, 4, 3, 8, 8), torch.zeros(2, 4, 3, 8, 8)], dim=1))
    model.vae.encode = lambda video: type("Out", (), {"latent_dist": fixed})()
    monkeypatch.setattr("apps.video_gen.vae.decode_unclamped", lambda vae, z: torch.zeros_like(clip))
    loss = model(clip)
    # KL per clip: 0.5 x 1 per element x (4 x 3 x 8 x 8) elements = 384; / (3 x 5 x 16 x 16) = 3840 elements
    torch.testing.assert_close(loss, torch.tensor(0.5 * 384 / 3840))
