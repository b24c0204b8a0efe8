"""The causal 3D video autoencoder: diffusers' AutoencoderKLWan (the Wan 2.1 VAE design: causal
3D convolutions, the first frame encoded alone so images are 1-frame videos), built tiny from the
config or loaded from a local diffusers directory; and its training objective.

Loss (perceptual-free, runs on CPU): L1 + l2_weight * MSE of the reconstruction, + kl_weight * KL
of the latent posterior to N(0, I), + temporal_weight * L1 between the frame-to-frame changes of the
reconstruction and of the input (temporal smoothness: no flicker the input does not have).
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
    return AutoencoderKLWan(base_dim=vcfg.base_dim, z_dim=vcfg.z_dim, dim_mult=list(vcfg.dim_mult),
                            num_res_blocks=vcfg.num_res_blocks, temperal_downsample=list(vcfg.temporal_downsample),
                            attn_scales=[], latents_mean=[0.0] * vcfg.z_dim, latents_std=[1.0] * vcfg.z_dim,
                            scale_factor_temporal=down_t, scale_factor_spatial=2 ** (len(vcfg.dim_mult) - 1))


class VAETrainModel(nn.Module):
    def __init__(self, vae, vcfg: VAEConfig):
        super().__init__()
        self.vae, self.vcfg = vae, vcfg

    def forward(self, video: torch.Tensor, prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        posterior = self.vae.encode(video).latent_dist
        recon = self.vae.decode(posterior.sample()).sample
        c = self.vcfg
        loss = F.l1_loss(recon, video) + c.l2_weight * F.mse_loss(recon, video)
        loss = loss + c.kl_weight * posterior.kl().mean() / video[0].numel()
        if c.temporal_weight and video.shape[2] > 1:
            loss = loss + c.temporal_weight * F.l1_loss(recon.diff(dim=2), video.diff(dim=2))
        return loss


@torch.no_grad()
def psnr(vae, videos: torch.Tensor) -> float:
    """Mean PSNR (dB) of the deterministic reconstruction (posterior mode) of clips in [-1, 1]."""
    recon = vae.decode(vae.encode(videos).latent_dist.mode()).sample.clamp(-1, 1)
    mse = ((recon - videos) / 2).pow(2).flatten(1).mean(1).clamp(min=1e-10)
    return float((10 * torch.log10(1 / mse)).mean())


def frames_ok(frames: int, vcfg: VAEConfig) -> bool:
    """A causal VAE takes 1 + k * temporal_factor frames."""
    factor = 2 ** sum(vcfg.temporal_downsample)
    return (frames - 1) % factor == 0

