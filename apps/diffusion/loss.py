"""The training objective as an `nn.Module`, so its forward is the boosted model's forward (DDP's
hooks fire, FSDP gathers) and `fit` can train it with `loss_fn=diffusion_loss`.

Per sample: draw t ~ U{0..T-1} and noise ~ N(0, I) (plus `noise_offset` x N(0,1) per channel),
noisy = sqrt(a_t) x0 + sqrt(1-a_t) noise, and regress the UNet's output on the target (the
noise for epsilon-prediction, v = sqrt(a_t) noise - sqrt(1-a_t) x0 for v-prediction) with MSE.
Min-SNR (Hang et al. 2023) weighs each sample by min(SNR_t, gamma) / SNR_t (epsilon) or
min(SNR_t, gamma) / (SNR_t + 1) (v). Caption dropout replaces prompts by the empty prompt here,
on the training RNG stream, so exact resume covers it. With prior preservation the loss is
mean(instance losses) + prior_loss_weight x mean(class-image losses), as in DreamBooth. With
augmentation (`views`, data.TrainingViews) the latents are the step's random view of each image:
its mirror 1/2 of the time, or a random crop encoded by the VAE here. The formulas
come from `phalanx.diffusion` (shared with apps/video_gen).

SDXL (`text_encoder_2` set): `prompt_ids` holds both tokenizers' ids side by side (the first
`split` columns for the first encoder), so datasets and caption dropout treat them as one prompt.
The UNet's context is both encoders' penultimate hidden states concatenated on the feature axis,
and `added_cond_kwargs` carries the second encoder's pooled (projected) embedding and each image's
`time_ids` (original height, width, crop top, left, target height, width), as SDXL was trained.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

from phalanx.diffusion import (add_noise, drop_captions, epsilon_or_v_target, min_snr_weights, per_sample_mse, snr,
                               uniform_discrete_timesteps)

from .config import NoiseConfig


class DiffusionTrainModel(nn.Module):
    """UNet (+ text encoder) and the noise schedule; `forward(latents, prompt_ids, is_prior?)` -> loss
    (or `forward(pixels=..., prompt_ids=...)` with random-crop views)."""

    def __init__(self, unet: nn.Module, text_encoder: nn.Module, noise_scheduler, ncfg: NoiseConfig,
                 empty_prompt_ids: torch.Tensor, caption_dropout: float = 0.0, train_text_encoder: bool = False,
                 prior_loss_weight: float = 1.0, views=None, text_encoder_2: nn.Module | None = None,
                 split: int | None = None):
        super().__init__()
        self.views = views  # data.TrainingViews or None (a plain object: its VAE is not a submodule)
        self.unet, self.text_encoder = unet, text_encoder
        self.text_encoder_2, self.split = text_encoder_2, split  # SDXL: second encoder, first encoder's id count
        if text_encoder_2 is not None and split is None:
            raise ValueError("DiffusionTrainModel: an SDXL text_encoder_2 needs split= (the first tokenizer's length)")
        for encoder in self.text_encoders:
            has_adapters = any("lora_" in n for n, _ in encoder.named_parameters())
            if not (train_text_encoder and has_adapters):  # LoRA adapters keep their own requires_grad
                encoder.requires_grad_(train_text_encoder)
        if text_encoder_2 is not None:
            # SDXL reads the first encoder's penultimate layer: its last layer and final norm (and
            # their adapters) get no gradient, which DDP would stop on; they stay as they were.
            text = getattr(text_encoder, "text_model", text_encoder)  # transformers < 5 nests it
            for unused in (text.encoder.layers[-1], text.final_layer_norm):
                unused.requires_grad_(False)
        self.train_text_encoder = train_text_encoder
        self.noise_scheduler = noise_scheduler  # DDPM config; not a module, not saved with the weights
        self.ncfg, self.caption_dropout, self.prior_loss_weight = ncfg, caption_dropout, prior_loss_weight
        self.register_buffer("alphas_cumprod", noise_scheduler.alphas_cumprod.float().clone(), persistent=False)
        self.register_buffer("empty_prompt_ids", empty_prompt_ids.reshape(1, -1).clone(), persistent=False)

    @property
    def num_timesteps(self) -> int:
        """The noise schedule's length (a pretrained model's own, not necessarily the config's)."""
        return len(self.alphas_cumprod)

    @property
    def text_encoders(self) -> list[nn.Module]:
        return [self.text_encoder] + ([self.text_encoder_2] if self.text_encoder_2 is not None else [])

    def encode_prompts(self, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the UNet's context [B, T, D], the pooled embedding [B, P] for SDXL, else None)."""
        with contextlib.nullcontext() if self.train_text_encoder else torch.no_grad():
            if self.text_encoder_2 is None:
                return self.text_encoder(prompt_ids)[0], None
            ids_1, ids_2 = prompt_ids[:, :self.split], prompt_ids[:, self.split:]
            first = self.text_encoder(ids_1, output_hidden_states=True)
            second = self.text_encoder_2(ids_2, output_hidden_states=True)
            hidden = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)  # as SDXL's pipeline
            return hidden, second.text_embeds

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, prompt_ids: torch.Tensor,
                time_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The UNet's output for `noisy` under the prompts (and, for SDXL, the size / crop `time_ids`)."""
        hidden, pooled = self.encode_prompts(prompt_ids)
        dtype = self.unet.dtype
        if pooled is None:
            return self.unet(noisy.to(dtype), timesteps, hidden.to(dtype)).sample
        if time_ids is None:
            raise ValueError("an SDXL UNet needs time_ids per image (original size, crop top-left, target size): "
                             "the batch lacks 'time_ids'")
        added = {"text_embeds": pooled.to(dtype), "time_ids": time_ids.to(dtype)}
        return self.unet(noisy.to(dtype), timesteps, hidden.to(dtype), added_cond_kwargs=added).sample

    def forward(self, latents: torch.Tensor | None = None, prompt_ids: torch.Tensor | None = None,
                is_prior: torch.Tensor | None = None, timesteps: torch.Tensor | None = None,
                noise: torch.Tensor | None = None, latents_flipped: torch.Tensor | None = None,
                pixels: torch.Tensor | None = None, time_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.views is not None:
            latents, time_ids = self.views.draw(latents, latents_flipped, pixels, time_ids,
                                                training=self.training)
        elif latents is None or latents_flipped is not None or pixels is not None:
            raise ValueError("DiffusionTrainModel: a batch with pixels or flipped latents needs views=TrainingViews(...)")
        b = latents.shape[0]
        if self.training:
            prompt_ids = drop_captions(prompt_ids, self.empty_prompt_ids, self.caption_dropout)
        if noise is None:
            noise = torch.randn_like(latents)
            if self.ncfg.noise_offset:
                noise = noise + self.ncfg.noise_offset * torch.randn(b, latents.shape[1], 1, 1, device=latents.device)
        if timesteps is None:
            timesteps = uniform_discrete_timesteps(b, self.num_timesteps, device=latents.device)
        noisy = add_noise(latents, noise, self.alphas_cumprod, timesteps)
        target = epsilon_or_v_target(self.ncfg.prediction_type, latents, noise, self.alphas_cumprod, timesteps)
        pred = self.predict(noisy, timesteps, prompt_ids, time_ids)
        per_sample = per_sample_mse(pred, target)
        if self.ncfg.snr_gamma is not None:
            per_sample = per_sample * self.snr_weights(timesteps)
        if is_prior is None:  # present only with class images, always after the instance rows
            return per_sample.mean()
        return per_sample[~is_prior].mean() + self.prior_loss_weight * per_sample[is_prior].mean()

    def snr_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR-γ loss weights (`noise.snr_gamma` must be set)."""
        return min_snr_weights(snr(self.alphas_cumprod, timesteps), self.ncfg.snr_gamma, self.ncfg.prediction_type)


def diffusion_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`loss_fn` for fit: the boosted DiffusionTrainModel called on the batch's keys."""
    return model(**batch)
