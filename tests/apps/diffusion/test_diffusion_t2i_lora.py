"""Text-to-image LoRA (`train_text_to_image_lora`, or `lora.rank` in the text-to-image trainer) on a
Stable Diffusion directory in the real diffusers layout: only adapters train, and the exported
file opens with plain diffusers' `load_lora_weights`, reproducing the trained UNet."""
from __future__ import annotations

import math

import pytest
import torch

from diffusion_tiny import EMOJI, sd_config


def test_text_to_image_lora_exports_weights_diffusers_loads(sd_pipeline_dir, tmp_path):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    from apps.diffusion.recipe import trained_model
    from apps.diffusion.train_text_to_image import train
    from apps.diffusion.train_text_to_image_lora import DEFAULT_RANK, lora_on

    cfg = sd_config(tmp_path, sd_pipeline_dir, "train.max_steps=3", "train.lr=1e-2", f"data.root={EMOJI}",
                    "data.max_images=8", "validation.held_out=4", "validation.prompts=[red apple]",
                    "ema.enabled=false")
    lora_on(cfg)
    assert cfg.lora.rank == DEFAULT_RANK
    result, lora_dir = train(cfg)
    assert result.final_step == 3 and all(map(math.isfinite, result.losses)) and "loss" in result.last_eval
    assert lora_dir == tmp_path / "lora" and not (tmp_path / "pipeline").exists()
    state = load_file(str(lora_dir / "pytorch_lora_weights.safetensors"))
    assert state and all(k.startswith("unet.") and "lora" in k for k in state)  # the text encoder stays frozen
    # Only adapters trained: the checkpoint's model holds the base weights unchanged.
    base = StableDiffusionPipeline.from_pretrained(str(sd_pipeline_dir))
    _, model = trained_model(cfg, result.checkpoint_dir)
    to_q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    trained_base = dict(model.unet.named_parameters())[f"{to_q}.base_layer.weight"]
    assert torch.equal(base.unet.state_dict()[f"{to_q}.weight"], trained_base)

    torch.manual_seed(0)
    sample, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])
    ids = base.tokenizer(["red apple", "sun"], padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = base.text_encoder(ids)[0]
        before = base.unet(sample, t, hidden).sample
        trained = model.unet(sample, t, hidden).sample
        base.load_lora_weights(str(lora_dir))  # plain diffusers, no remote code
        loaded = base.unet(sample, t, hidden).sample
    assert (trained - before).abs().max() > 1e-4, "the adapters did not change the UNet"
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-5)


def test_lora_command_needs_a_base_model(tmp_path, make_config):
    from phalanx.config import ConfigError

    from apps.diffusion.train_text_to_image_lora import lora_on

    cfg = make_config(tmp_path)
    with pytest.raises(ValueError, match="model.pretrained_dir"):
        lora_on(cfg)
    cfg = make_config(tmp_path, "model.init_from=some/pipeline", "lora.rank=8")
    lora_on(cfg)
    assert cfg.lora.rank == 8  # the config's rank is kept
    with pytest.raises(ConfigError, match="'dreambooth.lora_rank' is now 'lora.rank'"):
        make_config(tmp_path, "dreambooth.lora_rank=4")


def test_validation_images_with_a_bf16_unet_and_an_fp32_vae(sd_pipeline_dir, tmp_path):
    """Under bf16 training the UNet and text encoder compute in bf16 while the frozen AutoencoderKL
    stays fp32: the validation grid decodes the latents in the VAE's dtype (diffusers' pipeline hands
    it bf16 latents and its conv refuses them), and draws what the fp32 model draws, up to bf16 rounding."""
    import numpy as np

    from apps.diffusion.components import load_components
    from apps.diffusion.validation import generate

    cfg = sd_config(tmp_path, sd_pipeline_dir, "validation.num_inference_steps=2")
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    full = np.asarray(generate(parts, ["red apple"], cfg.validation)[0], dtype=np.float32)
    parts.unet.to(torch.bfloat16)
    parts.text_encoder.to(torch.bfloat16)
    half = np.asarray(generate(parts, ["red apple"], cfg.validation)[0], dtype=np.float32)
    assert half.shape == full.shape == (64, 64, 3) and parts.vae.dtype == torch.float32
    assert np.abs(half - full).mean() < 8.0, np.abs(half - full).mean()  # of 255
