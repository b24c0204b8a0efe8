"""The recipe on a tiny random SDXL directory (`StableDiffusionXLPipeline` layout): two text
encoders whose ids travel as one `prompt_ids`, the second encoder's pooled embedding and each
image's size / crop `time_ids` as the UNet's added conditioning; fine-tuning exported as a pipeline
plain diffusers opens, and LoRA adapters (UNet and both encoders) that `load_lora_weights` reads."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from diffusion_tiny import CONFIGS, EMOJI, sd_config

SDXL_LORA = CONFIGS / "sdxl_text_to_image_lora.yaml"


def _xl(directory):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(directory))  # plain diffusers: no remote code
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe, prompt: str, seed: int = 3) -> np.ndarray:
    return pipe(prompt, num_inference_steps=2, guidance_scale=3.0, output_type="np", height=64, width=64,
                generator=torch.Generator().manual_seed(seed)).images[0]


def _gradient_image(path, width: int, height: int):
    """R = the row, G = the column (0..255): a pixel's value says where in the original it came from."""
    from PIL import Image

    ys, xs = np.mgrid[0:height, 0:width]
    Image.fromarray(np.stack([ys, xs, np.zeros_like(ys)], -1).astype(np.uint8)).save(path)
    return path


class _IdentityVAE(torch.nn.Module):
    """encode(x).latent_dist.mode() == x: the step's crops come back as its "latents"."""
    dtype = torch.float32

    def encode(self, x):
        from types import SimpleNamespace

        return SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: x))


def test_size_crop_ids_match_a_hand_computation_and_the_pixels(tmp_path):
    """A 90 x 150 (w x h) image at 64 px with resize_scale 1.25: the shorter side goes to 80, the
    centre square starts at row (150 - 90) // 2 = 30 of the original, i.e. round(30 x 80 / 90) = 27
    of the resized image, and the centre 64-crop of the 80-square adds (80 - 64) // 2 = 8 to both
    offsets: time_ids = [150, 90, 35, 8, 64, 64]. The crop load_image cuts starts where they say."""
    from apps.diffusion.data import load_image, size_crop_ids, size_crop_table

    path = _gradient_image(tmp_path / "tall.png", 90, 150)
    assert size_crop_ids(path, 64, 1.25) == [150, 90, 35, 8, 64, 64]
    assert size_crop_ids(path, 64) == [150, 90, 21, 0, 64, 64]  # round(30 x 64 / 90) = round(21.3)
    table = size_crop_table([path, path], 64, 1.25)
    assert table.dtype == torch.float32 and table.tolist() == [[150, 90, 35, 8, 64, 64]] * 2
    # The crop's first pixel centre, mapped back through the 90 -> 80 resize, is the original pixel
    # (top + 0.5) x 90 / 80 - 0.5 (rows) and (left + 0.5) x 90 / 80 - 0.5 (columns).
    crop = (load_image(path, 64, resize_scale=1.25) + 1.0) * 127.5
    scale = 90 / 80
    assert abs(float(crop[0, 0, 32]) - ((35 + 0.5) * scale - 0.5)) < 1.0
    assert abs(float(crop[1, 32, 0]) - ((8 + 0.5) * scale - 0.5)) < 1.0


def test_random_crops_and_flips_carry_the_offsets_they_used(tmp_path):
    """With random_crop + random_flip each sample's time_ids name the crop it was cut from: the
    crop's first row / column hold the original pixels those offsets map back to (the mirrored
    image's column W' - 1 - left for a mirrored sample); cached flips move the centre crop's left
    offset to W' - left - resolution (hand-computed for a 150 x 90 image: W' = round(150 x 80 / 90) = 133)."""
    from apps.diffusion.data import TrainingViews, load_square, size_crop_table

    path = _gradient_image(tmp_path / "tall.png", 90, 150)
    table = size_crop_table([path] * 16, 64, 1.25)
    pixels = (load_square(path, 80) * 1.0).expand(16, -1, -1, -1).contiguous()
    views = TrainingViews(64, True, _IdentityVAE())
    torch.manual_seed(1)
    crops, time_ids = views.draw(None, pixels=pixels, time_ids=table)
    values, scale, width = (crops + 1.0) * 127.5, 90 / 80, 80  # W' = 80: the shorter side is the width
    seen = set()
    for crop, (h, w, top, left, th, tw) in zip(values, time_ids.tolist()):
        assert (h, w, th, tw) == (150, 90, 64, 64) and 27 <= top <= 27 + 16 and 0 <= left <= 16
        assert abs(float(crop[0, 0, 32]) - ((top + 0.5) * scale - 0.5)) < 1.0
        mirrored = float(crop[1, 32, 0]) > float(crop[1, 32, 63])  # the column gradient runs backwards
        column = width - 1 - left if mirrored else left
        assert abs(float(crop[1, 32, 0]) - ((column + 0.5) * scale - 0.5)) < 1.5, (left, mirrored)
        seen.add((top, left, mirrored))
    assert len(seen) > 4 and {m for *_, m in seen} == {True, False}
    eval_latents, eval_ids = views.draw(None, pixels=pixels, time_ids=table, training=False)
    assert torch.equal(eval_ids, table)  # evaluation: the centre crop, its own time_ids

    wide = _gradient_image(tmp_path / "wide.png", 150, 90)
    table = size_crop_table([wide] * 16, 64, 1.25)
    assert table[0].tolist() == [90, 150, 8, 35, 64, 64]  # round(30 x 80 / 90) + 8 = 35
    cached = TrainingViews(64, True, square=80)
    latents, ids = cached.draw(torch.zeros(16, 4, 8, 8), torch.ones(16, 4, 8, 8), time_ids=table)
    mirrored = latents[:, 0, 0, 0] == 1
    assert 0 < int(mirrored.sum()) < 16
    expected = torch.tensor([[90, 150, 8, 133 - 35 - 64 if m else 35, 64, 64] for m in mirrored.tolist()],
                            dtype=torch.float32)
    assert torch.equal(ids, expected)


def test_conditioning_matches_what_the_sdxl_pipeline_computes(sdxl_pipeline_dir, tmp_path):
    """The training model's UNet output for concatenated prompt ids and a cropped image's time_ids
    equals the UNet called with diffusers' own `encode_prompt` and `_get_add_time_ids`."""
    from apps.diffusion.components import load_components
    from apps.diffusion.data import tokenize_all
    from apps.diffusion.recipe import build_train_model

    cfg = sd_config(tmp_path, sdxl_pipeline_dir, "validation.held_out=0")
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    assert parts.is_xl and type(parts.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    model = build_train_model(cfg, parts).eval()
    prompts = ["red apple", "grinning face"]
    ids = tokenize_all(parts.tokenizers, prompts)
    assert ids.shape == (2, 2 * 77)
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 700])
    time_ids = torch.tensor([[150, 90, 35, 8, 64, 64], [64, 64, 0, 0, 64, 64]], dtype=torch.float32)
    pipe = _xl(sdxl_pipeline_dir)
    with torch.no_grad():
        ours = model.predict(noisy, t, ids, time_ids)
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
        proj = pipe.text_encoder_2.config.projection_dim
        reference = torch.cat([pipe._get_add_time_ids((150, 90), (35, 8), (64, 64), torch.float32, proj),
                               pipe._get_add_time_ids((64, 64), (0, 0), (64, 64), torch.float32, proj)])
        theirs = pipe.unet(noisy, t, embeds, added_cond_kwargs={"text_embeds": pooled, "time_ids": reference}).sample
        uncropped = model.predict(noisy, t, ids, time_ids[[1, 1]])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert (uncropped[0] - ours[0]).abs().max() > 1e-4, "the time_ids did not reach the UNet"
    with pytest.raises(ValueError, match="time_ids"):
        model.predict(noisy, t, ids)


def test_sdxl_fine_tune_exports_a_pipeline_diffusers_opens(sdxl_pipeline_dir, tmp_path):
    from apps.diffusion.train_text_to_image import train

    cfg = sd_config(tmp_path, sdxl_pipeline_dir, "train.max_steps=2", "train.grad_accum_steps=1", "train.lr=1e-3",
                    f"data.root={EMOJI}", "data.max_images=8", "validation.held_out=4",
                    "validation.prompts=[red apple]", "data.random_crop=true", "data.random_flip=true",
                    "data.resize_scale=1.25")
    result, exported = train(cfg)
    assert result.final_step == 2 and all(map(math.isfinite, result.losses)) and "loss" in result.last_eval
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    assert not list(exported.rglob("*.py"))  # no remote code
    base, tuned = _xl(sdxl_pipeline_dir), _xl(exported)
    assert tuned.vae.config.scaling_factor == pytest.approx(0.13025)  # the SDXL VAE's own factor
    base_unet, tuned_unet = base.unet.state_dict(), tuned.unet.state_dict()
    changed = [k for k in base_unet if not torch.equal(base_unet[k], tuned_unet[k])]
    assert len(changed) > len(base_unet) // 2, f"only {len(changed)} of {len(base_unet)} UNet tensors changed"
    assert any(k.startswith("add_embedding") for k in changed)  # the size / crop / pooled embedding trained
    for name in ("text_encoder", "text_encoder_2"):  # model.train_text_encoder is off
        for k, v in getattr(base, name).state_dict().items():
            assert torch.equal(v, getattr(tuned, name).state_dict()[k]), (name, k)
    image = _image(tuned, "red apple")
    assert image.shape == (64, 64, 3) and np.abs(image - _image(base, "red apple")).max() > 1e-3


def test_sdxl_lora_on_unet_and_both_encoders_loads_back(sdxl_pipeline_dir, tmp_path):
    from safetensors.torch import load_file

    from apps.diffusion.data import tokenize_all
    from apps.diffusion.recipe import trained_model
    from apps.diffusion.train_text_to_image import train
    from apps.diffusion.train_text_to_image_lora import lora_on

    cfg = sd_config(tmp_path, sdxl_pipeline_dir, "train.max_steps=2", "train.lr=1e-2", f"data.root={EMOJI}",
                    "data.max_images=8", "validation.held_out=0", "validation.prompts=[red apple]",
                    "model.train_text_encoder=true", config=SDXL_LORA)  # the shipped config: random flip, rank 4
    lora_on(cfg)
    result, lora_dir = train(cfg)
    assert result.final_step == 2 and all(map(math.isfinite, result.losses))
    keys = load_file(str(lora_dir / "pytorch_lora_weights.safetensors")).keys()
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}

    _, model = trained_model(cfg, result.checkpoint_dir)
    pipe = _xl(sdxl_pipeline_dir)
    ids = tokenize_all([pipe.tokenizer, pipe.tokenizer_2], ["red apple", "sun"])
    torch.manual_seed(0)
    noisy, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])
    time_ids = torch.tensor([[64, 64, 0, 0, 64, 64]] * 2, dtype=torch.float32)

    def unet_output(embeds, pooled):
        return pipe.unet(noisy, t, embeds, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample

    with torch.no_grad():
        trained = model.eval().predict(noisy, t, ids, time_ids)
        before = unet_output(*pipe.encode_prompt(["red apple", "sun"], do_classifier_free_guidance=False)[::2])
        pipe.load_lora_weights(str(lora_dir))  # plain diffusers, no remote code
        embeds, _, pooled, _ = pipe.encode_prompt(["red apple", "sun"], do_classifier_free_guidance=False)
        loaded = unet_output(embeds, pooled)
        ours_embeds, ours_pooled = model.encode_prompts(ids)
    assert (trained - before).abs().max() > 1e-4, "the adapters did not change the model"
    torch.testing.assert_close(embeds, ours_embeds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, ours_pooled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-5)
    assert _image(pipe, "red apple").shape == (64, 64, 3)


def test_sdxl_refuses_dreambooth(sdxl_pipeline_dir, tmp_path):
    from apps.diffusion.train_dreambooth import train as dreambooth

    cfg = sd_config(tmp_path, sdxl_pipeline_dir, "dreambooth.with_prior_preservation=false",
                    "dreambooth.fidelity_samples=0")
    with pytest.raises(ValueError, match="DreamBooth on an SDXL"):
        dreambooth(cfg)


def test_sdxl_validation_images_with_a_bf16_unet_and_an_fp32_vae(sdxl_pipeline_dir, tmp_path):
    """The validation grid under bf16 training (UNet and both text encoders bf16, the frozen VAE
    fp32, decoding in its own dtype) draws what the fp32 model draws, up to bf16 rounding."""
    from apps.diffusion.components import load_components
    from apps.diffusion.validation import generate

    cfg = sd_config(tmp_path, sdxl_pipeline_dir, "validation.num_inference_steps=2")
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    full = np.asarray(generate(parts, ["red apple"], cfg.validation)[0], dtype=np.float32)
    for module in (parts.unet, parts.text_encoder, parts.text_encoder_2):
        module.to(torch.bfloat16)
    half = np.asarray(generate(parts, ["red apple"], cfg.validation)[0], dtype=np.float32)
    assert half.shape == full.shape == (64, 64, 3) and parts.vae.dtype == torch.float32
    assert np.abs(half - full).mean() < 8.0, np.abs(half - full).mean()  # of 255
