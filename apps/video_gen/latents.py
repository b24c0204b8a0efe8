"""Manifest clips encoded once by the frozen autoencoder into disk shards (safetensors), read back
in training: latent training on a data set whose latents do not fit in RAM.

    python -m apps.video_gen.latents --config apps/video_gen/configs/real_clips.yaml \
        vae.from_dir=runs/video_vae_tiny/vae data.latent_cache=runs/real_clips_latents data.buckets=[[9,16,28,1]]
    python -m apps.video_gen.train --config apps/video_gen/configs/real_clips.yaml (the same overrides)

Each training row of the manifest gets `data.latent_views` views (each its own random temporal
offset and, with data.crop=random, crop; seeded by the row, so a rerun writes the same latents),
encoded in batches per bucket. Under torchrun each rank encodes its share of the rows and writes
its own files:

    <latent_cache>/latents-<rank>-<k>.safetensors   "mean.<j>", "std.<j>": the normalised posterior
    <latent_cache>/index-<rank>.json                manifest, rows, and per entry [row, bucket, shard, j]

Training (`LatentShards`) keeps the index in numpy arrays and reads a batch's tensors from their
shards when the batch is drawn; captions come from the manifest (one drawn at random each time).
The held-out clips are encoded in memory as before.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from phalanx.data.buckets import Bucket, BucketBatchSampler

from .manifest import Manifest, assign_rows, item_generator, load_clip

SHARD_CLIPS = 256


class LatentCacheError(ValueError):
    """A latent cache that does not belong to this manifest, or is missing; the fix is in the message."""


def _write_shard(directory: Path, rank: int, k: int, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    name = f"latents-{rank:05d}-{k:05d}.safetensors"
    save_file(tensors, str(directory / (name + ".tmp")))
    (directory / (name + ".tmp")).rename(directory / name)
    return name


@torch.no_grad()
def write_latents(m: Manifest, rows: np.ndarray, buckets: list[Bucket], vae, directory: Path, *, stride: int,
                  target_fps: float | None, crop: str, views: int, seed: int, rank: int = 0, world: int = 1,
                  batch: int = 16) -> int:
    """Encode this rank's share of `rows` (every `world`-th) into shards; returns the clips written."""
    from .vae import encode_latents

    directory.mkdir(parents=True, exist_ok=True)
    mine = np.asarray(rows)[rank::world]
    bucket_of, strides = assign_rows(m, mine, buckets, stride, target_fps)
    device = next(vae.parameters()).device
    entries, shards, tensors = [], [], {}
    for b in sorted(set(bucket_of.tolist()) - {-1}):
        todo = [(pos, v) for pos in np.flatnonzero(bucket_of == b) for v in range(views)]
        for start in range(0, len(todo), batch):
            clips = []
            for pos, v in todo[start:start + batch]:
                i = int(mine[pos])
                torch.manual_seed(seed * 1_000_003 + i * views + v)  # the view's offset and crop, by row
                clips.append(load_clip(m.paths[i], int(m.frames[i]), buckets[b], int(strides[pos]), True,
                                       crop == "random"))
            mean, std = encode_latents(vae, torch.stack(clips).to(device))
            for (pos, v), z, s in zip(todo[start:start + batch], mean.cpu(), std.cpu()):
                j = len(tensors) // 2
                tensors[f"mean.{j}"], tensors[f"std.{j}"] = z.contiguous(), s.contiguous()
                entries.append([int(mine[pos]), b, len(shards), j])
            if len(tensors) // 2 >= SHARD_CLIPS:
                shards.append(_write_shard(directory, rank, len(shards), tensors))
                tensors = {}
    if tensors:
        shards.append(_write_shard(directory, rank, len(shards), tensors))
    index = {"manifest": str(m.source), "rows": len(m), "views": views, "shards": shards, "entries": entries}
    (directory / f"index-{rank:05d}.json").write_text(json.dumps(index))
    return len(entries)


class LatentShards(Dataset):
    """Training items from a latent cache: whole bucket batches {"video": [B, z, F', H', W'] (the
    posterior mean), "prompt_ids", "latent_std"?}, read from the shards when drawn."""

    def __init__(self, directory: Path, m: Manifest, buckets: list[Bucket], tokenizer, seed: int = 0,
                 keep_std: bool = False):
        from .text import tokenize

        self.directory, self.manifest, self.tokenizer, self.tokenize = Path(directory), m, tokenizer, tokenize
        self.keep_std = keep_std
        indexes = sorted(self.directory.glob("index-*.json"))
        fix = (f"write it with `python -m apps.video_gen.latents` and the same config (data.manifest, data.buckets, "
               f"vae.from_dir), or set data.latent_cache=null")
        if not indexes:
            raise LatentCacheError(f"data.latent_cache={str(directory)!r} holds no index-*.json: {fix}")
        self.files, parts = [], []
        for path in indexes:
            index = json.loads(path.read_text())
            if index["manifest"] != str(m.source) or index["rows"] != len(m):
                raise LatentCacheError(f"{path} was written for {index['manifest']} ({index['rows']} rows), not "
                                       f"{m.source} ({len(m)} rows): {fix}")
            e = np.asarray(index["entries"], dtype=np.int64).reshape(-1, 4)
            e[:, 2] += len(self.files)
            self.files += index["shards"]
            parts.append(e)
        self.entries = np.concatenate(parts)                       # [row, bucket, shard, j]
        grouping = BucketBatchSampler(self.entries[:, 1].tolist(), buckets, seed=seed).epoch_batches(0)
        self.starts = np.cumsum([0] + [len(b) for b in grouping])
        self.members = np.fromiter((i for b in grouping for i in b), np.int64)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Called by `fit` before each pass: the epoch of the caption draws (`manifest.item_generator`)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        means, stds, texts = [], [], []
        g = item_generator(self.seed, self.epoch, k)     # the caption draws: the same after a resume
        for e in self.members[self.starts[k]:self.starts[k + 1]]:
            row, _, shard, j = (int(x) for x in self.entries[e])
            with safe_open(str(self.directory / self.files[shard]), framework="pt") as f:
                means.append(f.get_tensor(f"mean.{j}"))
                if self.keep_std:
                    stds.append(f.get_tensor(f"std.{j}"))
            options = self.manifest.captions_of(row)
            texts.append(options[int(torch.randint(len(options), (), generator=g).item())])
        out = {"video": torch.stack(means), "prompt_ids": self.tokenize(self.tokenizer, texts)}
        if self.keep_std:
            out["latent_std"] = torch.stack(stds)
        return out


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from phalanx.config import ConfigError
    from phalanx.launch import context, launched
    from phalanx.observe import get_logger

    from .config import parse_args, resolve
    from .data import load_manifest_split
    from .train import frozen_vae

    cfg = parse_args("Encode a manifest's training clips into latent shards (safetensors)", argv)
    d = cfg.data
    if not (d.manifest and d.latent_cache and cfg.vae.from_dir):
        raise ConfigError("config 'data.latent_cache': give data.manifest, data.latent_cache (the output folder) "
                          "and vae.from_dir (the frozen autoencoder) to precompute latents")
    with launched(seed=cfg.train.seed):
        vae = frozen_vae(cfg).to(context().device)
        m, rows, _, _ = load_manifest_split(d, cfg.buckets, 0)
        n = write_latents(m, rows, cfg.buckets, vae, resolve(d.latent_cache), stride=d.clip_stride,
                          target_fps=d.clip_fps, crop=d.crop, views=d.latent_views, seed=cfg.train.seed,
                          rank=dist.get_rank(), world=dist.get_world_size())
        get_logger("apps.video_gen").info(f"rank {dist.get_rank()}: wrote {n} latent clips to {d.latent_cache}")


if __name__ == "__main__":
    main()
