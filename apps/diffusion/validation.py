"""Validation during training: a fixed-noise loss and an image grid for fixed prompts.

`validation_eval_fn(...)` returns the `eval_fn(model, step)` that `phalanx.train.fit` calls every
`validation.every` steps and at the end. Every rank runs it (FSDP gathers inside forward); rank
0 writes `<output_dir>/validation/step-NNNNNN.png` and, with `train.wandb`, logs the grid.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from phalanx.device import current_device, to_device
from phalanx.diffusion import save_grid
from phalanx.observe import is_main_process

from .components import Components, make_pipeline
from .config import ValidationConfig


@torch.no_grad()
def generate(parts: Components, prompts: list[str], vcfg: ValidationConfig, seed: int | None = None) -> list:
    """PIL images of `prompts`. The pipeline stops at the latents and the VAE decodes them in its own
    dtype: under bf16 / fp16 training the UNet computes in low precision while the frozen VAE stays
    fp32, and diffusers' pipeline would hand it latents of the UNet's dtype."""
    pipe = make_pipeline(parts.to(current_device()), vcfg.scheduler)  # sample on the run's device
    generator = torch.Generator("cpu").manual_seed(vcfg.seed if seed is None else seed)
    size = parts.unet.config.sample_size * pipe.vae_scale_factor
    latents = pipe(prompts, num_inference_steps=vcfg.num_inference_steps, guidance_scale=vcfg.guidance_scale,
                   generator=generator, height=size, width=size, output_type="latent").images
    vae = parts.vae
    images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    return pipe.image_processor.postprocess(images.float(), output_type="pil")


@torch.no_grad()
def fixed_noise_loss(model: nn.Module, batch: dict[str, torch.Tensor], num_timesteps: int, seed: int = 0) -> float:
    """The loss on a fixed batch, fixed noise and evenly spread timesteps: comparable across steps."""
    g = torch.Generator("cpu").manual_seed(seed)
    latents = batch["latents"]
    noise = torch.randn(latents.shape, generator=g)  # drawn on the host: the same noise on every device
    t = torch.linspace(0, num_timesteps - 1, len(latents)).long()
    extra = {"time_ids": batch["time_ids"]} if "time_ids" in batch else {}  # SDXL's size / crop conditioning
    latents, prompt_ids, noise, t, extra = to_device((latents, batch["prompt_ids"], noise, t, extra),
                                                     model.alphas_cumprod.device)
    return float(model(latents, prompt_ids, timesteps=t, noise=noise, **extra))


def validation_eval_fn(parts: Components, vcfg: ValidationConfig, prompts: list[str], output_dir: Path,
                       val_batch: dict[str, torch.Tensor] | None, ema=None, use_wandb: bool = False):
    def eval_fn(model: nn.Module, step: int) -> dict[str, float]:
        swap = ema.swapped() if ema is not None and vcfg.use_ema else contextlib.nullcontext()
        metrics: dict[str, float] = {}
        with swap:
            if val_batch is not None:
                metrics["loss"] = fixed_noise_loss(model, val_batch, model.num_timesteps)
            with root_unsharded(model):  # after the loss: the root's forward reshards at its end
                images = generate(parts, prompts, vcfg) if prompts else []
        if images and is_main_process():
            path = save_grid(images, prompts, output_dir / "validation" / f"step-{step:06d}.png")
            if use_wandb:
                _wandb_image(path, step)
        metrics["images"] = float(len(images))
        return metrics
    return eval_fn


@contextlib.contextmanager
def root_unsharded(model: nn.Module):
    """Under FSDP2 the pipeline calls sub-modules (text encoder, UNet) directly, not the root's
    forward: gather the root's own parameters (embeddings, ...) first; the nested FSDP units
    gather theirs in their own forward hooks."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _wandb_image(path: Path, step: int) -> None:
    import wandb  # only when train.wandb is on; fit has started the run

    if wandb.run is not None:
        wandb.log({"validation/grid": wandb.Image(str(path))}, step=step)
