"""Pretrained starts and diffusers exports: tiny random diffusers Wan parts (WanTransformer3DModel,
AutoencoderKLWan) and a tiny T5 saved with save_pretrained in a Wan pipeline layout; a 2-step
fine-tune from them whose first loss equals the loss of the saved weights computed by hand with
diffusers' own transformer forward; the plain model's export opens in diffusers' WanPipeline (no
custom code) and samples the same clip as the recipe's sampler for a seed; toy-module models are
exported in the recipe's own layout, with what blocks WanPipeline listed."""
from __future__ import annotations

import json

import pytest
import torch

from video_tiny import captions as _captions
from video_tiny import save_wan_parts as _save_wan_parts
from video_tiny import REPO, TINY_MODEL, TINY_RUN, tiny_config

PLAIN = ["model.position_channels=false", "model.motion_channels=false", "model.pooled_text=false",
         "model.prompt_position=false", "flow.skip_data_std=0.0", "model.patch_size=[1,2,2]", "eval.sampler=scheduler"]
PLANES = ["model.position_channels=true", "model.motion_channels=true", "model.pooled_text=flat",
          "model.prompt_position=true"]                          # configs/tiny_planes.yaml's toy modules
LATENT_DATA = ["data.shapes_frames=9", "data.clip_frames=9", "data.clips_dir=null", "data.shapes_videos=12",
               "data.shapes_images=8", "data.buckets=[[1,16,16,8],[9,16,16,4]]", "data.caption_dropout=0.0"]


def _wan_clip(directory, prompt: str, seed: int, steps: int, guidance: float) -> torch.Tensor:
    """diffusers' WanPipeline on the export, as a [1, 3, F, H, W] clip in [-1, 1]."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(directory))
    out = pipe(prompt=prompt, num_frames=9, height=16, width=16, num_inference_steps=steps, guidance_scale=guidance,
               generator=torch.Generator().manual_seed(seed), max_sequence_length=12, output_type="pt").frames
    return out.permute(0, 2, 1, 3, 4) * 2 - 1


def test_the_plain_latent_export_opens_in_wan_pipeline_and_samples_the_same_clip(tmp_path):
    from diffusers import WanPipeline

    from apps.video_gen.config import FlowConfig
    from apps.video_gen.model import VideoFlowModel
    from apps.video_gen.pipeline import VideoPipeline, make_meta
    from apps.video_gen.text import tokenize
    from phalanx.diffusion import resolution_shift

    transformer, vae, t5, tok = _save_wan_parts(tmp_path / "parts")
    torch.nn.init.normal_(transformer.proj_out.weight, std=0.2)       # a velocity that moves the sample
    model = VideoFlowModel(transformer, t5, tokenize(tok, [""])[0], tok.pad_token_id, FlowConfig())
    pipe = VideoPipeline(model, tok, make_meta(model.fcfg, 4, 9, 16, 16, vae), vae)
    pipe.save_pretrained(tmp_path / "export")

    assert json.loads((tmp_path / "export" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    wan = WanPipeline.from_pretrained(str(tmp_path / "export"))
    shift = resolution_shift(5 * 8 * 8 // 4, 64, 3.0)                # 9 x 16 x 16 -> 5 x 8 x 8 latents, patch 1x2x2
    assert wan.scheduler.config.shift == pytest.approx(shift) and shift > 1.1
    ours = VideoPipeline.from_pretrained(tmp_path / "export")(["a red square moving left"], seed=3, steps=4,
                                                              guidance=2.0)
    theirs = _wan_clip(tmp_path / "export", "a red square moving left", seed=3, steps=4, guidance=2.0)
    assert ours.shape == theirs.shape == (1, 3, 9, 16, 16)
    assert ours.std() > 0.01 and torch.allclose(ours, theirs, atol=1e-5)
    other = VideoPipeline.from_pretrained(tmp_path / "export")(["a blue circle moving up"], seed=3, steps=4)
    assert (other - theirs).abs().max() > 1e-3                        # the comparison can tell prompts apart


@pytest.mark.slow
def test_tiny_wan_yaml_exports_a_wan_pipeline(tmp_path):
    """The shipped config whose export is a WanPipeline (configs/tiny_wan.yaml: plain Wan, latent space, no velocity
    skip, the scheduler's grid), run as written except for a tiny random autoencoder, tiny sizes and 3 steps."""
    from apps.video_gen.config import load_recipe
    from apps.video_gen.pipeline import VideoPipeline
    from apps.video_gen.train import train

    _save_wan_parts(tmp_path / "wan")
    cfg = load_recipe(REPO / "apps" / "video_gen" / "configs" / "tiny_wan.yaml",
                      [*TINY_MODEL, *TINY_RUN, *LATENT_DATA, f"vae.from_dir={tmp_path / 'wan' / 'vae'}",
                       f"train.output_dir={tmp_path / 'run'}"])
    train(cfg)
    meta = json.loads((cfg.final_path / "video_gen.json").read_text())
    assert meta["wan_pipeline_blockers"] == []
    assert json.loads((cfg.final_path / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    ours = VideoPipeline.from_pretrained(cfg.final_path)(["a red square moving left"], seed=2, steps=3)
    theirs = _wan_clip(cfg.final_path, "a red square moving left", 2, 3, 2.0)
    assert ours.shape == theirs.shape == (1, 3, 9, 16, 16) and torch.allclose(ours, theirs, atol=1e-5)


def test_toy_module_exports_keep_the_recipes_layout_and_say_what_blocks_wan_pipeline(tmp_path):
    from apps.video_gen.pipeline import VideoPipeline, make_meta
    from apps.video_gen.train import build_model

    model, tok = build_model(tiny_config(tmp_path / "run", *PLANES), _captions())   # planes, pooled text, skip
    VideoPipeline(model, tok, make_meta(model.fcfg, 3, 8, 16, 16, sampler="linear")).save_pretrained(tmp_path / "x")
    index = json.loads((tmp_path / "x" / "model_index.json").read_text())
    blockers = json.loads((tmp_path / "x" / "video_gen.json").read_text())["wan_pipeline_blockers"]
    assert index["_class_name"].startswith("VideoGenPipeline") and "pooled_text" in index
    assert len(blockers) == 6 and any("position-plane" in b for b in blockers) and any("pixel" in b for b in blockers)
    assert not model.zero_padding                                    # CLIP + pooled text: padding kept, as measured


def test_a_mismatched_pretrained_transformer_gets_one_clear_error(tmp_path):
    from phalanx.config import ConfigError

    from apps.video_gen.train import prepare

    _save_wan_parts(tmp_path / "wan")
    cfg = tiny_config(tmp_path / "run", *PLAIN, *LATENT_DATA, f"model.transformer_dir={tmp_path / 'wan'}",
                      f"vae.from_dir={tmp_path / 'wan'}")                  # no T5: the from-scratch CLIP (32 dims)
    with pytest.raises(ConfigError, match=r"'model.transformer_dir'.*24 dims.*gives 32.*model.text_encoder_dir"):
        prepare(cfg)
    wan = tmp_path / "wan"
    cfg = tiny_config(tmp_path / "run", *PLAIN, *LATENT_DATA, f"model.transformer_dir={wan}",
                      f"model.text_encoder_dir={wan}", f"vae.from_dir={wan}", "model.patch_size=[1,1,1]")
    with pytest.raises(ConfigError, match=r"'model.transformer_dir'.*patch size is \[1, 2, 2\].*model.patch_size="):
        prepare(cfg)
    with pytest.raises(ConfigError, match=r"'model.transformer_dir'.*init_from already brings its transformer"):
        tiny_config(tmp_path / "run", f"model.transformer_dir={wan}", f"model.init_from={wan}")
    with pytest.raises(ConfigError, match=r"'eval.sampler'='euler'.*scheduler.*linear"):
        tiny_config(tmp_path / "run", "eval.sampler=euler")


def test_a_fine_tune_from_diffusers_wan_parts_starts_from_their_weights_and_exports_a_wan_pipeline(tmp_path,
                                                                                                    monkeypatch):
    from diffusers import WanTransformer3DModel
    from transformers import T5EncoderModel

    from apps.video_gen import train as vtrain
    from apps.video_gen.pipeline import VideoPipeline

    tok = _save_wan_parts(tmp_path / "wan")[3]
    wan = str(tmp_path / "wan")
    cfg = tiny_config(tmp_path / "run", *PLAIN, *LATENT_DATA, f"model.transformer_dir={wan}",
                      f"model.text_encoder_dir={wan}", f"vae.from_dir={wan}", "train.max_steps=2", "eval.timesteps=1")
    seen = []

    def fixed_loss(model, batch):       # fixed t and noise, so the first loss can be recomputed by hand
        g = torch.Generator().manual_seed(len(seen))
        t, noise = torch.rand(len(batch["video"]), generator=g), torch.randn(batch["video"].shape, generator=g)
        seen.append((batch["video"].clone(), batch["prompt_ids"].clone(), t, noise))
        return model(batch["video"], batch["prompt_ids"], t, noise)

    monkeypatch.setattr(vtrain, "batch_loss", fixed_loss)
    result = vtrain.train(cfg)

    x0, ids, t, noise = seen[0]
    transformer = WanTransformer3DModel.from_pretrained(str(tmp_path / "wan" / "transformer"))
    t5 = T5EncoderModel.from_pretrained(str(tmp_path / "wan" / "text_encoder"))
    mask = (ids != tok.pad_token_id).long()
    with torch.no_grad():
        text = t5(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
        x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
        v = transformer(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=text, return_dict=False)[0]
    by_hand = float((v - (noise - x0)).pow(2).mean())
    assert result.losses[0] == pytest.approx(by_hand, rel=1e-5)
    assert json.loads((cfg.final_path / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    ours = VideoPipeline.from_pretrained(cfg.final_path)(["a red square moving left"], seed=1, steps=3)
    assert torch.allclose(ours, _wan_clip(cfg.final_path, "a red square moving left", 1, 3, 2.0), atol=1e-5)


def test_attention_pooled_text_is_sized_independently_of_the_prompt_length(tmp_path):
    from apps.video_gen.model import PooledTextConditioning
    from apps.video_gen.text import tokenize
    from apps.video_gen.train import build_model, build_pooled_text

    def count(kind: str, tokens: int) -> int:
        cfg = tiny_config(tmp_path / "run", f"model.pooled_text={kind}", f"data.max_prompt_tokens={tokens}")
        return sum(p.numel() for p in build_pooled_text(cfg, 32, 64).parameters())

    assert count("attention", 12) == count("attention", 48) < count("flat", 12) < count("flat", 48)
    torch.manual_seed(0)
    module = PooledTextConditioning(8, 16, queries=3)
    states = torch.randn(2, 5, 8)
    by_hand = torch.stack([torch.cat([torch.softmax(states[b] @ q / 8 ** 0.5, dim=0) @ states[b]
                                      for q in module.query]) for b in range(2)])
    assert torch.allclose(module.pool(states), by_hand, atol=1e-6)
    module.save_pretrained(str(tmp_path / "pooled"))
    assert torch.equal(PooledTextConditioning.from_pretrained(str(tmp_path / "pooled"))(states), module(states))
    model, tok = build_model(tiny_config(tmp_path / "m", "model.pooled_text=attention"), _captions())
    assert model.pooled_text.query.shape == (4, 32)                   # model.pooled_text_queries x text_hidden_size
    video, ids = torch.randn(2, 3, 8, 16, 16), tokenize(tok, ["a red square moving left", "a blue circle"])
    model(video, ids).backward()
    assert model.pooled_text.query.grad.abs().sum() > 0               # the queries train
