"""Issue 39 item 3: the motion check on caption combinations never trained on, and its scorer.

- The held-out (colour, shape, direction) triples of `shapes.HELD_OUT_COMBOS` never reach training:
  checked on the batches the trainer builds (`train.prepare`), decoded back to captions; with
  `data.held_out_combos=false` they do appear (so the check can fail).
- The tracker scores hand-drawn clips right: a square moving left is "left", and so on.
- The 95% Wilson interval against textbook values.
"""
from __future__ import annotations

import pytest
import torch

from apps.video_gen.motion import combos_for, motion_prompts, motion_score, track, wilson_interval
from apps.video_gen.shapes import COLOURS, DIRECTIONS, HELD_OUT_COMBOS, SHAPES, caption_for

from video_tiny import tiny_config


def training_captions(cfg) -> set[str]:
    """Every caption in the batches `fit` would draw, decoded from their token ids."""
    from apps.video_gen.train import prepare

    _, tokenizer, batches, _, _ = prepare(cfg)
    out = set()
    for i in range(len(batches)):
        ids = batches[i]["prompt_ids"]
        out |= {s.strip() for s in tokenizer.batch_decode(ids, skip_special_tokens=True)}
    return out


def test_held_out_combinations_never_appear_in_the_training_batches(tmp_path):
    held = {caption_for(*c) for c in HELD_OUT_COMBOS}
    assert len(held) == 8
    # every colour, shape and direction word still occurs in training, in other combinations
    assert {c for c, _, _ in HELD_OUT_COMBOS} == set(COLOURS) and {d for *_, d in HELD_OUT_COMBOS} == set(DIRECTIONS)
    cfg = tiny_config(tmp_path / "on", "data.shapes_videos=200", "data.clips_dir=null", "data.held_out_combos=true")
    seen = training_captions(cfg)
    moving = {s for s in seen if " moving " in s}
    assert moving and not moving & held
    assert moving == {caption_for(*c) for c in combos_for("trained")}  # the 24 others all occur at 200 clips
    off = training_captions(tiny_config(tmp_path / "off", "data.shapes_videos=200", "data.clips_dir=null",
                                      "data.held_out_combos=false"))
    assert off & held, "without data.held_out_combos the held-out triples are trained on"


def test_prompt_splits_partition_the_combinations():
    held, trained = combos_for("held_out"), combos_for("trained")
    assert set(held) == set(HELD_OUT_COMBOS) and not set(held) & set(trained)
    assert len(held) + len(trained) == len(COLOURS) * len(SHAPES) * len(DIRECTIONS)
    prompts = motion_prompts(64, seed=0, split="held_out")
    assert len(prompts) == 64 and {p for p, _, _ in prompts} == {caption_for(*c) for c in HELD_OUT_COMBOS}
    assert all(p.count(" ") == 4 and p.split()[1] == c and p.split()[-1] == d for p, c, d in prompts)
    with pytest.raises(ValueError, match="held_out"):
        combos_for("heldout")


def square_clip(colour: str, rows: list[int], cols: list[int], half: int = 1, size: int = 16) -> torch.Tensor:
    """A hand-drawn clip [3, F, H, W]: black, a (2 half + 1)-pixel square of `colour` centred at (rows[f], cols[f])."""
    video = torch.full((3, len(rows), size, size), -1.0)
    rgb = torch.tensor(COLOURS[colour])
    for f, (r, c) in enumerate(zip(rows, cols)):
        video[:, f, r - half:r + half + 1, c - half:c + half + 1] = rgb.view(3, 1, 1)
    return video


@pytest.mark.parametrize("colour,direction,rows,cols", [
    ("red", "left", [8] * 8, [13, 12, 11, 10, 8, 7, 5, 3]),
    ("green", "right", [5] * 8, [2, 3, 4, 6, 7, 9, 10, 12]),
    ("blue", "up", [13, 12, 11, 9, 8, 6, 5, 3], [7] * 8),
    ("yellow", "down", [2, 3, 5, 6, 8, 9, 11, 13], [10] * 8),
])
def test_the_scorer_reads_hand_drawn_clips(colour, direction, rows, cols):
    clip = square_clip(colour, rows, cols)
    got_colour, got_direction, travel = track(clip)
    assert (got_colour, got_direction) == (colour, direction)
    assert travel == pytest.approx(abs((sum(rows[-2:]) - sum(rows[:2])) / 2 + (sum(cols[-2:]) - sum(cols[:2])) / 2))
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}[direction]
    wrong_colour = next(c for c in COLOURS if c != colour)
    assert motion_score([clip], [colour], [direction])["motion_both"] == 1.0
    assert motion_score([clip], [colour], [opposite])["motion_both"] == 0.0
    assert motion_score([clip], [wrong_colour], [direction])["motion_both"] == 0.0
    assert motion_score([clip.flip(1)], [colour], [direction])["motion_direction"] == 0.0   # played backwards
    still = square_clip(colour, [rows[0]] * 8, [cols[0]] * 8)
    assert motion_score([still], [colour], [direction])["motion_direction"] == 0.0        # no travel: not moving
    assert track(torch.full((3, 8, 16, 16), -1.0)) == (None, None, 0.0)


def test_wilson_interval_matches_textbook_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    lo, hi = wilson_interval(45, 64)
    assert lo < 45 / 64 < hi and hi - lo < 0.25


@pytest.mark.parametrize("decay", [0.5, pytest.param(0.0, marks=pytest.mark.slow)])
def test_evaluation_and_export_use_the_ema_weights(tmp_path, decay):
    """`eval.ema_decay`: the held-out loss `fit` reports is that of the averaged weights, and the export holds
    them (equal to the checkpoint's ema/ file, not to its trained model/ weights); with 0 the trained ones."""
    import json

    from safetensors.torch import load_file

    from phalanx.checkpoint.hf import load_hf_state_dict
    from apps.video_gen.pipeline import VideoPipeline
    from apps.video_gen.train import heldout_flow_loss, prepare, train

    cfg = tiny_config(tmp_path / "run", "data.clips_dir=null", "data.buckets=[[1,16,16,8],[8,16,16,4]]",
                      "train.lr=3e-3", f"eval.ema_decay={decay}")
    result = train(cfg)
    exported = VideoPipeline.from_pretrained(cfg.final_path).model
    trained = load_hf_state_dict(result.checkpoint_dir / "model")
    name = "transformer.proj_out.weight"
    if decay:
        averaged = load_file(str(result.checkpoint_dir / "ema" / "ema.safetensors"))
        assert torch.equal(exported.state_dict()[name], averaged[name].to(exported.state_dict()[name].dtype))
        assert not torch.allclose(averaged[name], trained[name])
    else:
        assert not (result.checkpoint_dir / "ema").exists()
        assert torch.equal(exported.state_dict()[name], trained[name])
    _, _, _, held, _ = prepare(cfg)
    reported = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]["loss"]
    again = heldout_flow_loss(exported.eval(), held, cfg.eval.timesteps, cfg.eval.max_clips, cfg.eval.seed)["loss"]
    assert again == pytest.approx(reported, rel=1e-6)
