"""apps.video_gen.motion_probe: the word-sensitivity probe by construction (a model whose text encoder cannot
tell "left" from "right" shows no direction change, but a colour change), and the short training probe keeps
the held-out triples out and reports the direction gap of its EMA weights. Both run on the accelerator when
there is one: `PHALANX_EMULATE_GPU=1 pytest tests/apps/video_gen/test_motion_probe.py` runs them on the emulated GPU."""
from __future__ import annotations

import torch

from apps.video_gen.motion_probe import train_probe, word_sensitivity
from apps.video_gen.shapes import HELD_OUT_COMBOS, caption_for

from video_tiny import captions, tiny_config


def test_word_sensitivity_sees_a_direction_word_only_where_the_model_can_tell_it(tmp_path):
    from apps.video_gen.train import build_model
    from phalanx.device import current_device

    model, tok = build_model(tiny_config(tmp_path / "run"), captions())
    model.to(current_device()).eval()             # the accelerator when there is one (PHALANX_EMULATE_GPU=1 too)
    out = word_sensitivity(model, tok, frames=8, size=16, timesteps=(0.8,))
    assert out["text_state_change/direction"] > 0.1 and out["velocity_change/direction/t=0.8"] > 1e-4
    assert out["velocity_change/colour/t=0.8"] > 1e-4 and out["velocity_change/prompt/t=0.8"] > 1e-4
    emb = model.text_encoder.get_input_embeddings().weight
    with torch.no_grad():      # "right" embedded as "left": the encoder, and so the transformer, cannot tell them apart
        emb[tok.convert_tokens_to_ids("right")] = emb[tok.convert_tokens_to_ids("left")]
    blind = word_sensitivity(model, tok, frames=8, size=16, timesteps=(0.8,))
    assert blind["text_state_change/direction"] == 0.0 and blind["velocity_change/direction/t=0.8"] == 0.0
    assert blind["velocity_change/colour/t=0.8"] == out["velocity_change/colour/t=0.8"] > 1e-4


def test_train_probe_leaves_the_held_out_triples_out_and_reports_the_gap(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    out = train_probe(cfg, steps=2, batch=2, every=1, motion_samples=0, clips=200, log=lambda _: None)
    assert [s for s, _ in out["gaps"]] == [1, 2]
    assert set(out["gaps"][-1][1]) == {"direction_gap/t=0.8", "direction_gap/t=0.95"}
    held = {caption_for(*c) for c in HELD_OUT_COMBOS}
    assert len(out["trained_captions"]) == 24 and not held & set(out["trained_captions"])
    assert "velocity_change/direction/t=0.95" in out["words"]
