"""The causal 3D video autoencoder: diffusers' AutoencoderKLWan (the Wan 2.1 VAE design: causal
3D convolutions, the first frame encoded alone so images are 1-frame videos), built tiny from the
config or loaded from a local diffusers directory; its training objective; and the latent space the
transformer trains in with `vae.from_dir`:

    z = (posterior mean - latents_mean) / latents_std          (per channel, from the VAE's config)
    clip = decode(z * latents_std + latents_mean)

as diffusers' Wan pipelines normalise. `train_vae` measures latents_mean / latents_std on its
training clips and writes them into the saved config, so its latents reach the transformer at
about unit scale like real Wan weights' do.

Loss (perceptual-free, runs on CPU): L1 + l2_weight * MSE of the reconstruction, each pixel weighted
1 + foreground_weight where the input is not black (`reconstruction_weights`), + kl_weight * KL of
the latent posterior to N(0, I) (summed over every latent dim, `posterior_kl`, divided by the
input's element count per clip), + temporal_weight * L1 between the frame-to-frame changes of the
reconstruction and of the input (temporal smoothness: no flicker the input does not have).

The foreground weight: 90% of a moving-shapes clip is black background, so with an unweighted loss
the cheapest answer is a dark blur where the shape is, and the tiny autoencoder sat there for 400
steps (14.5 dB, the clip-mean-colour baseline). Weighting the shape's pixels 10x (1 + 9: about the
background's share against the shape's) makes getting the shape's colour and place right worth as
much as getting the background right.

The loss is taken on the decoder's output *before* diffusers' final clamp to [-1, 1]
(`decode_unclamped`): the clamp passes no gradient where the output lies outside, and the
recipe's clips sit exactly on the boundary (black background -1, saturated colours +-1), so a
decoder that overshoots below -1 everywhere gets no gradient at all and stays black.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VAEConfig


def build_vae(vcfg: VAEConfig):
    from diffusers import AutoencoderKLWan

    if vcfg.pretrained_dir:
        from .config import resolve
        return AutoencoderKLWan.from_pretrained(str(resolve(vcfg.pretrained_dir)))
    down_t = 2 ** sum(vcfg.temporal_downsample)
    vae = AutoencoderKLWan(base_dim=vcfg.base_dim, z_dim=vcfg.z_dim, dim_mult=list(vcfg.dim_mult),
                           num_res_blocks=vcfg.num_res_blocks, temperal_downsample=list(vcfg.temporal_downsample),
                           attn_scales=[], latents_mean=[0.0] * vcfg.z_dim, latents_std=[1.0] * vcfg.z_dim,
                           scale_factor_temporal=down_t, scale_factor_spatial=2 ** (len(vcfg.dim_mult) - 1))
    return init_fresh(vae)


def init_fresh(vae):
    """Kaiming-normal conv weights (ReLU gain) and zero conv biases for an autoencoder trained from scratch.

    With PyTorch's default conv init (weights of variance 1/(3 fan_in), biases up to 1/sqrt(fan_in))
    each conv shrinks the input's signal while the biases add a constant, and the RMS norms then
    rescale that constant: the tiny AutoencoderKLWan's latents hardly depend on the clip (their spread
    across clips is ~5% of their size, 0.036 vs 0.19) and the decoder learns the average clip (black)
    first. This init keeps the clip in the latents (spread 0.45 vs 0.66)."""
    for m in vae.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return vae


BLACK = -0.99  # a pixel with every channel at or below this (in [-1, 1]) is background


def reconstruction_weights(video: torch.Tensor, foreground_weight: float) -> torch.Tensor | float:
    """Per-pixel loss weights [B, 1, F, H, W]: 1 on black pixels, 1 + foreground_weight elsewhere."""
    if not foreground_weight:
        return 1.0
    return 1.0 + foreground_weight * (video > BLACK).any(dim=1, keepdim=True).to(video.dtype)


class VAETrainModel(nn.Module):
    """The autoencoder's training loss (see the module docstring). `foreground_weight`: the extra weight of
    non-black pixels; default `vcfg.foreground_weight` (`vae.foreground_weight` in the YAML)."""

    def __init__(self, vae, vcfg: VAEConfig, foreground_weight: float | None = None):
        super().__init__()
        self.vae, self.vcfg = vae, vcfg
        if foreground_weight is None:
            foreground_weight = vcfg.foreground_weight
        if foreground_weight < 0:
            raise ValueError(f"VAETrainModel: foreground_weight={foreground_weight} must be >= 0 (0: unweighted loss)")
        self.foreground_weight = float(foreground_weight)

    def forward(self, video: torch.Tensor, prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        video = video.to(self.vae.dtype)  # bf16/fp16 when the plugin computes in low precision
        posterior = self.vae.encode(video).latent_dist
        recon = decode_unclamped(self.vae, posterior.sample()).float()
        video = video.float()
        c = self.vcfg
        weight, err = reconstruction_weights(video, self.foreground_weight), recon - video
        loss = (weight * err.abs()).mean() + c.l2_weight * (weight * err.square()).mean()
        loss = loss + c.kl_weight * posterior_kl(posterior).mean() / video[0].numel()
        if c.temporal_weight and video.shape[2] > 1:
            loss = loss + c.temporal_weight * F.l1_loss(recon.diff(dim=2), video.diff(dim=2))
        # A batch of 1-frame images never reaches the temporal down/upsampling convolutions; DDP needs a
        # gradient (zero) for every parameter in every step.
        return loss + 0.0 * sum(p.sum() for p in self.vae.parameters() if p.requires_grad)


def posterior_kl(posterior) -> torch.Tensor:
    """KL(posterior || N(0, I)) per sample, [B] in fp32: summed over every latent dim but the batch.

    diffusers' `DiagonalGaussianDistribution.kl()` sums over dims [1, 2, 3] only: on a video's 5D
    latents [B, C, F, H, W] it returns [B, W], whose mean is 1/W of the per-sample KL."""
    mean, logvar = posterior.mean.float(), posterior.logvar.float()
    return 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).flatten(1).sum(dim=1)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode(z)` without its final clamp to [-1, 1] (differentiable; for the training loss).

    AutoencoderKLWan decodes one latent frame per call of its `decoder` module (with a causal
    feature cache) and concatenates those outputs along time before clamping; a forward hook on
    `vae.decoder` collects them, so the library's own decode path runs unchanged. Checked against
    the clamped result's shape (tiled decoding, which blends tiles, is refused)."""
    if getattr(vae, "use_tiling", False):
        raise ValueError("decode_unclamped: tiled decoding is not supported (call vae.disable_tiling())")
    chunks: list[torch.Tensor] = []
    handle = vae.decoder.register_forward_hook(lambda module, args, out: chunks.append(out))
    try:
        clamped = vae.decode(z).sample
    finally:
        handle.remove()
    slices = z.shape[0] if getattr(vae, "use_slicing", False) and z.shape[0] > 1 else 1
    per_slice = len(chunks) // slices
    raw = torch.cat([torch.cat(chunks[i * per_slice:(i + 1) * per_slice], dim=2) for i in range(slices)], dim=0)
    if vae.config.get("patch_size"):
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        raw = unpatchify(raw, patch_size=vae.config["patch_size"])
    if raw.shape != clamped.shape:
        raise RuntimeError(f"decode_unclamped: the decoder's outputs make {tuple(raw.shape)}, decode gave "
                           f"{tuple(clamped.shape)} (has diffusers' AutoencoderKLWan decode changed?)")
    return raw


@torch.no_grad()
def baseline_psnr(videos: torch.Tensor) -> dict[str, float]:
    """Held-out PSNR (dB) of two reconstructions that ignore the content: all black (-1 everywhere,
    what a dead autoencoder gives) and each clip's own mean colour (per channel) everywhere."""
    v = videos.float()
    black = torch.full_like(v, -1.0)
    mean = v.mean(dim=(2, 3, 4), keepdim=True).expand_as(v)
    return {"black": _psnr(black, v), "clip_mean": _psnr(mean, v)}


def _psnr(recon: torch.Tensor, videos: torch.Tensor) -> float:
    mse = ((recon - videos) / 2).pow(2).flatten(1).mean(1).clamp(min=1e-10)
    return float((10 * torch.log10(1 / mse)).mean())


@torch.no_grad()
def psnr(vae, videos: torch.Tensor) -> float:
    """Mean PSNR (dB) of the deterministic reconstruction (posterior mode) of clips in [-1, 1]."""
    recon = vae.decode(vae.encode(videos).latent_dist.mode()).sample.float().clamp(-1, 1)
    return _psnr(recon, videos.float())


def frames_ok(frames: int, factor: int) -> bool:
    """A causal VAE takes 1 + k * temporal_factor frames."""
    return frames >= 1 and (frames - 1) % factor == 0


def temporal_factor(vcfg: VAEConfig) -> int:
    """The temporal downsampling of the autoencoder `build_vae` makes from the config."""
    return 2 ** sum(vcfg.temporal_downsample)


def vae_factors(vae) -> tuple[int, int]:
    """(temporal, spatial) downsampling of a loaded AutoencoderKLWan."""
    c = vae.config
    t = c.get("scale_factor_temporal") or 2 ** sum(c["temperal_downsample"])
    s = c.get("scale_factor_spatial") or 2 ** (len(c["dim_mult"]) - 1) * (c.get("patch_size") or 1)
    return int(t), int(s)


def load_vae(directory, key: str = "vae.from_dir"):
    """A frozen AutoencoderKLWan from a local diffusers directory (eval mode, no gradients)."""
    from diffusers import AutoencoderKLWan

    from phalanx.config import ConfigError

    from .config import resolve

    path = resolve(directory)
    if not (path / "config.json").is_file() and (path / "vae" / "config.json").is_file():
        path = path / "vae"         # a diffusers pipeline directory
    if not (path / "config.json").is_file():
        raise ConfigError(f"config '{key}'={str(directory)!r}: {path} holds no config.json; point it at a local "
                          "diffusers AutoencoderKLWan directory (`python -m apps.video_gen.train_vae` writes "
                          "<output_dir>/vae) or set it to null to train in pixel space")
    try:
        vae = AutoencoderKLWan.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"config '{key}'={str(directory)!r}: could not load an AutoencoderKLWan from {path} "
                          f"({exc}); give a diffusers AutoencoderKLWan directory") from exc
    return vae.eval().requires_grad_(False)


def _stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config["latents_mean"], dtype=like.dtype, device=like.device).view(shape)
    std = torch.tensor(vae.config["latents_std"], dtype=like.dtype, device=like.device).view(shape)
    return mean, std


@torch.no_grad()
def encode_latents(vae, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips [B, 3, F, H, W] in [-1, 1] -> the normalised posterior (mean, std), each [B, z, F', H', W']."""
    dist = vae.encode(video).latent_dist
    mean, std = _stats(vae, dist.mean)
    return (dist.mean - mean) / std, dist.std / std


@torch.no_grad()
def decode_latents(vae, z: torch.Tensor) -> torch.Tensor:
    """Normalised latents -> clips [B, 3, F, H, W] (not clamped)."""
    mean, std = _stats(vae, z)
    return vae.decode(z * std + mean).sample


@torch.no_grad()
def measure_latent_stats(vae, videos: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the posterior means of `videos` (batches [B, 3, F, H, W])."""
    z = torch.cat([vae.encode(v).latent_dist.mean.transpose(0, 1).flatten(1) for v in videos], dim=1)
    return z.mean(1).tolist(), z.std(1).clamp_min(1e-6).tolist()

