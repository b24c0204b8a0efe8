"""The training set: moving shapes (videos and single-frame images) plus real clips, tokenized,
placed in (frames, height, width) buckets and grouped into whole batches for `fit`.

A sample is {"video": [C, F, H, W] in [-1, 1], "prompt_ids": [tokens]}; images are 1-frame
videos. Samples are resized to their bucket's shape (first `frames` frames, area resampling), so a
batch stacks. The held-out set (for the evaluation loss) is a share of the moving-shapes clips.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from phalanx.data.buckets import Bucket, BucketBatches, BucketConfigError, assign_buckets

from .clips import load_clips
from .config import DataConfig, resolve
from .shapes import moving_shapes
from .text import tokenize


@dataclass
class Clip:
    video: torch.Tensor
    caption: str


def load_all_clips(d: DataConfig) -> tuple[list[Clip], list[Clip]]:
    """(training clips, held-out clips): shapes videos + shapes images + real clips; held out: a share of
    the shapes videos and images."""
    videos = moving_shapes(d.shapes_videos, d.shapes_frames, d.shapes_size, seed=d.shapes_seed)
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
