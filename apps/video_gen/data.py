"""The training set: moving shapes (videos and single-frame images), real clips from a folder and
real clips from a manifest, tokenized, placed in (frames, height, width) buckets and grouped into
whole batches for `fit`.

A sample is {"video": [C, F, H, W] in [-1, 1], "prompt_ids": [tokens]}; images are 1-frame
videos. The in-memory clips (shapes, `data.clips_dir`) are resized to their bucket's shape (first
`frames` frames, area resampling); manifest clips are decoded when drawn (`manifest.py`: strided
frames from a random offset, cropped to the bucket's aspect, drawn from a per-item generator so that a
resumed run draws what an uninterrupted one does). The held-out set (for the evaluation
loss) is a share of the moving-shapes clips and a share of the manifest's videos.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, Dataset

from phalanx.data.buckets import Bucket, BucketBatches, BucketConfigError, assign_buckets

from .clips import load_clips
from .config import DataConfig, resolve
from .manifest import Manifest, ManifestBatches, fill_sizes, held_out_clips, held_out_rows, read_manifest
from .shapes import HELD_OUT_COMBOS, moving_shapes
from .text import tokenize


@dataclass
class Clip:
    video: torch.Tensor
    caption: str


def load_all_clips(d: DataConfig) -> tuple[list[Clip], list[Clip]]:
    """(training clips, held-out clips): shapes videos + shapes images + real clips; held out: a share of
    the shapes videos and images."""
    videos = moving_shapes(d.shapes_videos, d.shapes_frames, d.shapes_size, seed=d.shapes_seed,
                           exclude=HELD_OUT_COMBOS if d.held_out_combos else ())
    images = moving_shapes(d.shapes_images, 1, d.shapes_size, seed=d.shapes_seed + 1, moving=False)
    n_vid, n_img = (max(1, int(round(len(x) * d.held_out))) if x else 0 for x in (videos, images))
    held = [Clip(c.video, c.caption) for c in videos[:n_vid] + images[:n_img]]
    train = [Clip(c.video, c.caption) for c in videos[n_vid:] + images[n_img:]]
    if d.clips_dir:
        train += [Clip(v, c) for v, c in load_clips(resolve(d.clips_dir), d.clip_frames, d.clip_stride,
                                                    d.clip_height, d.clips_per_video)]
    return train, held


def fit_to_bucket(video: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The first `bucket.frames` frames, resized to the bucket's height x width."""
    v = video[:, :bucket.frames]
    if v.shape[-2:] != (bucket.height, bucket.width):
        v = F.interpolate(v.transpose(0, 1), size=(bucket.height, bucket.width), mode="area").transpose(0, 1)
    return v.contiguous()


class BucketedClips(Dataset):
    """Clips with token ids, each already at its bucket's shape; `bucket_of[i]` is None for clips
    that fit no bucket (left out)."""

    def __init__(self, clips: list[Clip], buckets: list[Bucket], tokenizer):
        self.buckets = buckets
        self.bucket_of = assign_buckets([tuple(c.video.shape[1:]) for c in clips], buckets)
        ids = tokenize(tokenizer, [c.caption for c in clips])
        self.items = [{"video": fit_to_bucket(c.video, buckets[b]) if b is not None else c.video, "prompt_ids": ids[i]}
                      for i, (c, b) in enumerate(zip(clips, self.bucket_of))]
        self.captions = [c.caption for c in clips]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]

    def per_bucket(self) -> dict[Bucket, list[int]]:
        out: dict[Bucket, list[int]] = {}
        for i, b in enumerate(self.bucket_of):
            if b is not None:
                out.setdefault(self.buckets[b], []).append(i)
        return out


def stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def training_batches(clips: BucketedClips, seed: int) -> BucketBatches:
    """Whole bucket batches as dataset items (load with micro_batch_size=1)."""
    return BucketBatches(clips, clips.bucket_of, clips.buckets, collate_fn=stack, seed=seed)


def check_buckets_cover(clips: BucketedClips, what: str) -> None:
    if all(b is None for b in clips.bucket_of):
        shapes = sorted({tuple(c.shape[1:]) for c in (it["video"] for it in clips.items)})
        raise BucketConfigError(f"no {what} clip fits any bucket (clip shapes {shapes[:4]}, buckets "
                                f"{[b.shape for b in clips.buckets]}): add a bucket with at most as many frames "
                                "and a similar aspect ratio")


def load_manifest_split(d: DataConfig, buckets: list[Bucket], max_held_per_bucket: int
                        ) -> tuple[Manifest, np.ndarray, list[Clip], int]:
    """(the manifest, its training rows, held-out clips decoded at their bucket's shape, files probed)
    for `data.manifest`: rows filtered by the score thresholds, missing sizes read from the files'
    headers, data.held_out of its videos held out (up to `max_held_per_bucket` clips per bucket
    decoded for the evaluation loss)."""
    m = read_manifest(resolve(d.manifest), resolve(d.manifest_root) if d.manifest_root else None,
                      d.min_aesthetic, d.min_score)
    probed = fill_sizes(m)
    held = held_out_rows(m, d.held_out, seed=0)
    clips = held_out_clips(m, np.flatnonzero(held), buckets, d.clip_stride, d.clip_fps, max_held_per_bucket)
    return m, np.flatnonzero(~held), [Clip(v, c) for v, c in clips], probed


class TrainingParts(ConcatDataset):
    """The in-memory batches followed by the manifest's: `set_epoch` (called by `fit` before each pass)
    reaches the parts that draw per epoch (`ManifestBatches`, `LatentShards`)."""

    def set_epoch(self, epoch: int) -> None:
        for part in self.datasets:
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)


def training_dataset(d: DataConfig, buckets: list[Bucket], tokenizer, clips: list[Clip], manifest: Manifest | None,
                     rows: np.ndarray | None, seed: int, latents: bool = False,
                     keep_std: bool = False) -> tuple[Dataset, BucketedClips | None]:
    """(whole bucket batches for `fit`, the in-memory part or None): the in-memory clips' batches
    followed by the manifest's (decoded when drawn; with `latents`, read from data.latent_cache).
    Raises BucketConfigError when a part yields no batch."""
    from .latents import LatentShards

    parts, in_memory = [], None
    if clips:
        in_memory = BucketedClips(clips, buckets, tokenizer)
        parts.append(training_batches(in_memory, seed=seed))
    if manifest is not None and latents:
        parts.append(LatentShards(resolve(d.latent_cache), manifest, buckets, tokenizer, seed, keep_std))
    elif manifest is not None:
        parts.append(ManifestBatches(manifest, rows, buckets, tokenizer, d.clip_stride, d.clip_fps, d.crop, seed))
    return (parts[0] if len(parts) == 1 else TrainingParts(parts)), in_memory
