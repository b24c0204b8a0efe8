"""Classifier-free guidance: drop captions in training, combine predictions when sampling."""
from __future__ import annotations

import torch


def drop_captions(prompt_ids: torch.Tensor, empty_ids: torch.Tensor, probability: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Each row of `prompt_ids` replaced by `empty_ids` (the empty prompt) with `probability`,
    drawn from the current (training) RNG stream, so exact resume covers it."""
    if probability <= 0:
        return prompt_ids
    b = prompt_ids.shape[0]
    drop = torch.rand(b, generator=generator, device=prompt_ids.device) < probability
    empty = empty_ids.reshape(1, -1).to(prompt_ids.device).expand(b, -1)
    return torch.where(drop[:, None], empty, prompt_ids)


def guided_prediction(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale (cond - uncond); scale 1 is the conditional prediction."""
    return uncond + scale * (cond - uncond)
