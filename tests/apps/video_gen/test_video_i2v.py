"""Image-to-video by first-frame conditioning (`model.i2v`, configs/tiny_i2v.yaml): the clean first
frame reaches the transformer and changes its prediction, the loss is the flow loss of frames 2..T
(a hand computation from the velocity in video layout), training lowers the held-out loss, and the
exported pipeline samples from a given first frame (which it keeps)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.testing import check, rel_diff, rounding_rtol

from video_tiny import REPO, TINY_MODEL, TINY_RUN

I2V = REPO / "apps" / "video_gen" / "configs" / "tiny_i2v.yaml"
I2V_DATA = ["data.shapes_videos=48", "data.clips_per_video=2", "data.buckets=[[8,16,16,8],[8,16,28,2]]"]


def i2v_config(output_dir, *overrides: str):
    from apps.video_gen.config import load_recipe

    return load_recipe(I2V, [*I2V_DATA, *TINY_MODEL, *TINY_RUN, f"train.output_dir={output_dir}", *overrides])


def _model(tmp_path):
    from apps.video_gen.train import build_model

    cfg = i2v_config(tmp_path, "data.caption_dropout=0.0")
    torch.manual_seed(0)
    model, tok = build_model(cfg, ["a red square moving left", "a blue circle moving up"])
    return model.eval(), tok


def test_the_first_frame_changes_the_prediction_and_only_later_frames_are_scored(tmp_path):
    from apps.video_gen.first_frame import first_frame_condition
    from apps.video_gen.text import tokenize
    from phalanx.diffusion import flow_interpolate, flow_velocity_target

    model, tok = _model(tmp_path)
    assert model.i2v and model.transformer.config.in_channels == 3 + 3 + 1 + 5  # x_t, frame, mask, planes
    g = torch.Generator().manual_seed(0)
    video, noise = torch.rand(2, 3, 8, 16, 16, generator=g) * 2 - 1, torch.randn(2, 3, 8, 16, 16, generator=g)
    other = video.clone()
    other[:, :, 0] = -other[:, :, 0]
    ids, t = tokenize(tok, ["a red square moving left", "a blue circle moving up"]), torch.tensor([0.6, 0.9])
    with torch.no_grad():
        text = model.encode_prompts(ids)
        x_t = flow_interpolate(video, noise, t)
        v = model.velocity(x_t, t, text, first_frame_condition(video, 8))
        v_other = model.velocity(x_t, t, text, first_frame_condition(other, 8))
        assert (v - v_other)[:, :, 1:].abs().max() > 1e-3      # the given frame changes the later frames' velocity
        with pytest.raises(ValueError, match="first frame"):
            model.velocity(x_t, t, text)
        got = model.per_sample_loss(video, ids, t, noise)
    want = (v - flow_velocity_target(video, noise))[:, :, 1:].pow(2).flatten(1).mean(1)  # frames 2..T only
    check(rel_diff(got, want), rounding_rtol(torch.float32, 8 * 16), "i2v loss vs frames 2..T by hand")


def test_i2v_config_errors_name_the_fix(tmp_path):
    from phalanx.config import ConfigError

    with pytest.raises(ConfigError, match="every bucket needs 2 or more frames"):
        i2v_config(tmp_path, "data.buckets=[[1,16,16,8],[8,16,16,4]]")
    with pytest.raises(ConfigError, match="data.shapes_images"):
        i2v_config(tmp_path, "data.shapes_images=8")


@pytest.mark.slow
def test_i2v_training_lowers_the_held_out_loss_and_samples_from_a_first_frame(tmp_path):
    from apps.video_gen.pipeline import VideoPipeline
    from apps.video_gen.train import train
    from phalanx.launch import launched

    cfg = i2v_config(tmp_path / "run", "train.max_steps=40", "train.lr=3e-3", "eval.max_clips=8")
    with launched(seed=cfg.train.seed):
        train(cfg)
    summary = json.loads((Path(cfg.train.output_dir) / "summary.json").read_text())
    assert summary["final"]["loss"] < 0.8 * summary["initial"]["loss"], summary   # frames 2..T, held out
    pipe = VideoPipeline.from_pretrained(cfg.final_path)
    assert pipe.meta["i2v"] and "first-frame conditioning" in " ".join(pipe.meta["wan_pipeline_blockers"])
    first = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)) * 2 - 1
    clips = pipe(["a red square moving left"] * 2, seed=0, steps=4, first_frame=first)
    torch.testing.assert_close(clips[:, :, 0], first.clamp(-1, 1))       # the given frame is kept
    flipped = pipe(["a red square moving left"] * 2, seed=0, steps=4, first_frame=-first)
    assert (clips[:, :, 1:] - flipped[:, :, 1:]).abs().max() > 1e-3     # and conditions the rest
    with pytest.raises(ValueError, match="first_frame"):
        pipe(["a red square moving left"], seed=0, steps=2)
