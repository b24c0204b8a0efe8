"""Does the model use the direction word? The cheap check behind issue 16's motion target.

The flow loss on moving-shapes clips at high noise levels, once with the true caption and once with
the opposite direction word ("moving left" -> "moving right"), with the same noise. A model that
conditions the motion on the word has a lower loss with the true caption (a positive gap); one that
ignores it scores both alike, and its samples move in a random direction (the motion check at
chance). Far cheaper than sampling, so it can be watched during training.
"""
from __future__ import annotations

import torch

from phalanx.device import to_device

from .shapes import moving_shapes
from .text import tokenize

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def with_opposite_direction(caption: str, direction: str) -> str:
    words = caption.split()
    if words[-1] != direction:
        raise ValueError(f"caption {caption!r} does not end with its direction {direction!r}")
    return " ".join(words[:-1] + [OPPOSITE[direction]])


@torch.no_grad()
def direction_gap(model, tokenizer, frames: int, size: int, clips: int = 48, timesteps=(0.8, 0.95),
                  seed: int = 123, vae=None) -> dict[str, float]:
    """{"direction_gap/t=<t>": loss(opposite word) - loss(true word)} on `clips` fresh moving-shapes clips
    (their latents when the model works on the latents of `vae`)."""
    device = model.device
    shapes = moving_shapes(clips, frames, size, seed=seed)
    video = torch.stack([c.video for c in shapes])
    if vae is not None:
        from .vae import encode_latents
        video = encode_latents(vae, video.to(vae.device))[0]
    # the noise is drawn on the host (the same on every device), then everything moves once
    noise = torch.randn(video.shape, generator=torch.Generator().manual_seed(seed))
    true_ids = tokenize(tokenizer, [c.caption for c in shapes])
    opposite_ids = tokenize(tokenizer, [with_opposite_direction(c.caption, c.direction) for c in shapes])
    video, noise, true_ids, opposite_ids = to_device((video, noise, true_ids, opposite_ids), device)
    gaps = []
    for t in timesteps:
        tt = torch.full((clips,), float(t), device=device)
        right = model.per_sample_loss(video, true_ids, tt, noise).mean()
        wrong = model.per_sample_loss(video, opposite_ids, tt, noise).mean()
        gaps.append(torch.stack([wrong, right]))
    values = torch.stack(gaps).tolist()  # one device->host sync
    return {f"direction_gap/t={t}": wrong - right for t, (wrong, right) in zip(timesteps, values)}
