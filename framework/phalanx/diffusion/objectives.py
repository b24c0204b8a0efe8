"""Noise targets and losses.

DDPM (epsilon / v-prediction): x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise; the target is the noise
(epsilon) or v = sqrt(a_t) noise - sqrt(1 - a_t) x0. Min-SNR-gamma (Hang et al. 2023) weighs each
sample by min(SNR, gamma) / SNR (epsilon) or min(SNR, gamma) / (SNR + 1) (v), SNR = a / (1 - a).

Rectified flow: x_t = (1 - t) x0 + t noise, the model predicts the velocity dx_t/dt = noise - x0,
and the loss is the per-sample MSE to it. Sampling integrates from t = 1 (noise) to t = 0.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def _expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(v.shape[0], *([1] * (like.dim() - 1))).to(like.dtype)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor,
              timesteps: torch.Tensor) -> torch.Tensor:
    """sqrt(a_t) x0 + sqrt(1 - a_t) noise, per sample (any number of trailing dims)."""
    a = _expand(alphas_cumprod[timesteps], x0)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def epsilon_or_v_target(prediction_type: Literal["epsilon", "v_prediction"], x0: torch.Tensor,
                        noise: torch.Tensor, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    if prediction_type == "epsilon":
        return noise
    if prediction_type != "v_prediction":
        raise ValueError(f"prediction_type={prediction_type!r}: choose 'epsilon' or 'v_prediction'")
    a = _expand(alphas_cumprod[timesteps], x0)
    return a.sqrt() * noise - (1 - a).sqrt() * x0


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    a = alphas_cumprod[timesteps]
    return a / (1 - a)


def min_snr_weights(snr_values: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights for epsilon- or v-prediction."""
    clipped = snr_values.clamp(max=gamma)
    return clipped / snr_values if prediction_type == "epsilon" else clipped / (snr_values + 1)


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE over every dim but the first, in fp32: [B]."""
    return F.mse_loss(pred.float(), target.float(), reduction="none").flatten(1).mean(dim=1)


def flow_interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise, t in [0, 1] per sample."""
    t = _expand(t, x0)
    return (1 - t) * x0 + t * noise


def flow_velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """d x_t / d t = noise - x0."""
    return noise - x0


def flow_loss(pred_velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified-flow loss per sample, [B]: MSE(pred, noise - x0), optionally weighted."""
    per = per_sample_mse(pred_velocity, flow_velocity_target(x0, noise))
    return per * weights if weights is not None else per
