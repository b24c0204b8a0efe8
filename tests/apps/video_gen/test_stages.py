"""Stage configs that chain (`model.init_from`): the next stage keeps the saved pipeline's flow
settings, or with model.init_flow=config takes its own, printing each setting that differs; the
export records the settings the stage trained with."""
from __future__ import annotations

import json
from dataclasses import replace

from video_tiny import tiny_config


def _saved_stage(tmp_path):
    from apps.video_gen import train as vtrain
    from apps.video_gen.pipeline import VideoPipeline, make_meta
    from apps.video_gen.shapes import COLOURS, DIRECTIONS, SHAPES, caption_for

    cfg = tiny_config(tmp_path / "stage1", "flow.logit_std=0.7", "flow.max_shift=2.0")
    captions = [caption_for(c, s, d) for c in COLOURS for s in SHAPES for d in [None, *DIRECTIONS]]
    model, tok = vtrain.build_model(cfg, captions)
    VideoPipeline(model, tok, make_meta(model.fcfg, 3, 8, 16, 16)).save_pretrained(tmp_path / "pipe")
    return cfg.flow


def test_init_from_keeps_or_overrides_the_saved_flow_settings_and_says_what_changed(tmp_path, monkeypatch):
    from apps.video_gen import train as vtrain

    saved = _saved_stage(tmp_path)
    said: list[str] = []
    monkeypatch.setattr(vtrain.log, "info", said.append)
    stage2 = [f"model.init_from={tmp_path / 'pipe'}", "flow.logit_std=1.5"]     # max_shift: back to the default 3.0

    cfg = tiny_config(tmp_path / "keep", *stage2)
    model, _ = vtrain.build_model(cfg, [])
    assert model.fcfg == saved == cfg.flow and model.fcfg.logit_std == 0.7 and model.fcfg.max_shift == 2.0
    assert len(said) == 1 and "init_flow=keep" in said[0] and "ignored" in said[0]
    assert "flow.logit_std: 0.7 -> 1.5" in said[0] and "flow.max_shift: 2.0 -> 3.0" in said[0]

    said.clear()
    cfg = tiny_config(tmp_path / "config", *stage2, "model.init_flow=config")
    model, _ = vtrain.build_model(cfg, [])
    assert model.fcfg == replace(saved, logit_std=1.5, max_shift=3.0) == cfg.flow
    assert len(said) == 1 and "init_flow=config" in said[0] and "flow.logit_std: 0.7 -> 1.5" in said[0]

    said.clear()
    same = tiny_config(tmp_path / "same", f"model.init_from={tmp_path / 'pipe'}", "flow.logit_std=0.7",
                       "flow.max_shift=2.0")
    assert vtrain.build_model(same, [])[0].fcfg == saved and not said   # nothing differs: nothing printed


def test_the_chained_stage_exports_the_flow_settings_it_trained_with(tmp_path):
    from apps.video_gen.train import train

    saved = _saved_stage(tmp_path)
    cfg = tiny_config(tmp_path / "run", f"model.init_from={tmp_path / 'pipe'}", "data.clips_dir=null",
                      "train.max_steps=1", "eval.timesteps=1")
    assert cfg.flow.logit_std == 1.0                                      # what the config file says ...
    train(cfg)
    meta = json.loads((cfg.final_path / "video_gen.json").read_text())
    assert meta["flow"]["logit_std"] == saved.logit_std == 0.7 and meta["flow"]["max_shift"] == 2.0   # ... kept
