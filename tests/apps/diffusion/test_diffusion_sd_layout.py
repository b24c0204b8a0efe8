"""The recipe on a Stable Diffusion directory in the real diffusers layout (a tiny random one):
text-to-image fine-tuning exported as a plain `StableDiffusionPipeline`, DreamBooth LoRA on the
UNet and the text encoder read back by `load_lora_weights`, and the errors for incomplete layouts."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from diffusion_tiny import EMOJI, SD15_DREAMBOOTH, sd_config

CAT = EMOJI.parent / "emoji_cat"


def _image(pipe, prompt: str, seed: int = 3) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, num_inference_steps=2, guidance_scale=3.0, output_type="np",
                generator=torch.Generator().manual_seed(seed)).images[0]


def _plain(directory):
    """What a user runs: no trust_remote_code."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(directory))


def test_fine_tune_exports_a_pipeline_plain_diffusers_opens(sd_pipeline_dir, tmp_path):
    from apps.diffusion.components import custom_components
    from apps.diffusion.train_text_to_image import train

    cfg = sd_config(tmp_path, sd_pipeline_dir, "train.max_steps=3", "train.grad_accum_steps=1", "train.lr=1e-3",
                    f"data.root={EMOJI}", "data.max_images=8", "validation.prompts=[red apple]")
    result, exported = train(cfg)
    assert result.final_step == 3 and all(map(math.isfinite, result.losses))

    index = json.loads((exported / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKL"] and index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"] and not list(exported.rglob("*.py"))
    assert custom_components(exported, index) == []
    base, tuned = _plain(sd_pipeline_dir), _plain(exported)
    assert tuned.vae.config.scaling_factor == pytest.approx(0.18215)  # the VAE's own factor scaled the latents
    assert len(tuned.tokenizer) == len(base.tokenizer) and tuned.tokenizer.model_max_length == 77
    base_unet, tuned_unet = base.unet.state_dict(), tuned.unet.state_dict()
    assert base_unet.keys() == tuned_unet.keys()
    changed = [k for k in base_unet if not torch.equal(base_unet[k], tuned_unet[k])]
    assert len(changed) > len(base_unet) // 2, f"only {len(changed)} of {len(base_unet)} UNet tensors changed"
    for k, v in base.text_encoder.state_dict().items():  # model.train_text_encoder is off in sd15_text_to_image
        assert torch.equal(v, tuned.text_encoder.state_dict()[k]), k
    image = _image(tuned, "red apple")
    assert image.shape == (64, 64, 3)  # the UNet's sample_size x the VAE's 8x
    assert np.abs(image - _image(base, "red apple")).max() > 1e-3


def test_dreambooth_lora_on_unet_and_text_encoder_loads_back(sd_pipeline_dir, tmp_path):
    from safetensors.torch import load_file

    from apps.diffusion.components import load_components
    from apps.diffusion.data import tokenize
    from apps.diffusion.recipe import load_trained_weights
    from apps.diffusion.train_dreambooth import dreambooth_model, train

    cfg = sd_config(tmp_path, sd_pipeline_dir, f"dreambooth.instance_dir={CAT}", "dreambooth.instance_prompt=sks cat face",
                    "dreambooth.class_prompt=cat face", "dreambooth.num_class_images=2",
                    "dreambooth.class_generation_steps=2", "lora.rank=4", "dreambooth.fidelity_samples=2",
                    "dreambooth.validation_prompts=[sks cat face]", "model.train_text_encoder=true",
                    "train.max_steps=2", "train.micro_batch_size=2", "train.lr=1e-2", config=SD15_DREAMBOOTH)
    result, lora_dir = train(cfg)
    assert result.final_step == 2 and all(map(math.isfinite, result.losses))
    keys = load_file(str(lora_dir / "pytorch_lora_weights.safetensors")).keys()
    assert any(k.startswith("unet.") for k in keys) and any(k.startswith("text_encoder.") for k in keys)
    report = json.loads((tmp_path / "fidelity.json").read_text())
    assert set(report["before"]) == set(report["after"]) == {"to_instance", "to_class", "nearer_instance"}
    assert (tmp_path / "fidelity.png").is_file()

    # The trained text encoder (base + adapters from the checkpoint) differs from the base one ...
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    model = dreambooth_model(cfg, parts)
    load_trained_weights(model, result.checkpoint_dir, with_ema=False)
    ids = tokenize(parts.tokenizer, ["sks cat face"])
    with torch.no_grad():
        trained = parts.text_encoder(ids)[0]
        pipe = _plain(sd_pipeline_dir)
        base = pipe.text_encoder(ids)[0]
        base_image = _image(pipe, "sks cat face")
        # ... and plain diffusers' load_lora_weights on a fresh pipeline reproduces it.
        pipe.load_lora_weights(str(lora_dir))
        reloaded = pipe.text_encoder(ids)[0]
    assert (trained - base).abs().max() > 1e-3
    torch.testing.assert_close(reloaded, trained, atol=1e-5, rtol=1e-5)
    image = _image(pipe, "sks cat face")
    assert image.shape == (64, 64, 3) and np.abs(image - base_image).max() > 1e-3


def test_other_layouts_are_refused_with_the_reason(tmp_path):
    from apps.diffusion.components import open_pipeline

    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        open_pipeline(tmp_path)
    parts = {p: ["diffusers", "X"] for p in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")}
    (tmp_path / "model_index.json").write_text(json.dumps(
        {"_class_name": "StableDiffusionXLPipeline", **parts, "text_encoder_2": ["transformers", "X"]}))
    with pytest.raises(FileNotFoundError, match=r"an SDXL directory holds .*text_encoder_2, tokenizer_2"):
        open_pipeline(tmp_path)  # SDXL is trained (test_diffusion_sdxl.py), but needs every part
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline", **parts}))
    for p in ("unet", "vae", "text_encoder", "tokenizer"):
        (tmp_path / p).mkdir()
    with pytest.raises(FileNotFoundError, match=r"lacks \['scheduler'\]"):
        open_pipeline(tmp_path)
