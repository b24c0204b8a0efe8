"""Image-to-video by first-frame conditioning (`model.i2v`), as Open-Sora 2.0's and Wan's i2v models do.

The first (latent) frame of the clip is given to the transformer clean, concatenated on the
channels with a mask that marks it: the input is [x_t, condition, mask], condition = the clip with
every frame after the first zeroed, mask = 1 on the first frame and 0 elsewhere (one channel). The
loss covers the other frames only: the first is given, not predicted. Sampling takes the first
frame from the caller (in latent space: its latent, encoded alone, which a causal autoencoder's
first latent frame is) and writes it into the result.
"""
from __future__ import annotations

import torch

CONDITION_EXTRA = 1  # the mask channel; the condition itself takes as many channels as the clip


def condition_channels(channels: int) -> int:
    """Input channels the first-frame conditioning adds to a model of `channels` clip channels."""
    return channels + CONDITION_EXTRA


def first_frame_mask(shape: tuple[int, ...], device=None, dtype=torch.float32) -> torch.Tensor:
    """[B, 1, F, H, W]: 1 on the first frame, 0 on the others."""
    b, _, f, h, w = shape
    mask = torch.zeros((b, 1, f, h, w), device=device, dtype=dtype)
    mask[:, :, 0] = 1
    return mask


def first_frame_condition(first: torch.Tensor, frames: int) -> torch.Tensor:
    """[B, C + 1, F, H, W] from the clean first frame `first` [B, C, 1, H, W] (or a whole clip, whose
    first frame is taken): the frame, zeros after it, and the mask channel."""
    first = first[:, :, :1]
    b, c, _, h, w = first.shape
    clip = torch.cat([first, first.new_zeros((b, c, frames - 1, h, w))], dim=2)
    return torch.cat([clip, first_frame_mask(tuple(clip.shape), first.device, first.dtype)], dim=1)


def predicted_elements(shape: tuple[int, ...]) -> int:
    """Elements of one sample that the i2v loss covers: every frame but the first."""
    _, c, f, h, w = shape
    if f < 2:
        raise ValueError(f"first-frame conditioning (model.i2v) needs clips of at least 2 (latent) frames, got "
                         f"{f}: drop the 1-frame buckets and data.shapes_images (set it to 0)")
    return c * (f - 1) * h * w
