"""The manifest data path (`apps/video_gen/manifest.py`): CSV / JSONL / parquet in Open-Sora's layout,
captions (one or several), score filters, sizes probed from the files, the held-out split by video,
temporal sampling (stride, offset) and the aspect crop against hand-computed frames, memory that
holds metadata only, and `configs/real_clips.yaml` (real clips only) trained tiny."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from apps.video_gen.clips import VideoDataError, decode_video
from apps.video_gen.config import resolve
from apps.video_gen.manifest import (ManifestBatches, crop_box, fill_sizes, frame_indices, held_out_rows,
                                     load_clip, read_manifest, temporal_offset)
from phalanx.data.buckets import Bucket

CLIPS = resolve("apps/video_gen/data/clips")
BUNNY = str(CLIPS / "big_buck_bunny_2s_64px.mp4")        # 48 frames of 36x64 at 24 fps
FILES = ["big_buck_bunny_2s_64px.mp4", "sintel_2s_64px.mp4", "chaplin_64px.mp4"]
ROWS = [{"path": FILES[0], "text": ["a pink sky", "green trees"], "aes": 5.0},
        {"path": FILES[1], "text": "a snowy storm", "aes": 3.0},
        {"path": str(CLIPS / FILES[2]), "text": "two men on a street", "aes": 6.0}]


def _write(path, rows, sizes=False):
    """The rows as CSV (captions lists as JSON strings, as Open-Sora's tools write them), JSONL or parquet."""
    rows = [dict(r, **({"num_frames": 48, "height": 36, "width": 64, "fps": 24.0} if sizes else {})) for r in rows]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        import csv

        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows])
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([dict(r, text=r["text"] if isinstance(r["text"], list) else [r["text"]])
                                             for r in rows]), str(path))
    return path


def _full(path: str) -> np.ndarray:
    return decode_video(path, 1)  # every frame, uint8 [F, H, W, 3]


def _expected(frames: np.ndarray, indices: list[int], box: tuple[int, int, int, int], bucket: Bucket) -> torch.Tensor:
    top, left, ch, cw = box
    x = torch.from_numpy(np.ascontiguousarray(frames[indices, top:top + ch, left:left + cw])).permute(0, 3, 1, 2)
    x = F.interpolate(x.float() / 127.5 - 1, size=(bucket.height, bucket.width), mode="area")
    return x.transpose(0, 1)


def test_stride_offset_and_crop_against_hand_computed_frames():
    assert frame_indices(48, 8, 2, 5) == [5, 7, 9, 11, 13, 15, 17, 19]
    with pytest.raises(ValueError):
        frame_indices(48, 8, 2, 34)                      # 34 + 7 x 2 = 48: one past the last frame
    assert temporal_offset(48, 8, 2, rand=False) == 16   # 48 - 15 = 33 free starts after 0: centre 16
    torch.manual_seed(0)
    offsets = {temporal_offset(48, 8, 2, rand=True) for _ in range(3000)}
    assert offsets == set(range(34))                     # every start that fits, and only those
    assert crop_box(36, 64, 16, 16, rand=False) == (0, 14, 36, 36)   # square from 16:9: the sides cut
    assert crop_box(36, 64, 16, 28, rand=False) == (0, 0, 36, 63)    # 28/16 x 36 = 63 columns
    assert crop_box(64, 36, 16, 28, rand=False) == (21, 0, 21, 36)   # tall: 36 x 16/28 = 20.6 -> 21 rows
    boxes = {crop_box(36, 64, 16, 16, rand=True) for _ in range(500)}
    assert {b[1] for b in boxes} == set(range(29)) and {b[0] for b in boxes} == {0}

    full, bucket = _full(BUNNY), Bucket(8, 16, 16, 1)
    centred = load_clip(BUNNY, 48, bucket, 2, random_offset=False, random_crop=False)
    assert torch.allclose(centred, _expected(full, list(range(16, 31, 2)), (0, 14, 36, 36), bucket), atol=1e-6)
    # a random offset: exactly one of the 34 possible starts, with the stride kept
    torch.manual_seed(3)
    drawn = load_clip(BUNNY, 48, bucket, 3, random_offset=True, random_crop=False)
    matches = [o for o in range(48 - 21) if torch.allclose(
        drawn, _expected(full, frame_indices(48, 8, 3, o), (0, 14, 36, 36), bucket), atol=1e-6)]
    assert len(matches) == 1
    torch.manual_seed(3)
    assert temporal_offset(48, 8, 3, rand=True) == matches[0]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_manifest_formats_captions_filters_and_probed_sizes(tmp_path, suffix):
    m = read_manifest(_write(tmp_path / f"m{suffix}", ROWS), root=CLIPS, min_aesthetic=4.0)
    assert len(m) == 2 and m.dropped == 1                # the aes 3.0 row left out
    assert m.paths[0] == str(CLIPS / FILES[0]) and m.paths[1] == str(CLIPS / FILES[2])  # relative to a root
    assert m.captions_of(0) == ["a pink sky", "green trees"] and m.captions_of(1) == ["two men on a street"]
    assert (m.frames == -1).all() and fill_sizes(m) == 2  # no size columns: read from the two files' headers
    assert m.frames.tolist() == [48, 100] and m.height.tolist() == [36, 36] and m.width.tolist() == [64, 64]
    assert m.fps.tolist() == [24.0, 25.0]
    shipped = read_manifest(CLIPS / "manifest.csv")     # relative paths: from the manifest's folder
    assert shipped.paths[2] == str(CLIPS / FILES[2]) and shipped.frames.tolist() == [48, 48, 100]


def test_bad_manifests_are_named(tmp_path):
    with pytest.raises(VideoDataError, match="write the manifest as one of"):
        read_manifest(tmp_path / "m.txt")
    with pytest.raises(VideoDataError, match="not found"):
        read_manifest(tmp_path / "m.csv")
    (tmp_path / "m.jsonl").write_text(json.dumps({"file": "a.mp4", "text": "x"}) + "\n")
    with pytest.raises(VideoDataError, match="line 1: no 'path'"):
        read_manifest(tmp_path / "m.jsonl")
    (tmp_path / "m.jsonl").write_text(json.dumps({"path": "a.mp4", "text": ["x", ""]}) + "\n")
    with pytest.raises(VideoDataError, match="line 1: the caption"):
        read_manifest(tmp_path / "m.jsonl")
    (tmp_path / "m.jsonl").write_text(json.dumps({"path": "a.mp4", "text": "x"}) + "\n")
    with pytest.raises(VideoDataError, match="data.min_score=0.5 filters on column score, which this row lacks"):
        read_manifest(tmp_path / "m.jsonl", min_score=0.5)
    with pytest.raises(VideoDataError, match="video .*a.mp4 not found: fix its row's path"):
        fill_sizes(read_manifest(tmp_path / "m.jsonl"))
    (tmp_path / "a.mp4").write_bytes(b"this is not a video")
    with pytest.raises(VideoDataError, match="video .*a.mp4 cannot be opened.*re-encode"):
        fill_sizes(read_manifest(tmp_path / "m.jsonl"))
    with pytest.raises(VideoDataError, match="cannot decode video .*a.mp4.*Re-encode"):
        load_clip(str(tmp_path / "a.mp4"), 48, Bucket(8, 16, 16, 1), 1, random_offset=False, random_crop=False)
    (tmp_path / "m.jsonl").write_text(json.dumps({"path": BUNNY, "text": "x", "num_frames": 90}) + "\n")
    m = read_manifest(tmp_path / "m.jsonl")
    fill_sizes(m)
    with pytest.raises(VideoDataError, match="has 48 decodable frames.*num_frames in the manifest is wrong"):
        load_clip(m.paths[0], 90, Bucket(8, 16, 16, 1), 10, random_offset=False, random_crop=False)


def test_held_out_split_keeps_each_video_on_one_side(tmp_path):
    m = read_manifest(_write(tmp_path / "m.jsonl", ROWS * 10, sizes=True), root=CLIPS)
    held = held_out_rows(m, 0.1, seed=0)
    held_paths = {m.paths[i] for i in np.flatnonzero(held)}
    train_paths = {m.paths[i] for i in np.flatnonzero(~held)}
    assert len(held_paths) == 1 and not held_paths & train_paths and held.sum() == 10
    assert (held_out_rows(m, 0.1, seed=0) == held).all()                    # deterministic
    one = read_manifest(_write(tmp_path / "one.jsonl", ROWS[:1] * 3, sizes=True), root=CLIPS)
    with pytest.raises(VideoDataError, match="none is left to train on"):
        held_out_rows(one, 0.1, seed=0)


def test_batches_draw_every_caption_and_hold_no_video(tmp_path):
    from apps.video_gen.text import build_tokenizer

    m = read_manifest(_write(tmp_path / "m.jsonl", ROWS[:1] * 4, sizes=True), root=CLIPS)
    tok = build_tokenizer(list(m.all_captions()), 8)
    ds = ManifestBatches(m, np.arange(4), [Bucket(8, 16, 28, 2)], tok, stride=2, crop="random")
    assert len(ds) == 2
    torch.manual_seed(0)
    seen = {c for _ in range(10) for c in tok.batch_decode(ds[0]["prompt_ids"], skip_special_tokens=True)}
    assert seen == {"a pink sky", "green trees"}
    batch = ds[1]
    assert batch["video"].shape == (2, 3, 8, 16, 28) and not torch.equal(batch["video"][0], batch["video"][1])
    assert not any(isinstance(v, torch.Tensor) for v in vars(ds).values())  # paths and numbers only


def _retained_bytes(path, tok) -> tuple[int, int]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    m = read_manifest(path, root=CLIPS)
    ds = ManifestBatches(m, np.arange(len(m)), [Bucket(8, 16, 28, 2)], tok, stride=2)
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(ds) == len(m) // 2
    return retained - before, peak - before


def test_loader_memory_holds_metadata_not_video(tmp_path):
    """The same three clips repeated 30 and 6000 times: the loader keeps paths and sizes (a few
    hundred bytes a row), where decoded clips would cost 43 KB a row (3 x 8 x 16 x 28 float32)."""
    from apps.video_gen.text import build_tokenizer

    tok = build_tokenizer(["a pink sky", "green trees"], 8)
    small = _retained_bytes(_write(tmp_path / "small.csv", ROWS * 10, sizes=True), tok)
    large = _retained_bytes(_write(tmp_path / "large.csv", ROWS * 2000, sizes=True), tok)
    per_row = (large[0] - small[0]) / (6000 - 30)
    assert per_row < 400, per_row                        # vs 43,008 bytes for one decoded clip
    assert (large[1] - small[1]) / (6000 - 30) < 2000    # the peak while reading, too


def test_real_clips_config_trains_on_real_clips_only(tmp_path):
    """`configs/real_clips.yaml` (no moving shapes, the shipped manifest) trained tiny, clips decoded
    on a DataLoader worker; the held-out loss is scored on the held-out video's clip."""
    from video_tiny import TINY_MODEL

    from apps.video_gen.config import load_recipe
    from apps.video_gen.pipeline import VideoPipeline
    from apps.video_gen.train import prepare, train

    cfg = load_recipe(resolve("apps/video_gen/configs/real_clips.yaml"), [
        *TINY_MODEL, "train.max_steps=2", "train.log_every=1", "train.progress_bar=false", "train.plot=false",
        "eval.every=0", "eval.timesteps=2", f"train.output_dir={tmp_path}"])
    assert cfg.data.shapes_videos == 0 and cfg.data.clips_dir is None and cfg.train.num_workers == 1
    _, _, batches, held, _ = prepare(cfg)
    assert isinstance(batches, ManifestBatches) and len(batches) == 2 and len(held) == 1
    shipped = read_manifest(CLIPS / "manifest.csv")
    assert held.captions == [shipped.captions_of(i)[0] for i in np.flatnonzero(held_out_rows(shipped, 0.1, 0))]
    result = train(cfg)
    assert result.final_step == 2 and set(result.last_eval) == {"loss", "loss/8x16x28"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["initial"]["loss"] > 0 and summary["steps"] == 2
    meta = VideoPipeline.from_pretrained(cfg.final_path).meta
    assert (meta["frames"], meta["height"], meta["width"]) == (8, 16, 28)


def test_shapes_off_without_a_manifest_is_refused(tmp_path):
    from phalanx.config import ConfigError

    from video_tiny import tiny_config

    with pytest.raises(ConfigError, match="no training data"):
        tiny_config(tmp_path, "data.clips_dir=null", "data.shapes_videos=0", "data.shapes_images=0",
                    "eval.motion_samples=0")


def _rank_reads(manifest_path: str) -> dict:
    """On each rank: which files this rank probed for their sizes, and which rows it decoded over one epoch
    of fit's distributed sampler (the framework's `distribute_dataloader`)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from phalanx.data.buckets import unwrap_single
    from phalanx.data.loader import distribute_dataloader

    from apps.video_gen import manifest as mf
    from apps.video_gen.text import build_tokenizer

    probed, decoded = [], []
    probe, decode = mf.probe_video, mf.decode_frames
    mf.probe_video = lambda path: probed.append(path) or probe(path)
    mf.decode_frames = lambda path, indices: decoded.append(path) or decode(path, indices)
    m = read_manifest(manifest_path)
    fill_sizes(m)
    ds = ManifestBatches(m, np.arange(len(m)), [Bucket(8, 16, 28, 1)], build_tokenizer(["x"], 4), stride=2)
    loader = distribute_dataloader(DataLoader(ds, batch_size=1, shuffle=True, collate_fn=unwrap_single),
                                   dist.get_world_size(), dist.get_rank(), seed=0)
    shapes = [tuple(b["video"].shape) for b in loader]
    return {"probed": probed, "decoded": decoded, "shapes": shapes, "frames": m.frames.tolist()}


@pytest.mark.slow
def test_each_rank_probes_and_decodes_only_its_share(tmp_path):
    import shutil

    from phalanx.testing import spawn

    names = []
    for k, name in enumerate(FILES + ["big_buck_bunny_2s_64px.mp4"]):
        names.append(f"{k}_{name}")
        shutil.copy(CLIPS / name, tmp_path / names[-1])
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"path": n, "text": "x"}) + "\n" for n in names))   # no sizes: probed
    ranks = spawn(_rank_reads, 2, str(path), timeout=300)
    every = {str(tmp_path / n) for n in names}
    for r in ranks:
        assert r["frames"] == [48, 48, 100, 48]                          # every rank has every row's sizes
        assert len(r["probed"]) == 2 and len(r["decoded"]) == 2 and r["shapes"] == [(1, 3, 8, 16, 28)] * 2
    assert set(ranks[0]["probed"]) | set(ranks[1]["probed"]) == every   # each file probed once, by one rank
    assert set(ranks[0]["decoded"]) | set(ranks[1]["decoded"]) == every  # one epoch: each clip decoded once


@pytest.mark.slow
def test_latents_precomputed_to_shards_match_the_autoencoder_and_train(tmp_path):
    """`python -m apps.video_gen.latents`: every training row's views encoded into safetensors shards
    (each equal to encoding that view's clip by hand), then `train` reads them back (latent space)."""
    from safetensors import safe_open
    from test_latent import _tiny_vae
    from video_tiny import TINY_MODEL

    from apps.video_gen.config import load_recipe
    from apps.video_gen.latents import LatentShards, main
    from apps.video_gen.train import train
    from apps.video_gen.vae import encode_latents, load_vae

    _tiny_vae(tmp_path / "vae")
    overrides = [*TINY_MODEL, "model.patch_size=[1,2,2]", f"vae.from_dir={tmp_path / 'vae'}",
                 f"data.latent_cache={tmp_path / 'latents'}", "data.buckets=[[9,16,28,1]]", "data.latent_views=2",
                 "train.max_steps=2", "train.num_workers=0", "train.progress_bar=false", "train.plot=false",
                 "eval.every=0", "eval.timesteps=2", f"train.output_dir={tmp_path / 'run'}"]
    config = str(resolve("apps/video_gen/configs/real_clips.yaml"))
    main(["--config", config, *overrides])
    index = json.loads((tmp_path / "latents" / "index-00000.json").read_text())
    shipped = read_manifest(CLIPS / "manifest.csv")
    train_rows = np.flatnonzero(~held_out_rows(shipped, 0.1, 0)).tolist()
    assert sorted({e[0] for e in index["entries"]}) == train_rows and len(index["entries"]) == 2 * len(train_rows)
    vae, cfg = load_vae(tmp_path / "vae"), load_recipe(config, overrides)
    row, bucket, shard, j = index["entries"][-1]
    view = sum(1 for e in index["entries"] if e[0] == row) - 1
    torch.manual_seed(cfg.train.seed * 1_000_003 + row * 2 + view)       # the view's seed
    clip = load_clip(shipped.paths[row], int(shipped.frames[row]), Bucket(9, 16, 28, 1), 2, True, True)
    with safe_open(str(tmp_path / "latents" / index["shards"][shard]), framework="pt") as f:
        stored = f.get_tensor(f"mean.{j}")
    assert stored.shape == (4, 5, 8, 14) and torch.allclose(stored, encode_latents(vae, clip[None])[0][0], atol=1e-5)

    result = train(cfg)
    assert result.final_step == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["space"] == "latent space"
    from apps.video_gen.text import build_tokenizer
    shards = LatentShards(tmp_path / "latents", shipped, cfg.buckets, build_tokenizer(["x"], 4))
    assert len(shards) == 4 and shards[0]["video"].shape == (1, 4, 5, 8, 14)
    other = read_manifest(_write(tmp_path / "other.jsonl", ROWS, sizes=True), root=CLIPS)
    with pytest.raises(ValueError, match="was written for .*manifest.csv .*python -m apps.video_gen.latents"):
        LatentShards(tmp_path / "latents", other, cfg.buckets, build_tokenizer(["x"], 4))
