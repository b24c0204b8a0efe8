"""Data: the moving-shapes generator and the motion check, real clips decoded from the shipped
files, buckets, and clear errors for bad input (unreadable video, wrong caption file, impossible
bucket configuration)."""
from __future__ import annotations

import json

import pytest
import torch

from apps.video_gen.clips import VideoDataError, load_clips, read_captions
from apps.video_gen.config import resolve
from apps.video_gen.motion import motion_prompts, motion_score, track
from apps.video_gen.shapes import COLOURS, DIRECTIONS, moving_shapes


def test_shapes_are_deterministic_and_their_motion_is_checkable():
    a, b = moving_shapes(64, 8, 16, seed=1), moving_shapes(64, 8, 16, seed=1)
    assert all(torch.equal(x.video, y.video) and x.caption == y.caption for x, y in zip(a, b, strict=True))
    assert {c.direction for c in a} == set(DIRECTIONS) and {c.colour for c in a} == set(COLOURS)
    assert a[0].caption == f"a {a[0].colour} {a[0].shape} moving {a[0].direction}"
    assert a[0].video.shape == (3, 8, 16, 16) and a[0].video.min() == -1 and a[0].video.max() == 1
    # the tracker reads every generated clip right ...
    score = motion_score([c.video for c in a], [c.colour for c in a], [c.direction for c in a])
    assert score["motion_both"] == 1.0
    # ... and rejects the wrong direction, the wrong colour, time reversed, and noise
    flipped = {"left": "right", "right": "left", "up": "down", "down": "up"}
    assert motion_score([c.video for c in a], [c.colour for c in a], [flipped[c.direction] for c in a])[
        "motion_direction"] == 0.0
    assert motion_score([c.video.flip(1) for c in a], [c.colour for c in a], [c.direction for c in a])[
        "motion_direction"] == 0.0
    noise = [torch.rand(3, 8, 16, 16) * 2 - 1 for _ in range(32)]
    assert motion_score(noise, [c.colour for c in a[:32]], [c.direction for c in a[:32]])["motion_both"] < 0.3
    assert track(torch.full((3, 8, 16, 16), -1.0)) == (None, None, 0.0)
    prompts = motion_prompts(50)
    assert len(prompts) == 50 and len({p for p, _, _ in prompts}) == 32  # every combination, then repeats


def test_real_clips_decode_into_fixed_length_clips():
    clips = load_clips(resolve("apps/video_gen/data/clips"), frames=8, stride=2, height=16, per_video=3)
    assert len(clips) == 9
    video, caption = clips[0]
    assert video.shape == (3, 8, 16, 28) and -1 <= float(video.min()) < float(video.max()) <= 1
    assert caption == "a cartoon landscape with a pink sky and green trees"
    assert not torch.equal(clips[0][0], clips[1][0])  # cut from different times


def test_bad_video_and_caption_files_are_named(tmp_path):
    with pytest.raises(VideoDataError, match="captions.jsonl not found"):
        read_captions(tmp_path)
    (tmp_path / "captions.jsonl").write_text('{"file": "a.mp4", "text": "x"\n')
    with pytest.raises(VideoDataError, match="line 1 is not JSON"):
        read_captions(tmp_path)
    (tmp_path / "captions.jsonl").write_text(json.dumps({"file": "a.mp4", "caption": "x"}) + "\n")
    with pytest.raises(VideoDataError, match="non-empty string 'text'"):
        read_captions(tmp_path)
    (tmp_path / "captions.jsonl").write_text(json.dumps({"file": "a.mp4", "text": "x"}) + "\n")
    with pytest.raises(VideoDataError, match="names 'a.mp4', which is not in"):
        read_captions(tmp_path)
    (tmp_path / "a.mp4").write_bytes(b"this is not a video")
    with pytest.raises(VideoDataError, match="cannot decode video .*a.mp4.*Re-encode"):
        load_clips(tmp_path, 8, 1, 16, 2)
    with pytest.raises(VideoDataError, match="fewer than data.clip_frames=500"):
        load_clips(resolve("apps/video_gen/data/clips"), 500, 1, 16, 2)


def test_impossible_buckets_stop_before_training(tmp_path):
    from phalanx.config import ConfigError
    from phalanx.data.buckets import BucketConfigError

    from apps.video_gen.train import prepare
    from video_tiny import tiny_config

    cfg = tiny_config(tmp_path, "data.clips_dir=null", "data.buckets=[[1,16,16,64],[8,16,16,64]]")
    with pytest.raises(BucketConfigError, match="yields no batch.*lower the buckets' batch sizes"):
        prepare(cfg)
    cfg = tiny_config(tmp_path, "data.clips_dir=null", "data.buckets=[[16,16,16,2]]")
    with pytest.raises(BucketConfigError, match="no held-out clip fits any bucket"):
        prepare(cfg)
    with pytest.raises(ConfigError, match="not divisible by model.patch_size"):
        tiny_config(tmp_path, "data.buckets=[[8,16,18,2]]")


def test_direction_gap_pairs_each_clip_with_its_true_and_opposite_word():
    """The issue-16 diagnostic: a stand-in model whose loss is 1 when the prompt's direction word is
    the clip's tracked motion and 2 otherwise gives a gap of exactly 1; one that ignores the prompt, 0."""
    from apps.video_gen.sensitivity import direction_gap, with_opposite_direction
    from apps.video_gen.text import build_tokenizer

    tok = build_tokenizer([f"a red square moving {d}" for d in ("left", "right", "up", "down")], 12)
    word_of = {tok.convert_tokens_to_ids(d): d for d in ("left", "right", "up", "down")}

    class ReadsTheWord:
        device = torch.device("cpu")  # where direction_gap puts the clips, ids and noise

        def per_sample_loss(self, video, ids, t, noise):
            said = [next(word_of[i] for i in row.tolist() if i in word_of) for row in ids]
            return torch.tensor([1.0 if track(v)[1] == d else 2.0 for v, d in zip(video, said, strict=True)])

    class IgnoresTheWord:
        device = torch.device("cpu")

        def per_sample_loss(self, video, ids, t, noise):
            return (video - noise).pow(2).flatten(1).mean(1) * (1 + t)

    gap = direction_gap(ReadsTheWord(), tok, frames=8, size=16, clips=12, timesteps=(0.5, 0.9))
    assert gap == {"direction_gap/t=0.5": 1.0, "direction_gap/t=0.9": 1.0}
    assert direction_gap(IgnoresTheWord(), tok, frames=8, size=16, clips=12) == {
        "direction_gap/t=0.8": 0.0, "direction_gap/t=0.95": 0.0}
    assert with_opposite_direction("a red square moving up", "up") == "a red square moving down"
    with pytest.raises(ValueError, match="does not end with its direction"):
        with_opposite_direction("a red square", "up")


def test_training_batches_pair_each_caption_with_its_clips_motion(tmp_path):
    """Issue 16's first suspect: the batches `fit` trains on (buckets, tokenized, grouped, stacked)
    show, for every moving-shapes clip, the colour and the direction its caption names (centroid
    tracking of the batch's video against the decoded prompt ids)."""
    from video_tiny import tiny_config

    from apps.video_gen.data import BucketedClips, load_all_clips, training_batches
    from apps.video_gen.text import build_tokenizer

    cfg = tiny_config(tmp_path, "data.clips_dir=null")
    train, held = load_all_clips(cfg.data)
    tok = build_tokenizer([c.caption for c in train + held], cfg.data.max_prompt_tokens)
    batches = training_batches(BucketedClips(train, cfg.buckets, tok), seed=0)
    checked = 0
    for k in range(len(batches)):
        batch = batches[k]
        captions = tok.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
        for video, caption in zip(batch["video"], captions, strict=True):
            words = caption.split()           # "a <colour> <shape> [moving <direction>]"
            colour, direction, travel = track(video)
            assert colour == words[1], caption
            if video.shape[1] > 1:
                assert words[3] == "moving" and direction == words[4] and travel > 3, (caption, direction, travel)
                checked += 1
    videos = sum(1 for c in train if c.video.shape[1] > 1)
    assert checked > 10 and 0 <= videos - checked < 4   # whole batches of 4: at most a remainder left out
