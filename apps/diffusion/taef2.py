"""TAEF2, a tiny pretrained autoencoder (TAESD family, for the FLUX.2 latent space), as a
diffusers model.

Architecture, read from the shipped weights' keys and shapes (encoder and decoder are
`nn.Sequential`s, so a key's first number is the layer index):

    encoder: conv 3->64, Block,  [conv s2 (no bias), Block x3] x3, conv 64->32
    decoder: tanh-clamp, conv 32->64, ReLU, [Block x3, upsample x2, conv (no bias)] x3, Block, conv 64->3
    Block:   relu(conv3(relu(conv3(relu(conv3(x))))) + x), where the three blocks nearest the
             latent first add a "pool" branch x += conv1x1(relu(GroupNorm(conv1x1_4x(x))))

TAEF2 maps RGB in [0, 1] to 32-channel latents at 1/8 resolution. diffusers' own
`AutoencoderTiny` has no "pool" branch, so these weights do not fit it; this class speaks
diffusers' VAE interface instead (images in [-1, 1], `encode(x).latent_dist.sample()`,
`decode(z).sample`, `config.scaling_factor`) and is saved with a saved pipeline as a custom
component. This file imports only torch and diffusers because diffusers copies it into the
pipeline's `vae/` folder and imports it from there (`trust_remote_code=True`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from torch import nn

POOL_GROUPS = 4  # GroupNorm groups of the pool branch (checked by reconstruction quality)


def _conv(n_in: int, n_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


class _Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class _Block(nn.Module):
    def __init__(self, channels: int, pool: bool = False):
        super().__init__()
        self.conv = nn.Sequential(_conv(channels, channels), nn.ReLU(), _conv(channels, channels), nn.ReLU(),
                                  _conv(channels, channels))
        self.skip = nn.Identity()
        self.fuse = nn.ReLU()
        self.pool = nn.Sequential(nn.Conv2d(channels, 4 * channels, 1, bias=False),
                                  nn.GroupNorm(POOL_GROUPS, 4 * channels), nn.ReLU(),
                                  nn.Conv2d(4 * channels, channels, 1, bias=False)) if pool else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        return self.fuse(self.conv(x) + self.skip(x))


def build_encoder(latent_channels: int, width: int = 64) -> nn.Sequential:
    layers: list[nn.Module] = [_conv(3, width), _Block(width)]
    for level in range(3):
        layers += [_conv(width, width, stride=2, bias=False)] + [_Block(width, pool=level == 2) for _ in range(3)]
    return nn.Sequential(*layers, _conv(width, latent_channels))


def build_decoder(latent_channels: int, width: int = 64) -> nn.Sequential:
    layers: list[nn.Module] = [_Clamp(), _conv(latent_channels, width), nn.ReLU()]
    for level in range(3):
        layers += [_Block(width, pool=level == 0) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2), _conv(width, width, bias=False)]
    return nn.Sequential(*layers, _Block(width), _conv(width, 3))


@dataclass
class _LatentDist:
    """The encoder is deterministic; this mimics diffusers' `latent_dist` interface."""
    latents: torch.Tensor

    def sample(self, generator=None) -> torch.Tensor:
        return self.latents

    def mode(self) -> torch.Tensor:
        return self.latents


@dataclass
class TAEF2EncoderOutput(BaseOutput):
    latent_dist: _LatentDist = None


class TAEF2Autoencoder(ModelMixin, ConfigMixin):
    """TAEF2 with diffusers' VAE interface: images in [-1, 1] in and out, raw latents (multiply by
    `config.scaling_factor` before the UNet, as with any Stable Diffusion VAE)."""

    @register_to_config
    def __init__(self, latent_channels: int = 32, width: int = 64, scaling_factor: float = 1.0,
                 shift_factor: float = 0.0, block_out_channels: tuple[int, ...] = (64, 64, 64, 64),
                 force_upcast: bool = False):
        super().__init__()
        # block_out_channels only tells pipelines the 8x downsampling (2 ** (len - 1)).
        self.encoder = build_encoder(latent_channels, width)
        self.decoder = build_decoder(latent_channels, width)

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        latents = self.encoder(x.to(self.dtype).add(1).div(2))
        return TAEF2EncoderOutput(latent_dist=_LatentDist(latents)) if return_dict else (_LatentDist(latents),)

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None):
        image = self.decoder(z.to(self.dtype)).mul(2).sub(1)  # a bf16 UNet may hand over bf16 latents
        return DecoderOutput(sample=image) if return_dict else (image,)

    def forward(self, sample: torch.Tensor, return_dict: bool = True):
        return self.decode(self.encode(sample).latent_dist.mode(), return_dict=return_dict)
