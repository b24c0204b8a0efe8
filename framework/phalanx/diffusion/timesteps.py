"""Timestep samplers.

Discrete DDPM training draws t ~ U{0..T-1}. Rectified flow (SD3, Flux, Open-Sora 2.0) uses a
continuous t in (0, 1) where x_t = (1 - t) x0 + t noise: `uniform_timesteps` or
`logit_normal_timesteps` (t = sigmoid(N(mean, std)), which spends more steps mid-way, Esser et al.
2024), then `shift_timesteps(t, s)` = s t / (1 + (s - 1) t) pushes t towards the noisy end for
inputs with more tokens (higher resolution, longer clips), whose signal survives more noise.
`resolution_shift` gives the shift Open-Sora and SD3 use: sqrt(tokens / base_tokens).
"""
from __future__ import annotations

import math

import torch


def uniform_discrete_timesteps(batch: int, num_timesteps: int, device=None, generator=None) -> torch.Tensor:
    """t ~ U{0, ..., num_timesteps - 1} (long), DDPM training."""
    return torch.randint(0, num_timesteps, (batch,), device=device, generator=generator)


def uniform_timesteps(batch: int, device=None, generator=None) -> torch.Tensor:
    """t ~ U(0, 1) (float32)."""
    return torch.rand(batch, device=device, generator=generator)


def logit_normal_timesteps(batch: int, mean: float = 0.0, std: float = 1.0, device=None,
                           generator=None) -> torch.Tensor:
    """t = sigmoid(u), u ~ N(mean, std^2): logit-normal in (0, 1)."""
    u = torch.randn(batch, generator=generator, device=device) * std + mean
    return torch.sigmoid(u)


def resolution_shift(num_tokens: int, base_tokens: int, max_shift: float | None = None) -> float:
    """sqrt(num_tokens / base_tokens): 1 at the base size, larger for bigger / longer inputs
    (capped at max_shift when given). `num_tokens` counts latent patches, frames included."""
    if num_tokens <= 0 or base_tokens <= 0:
        raise ValueError(f"resolution_shift needs positive token counts, got {num_tokens} and {base_tokens}")
    shift = math.sqrt(num_tokens / base_tokens)
    return min(shift, max_shift) if max_shift is not None else shift


def shift_timesteps(t: torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    """s t / (1 + (s - 1) t): the identity at s = 1, keeps 0 and 1 fixed, moves mass towards 1 for s > 1."""
    return shift * t / (1 + (shift - 1) * t)


def fixed_eval_timesteps(count: int = 10) -> torch.Tensor:
    """`count` evenly spaced t in (0, 1), the midpoints of equal bins: the evaluation loss at fixed
    timesteps Open-Sora reports (the same t every evaluation, so losses compare across steps)."""
    return (torch.arange(count, dtype=torch.float32) + 0.5) / count
