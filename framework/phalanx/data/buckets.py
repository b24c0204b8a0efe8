"""Multi-resolution, multi-length buckets for image and video training (Open-Sora style).

Each sample goes to a (frames, height, width) bucket: among the buckets with at most as many
frames as the sample has, the one whose aspect ratio is closest (in log scale) to the sample's,
and of those the longest. Each bucket has its own batch size (short, small clips batch more), so
every batch holds samples of one shape and memory per step stays about even.

`BucketBatchSampler` yields lists of indices (a batch_sampler): every epoch it shuffles each
bucket, cuts it into batches of the bucket's size, shuffles the batches together and deals them
to ranks round-robin. It saves and restores its position mid-epoch. A configuration that would
yield no batch at all (buckets larger than the data, samples that fit no bucket) stops with an
error that names each bucket's count and batch size instead of running an empty epoch.

`BucketBatches` fixes one grouping as a map-style dataset of whole batches, for a loop (such as
`phalanx.train.fit`) that shuffles and distributes samples itself: give it micro_batch_size=1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler


class BucketConfigError(ValueError):
    """The bucket configuration cannot produce a batch from this data."""


@dataclass(frozen=True)
class Bucket:
    frames: int
    height: int
    width: int
    batch_size: int

    def __post_init__(self):
        for key in ("frames", "height", "width", "batch_size"):
            if int(getattr(self, key)) < 1:
                raise BucketConfigError(f"bucket {self}: {key} must be at least 1")

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.frames, self.height, self.width

    @classmethod
    def parse(cls, spec: Sequence[int] | dict) -> "Bucket":
        """[frames, height, width, batch_size] or a dict with those keys."""
        if isinstance(spec, dict):
            return cls(**{k: int(v) for k, v in spec.items()})
        if len(spec) != 4:
            raise BucketConfigError(f"bucket {list(spec)}: write [frames, height, width, batch_size]")
        return cls(*(int(v) for v in spec))


def assign_bucket(frames: int, height: int, width: int, buckets: Sequence[Bucket],
                  max_aspect_error: float = 0.5) -> int | None:
    """Index of the bucket for a sample of this size, or None when none fits: no bucket is short
    enough, or the nearest aspect ratio is off by more than `max_aspect_error` in log scale."""
    aspect = math.log(width / height)
    best, best_key = None, None
    for i, b in enumerate(buckets):
        if b.frames > frames:
            continue
        error = abs(math.log(b.aspect) - aspect)
        if error > max_aspect_error:
            continue
        key = (round(error, 6), -b.frames, -b.height * b.width)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def assign_buckets(shapes: Sequence[tuple[int, int, int]], buckets: Sequence[Bucket],
                   max_aspect_error: float = 0.5) -> list[int | None]:
    return [assign_bucket(f, h, w, buckets, max_aspect_error) for f, h, w in shapes]


class BucketBatchSampler(Sampler[list[int]]):
    """Distributed, resumable batches of one bucket each (see the module doc).

    bucket_of: each sample's bucket index (None: the sample is skipped). With drop_last (the
    default) a bucket's last incomplete batch and the batches that do not divide evenly over the
    ranks are left out of that epoch; without it incomplete batches are kept and the batch list is
    padded from its start, so every rank gets the same number of batches.
    """

    def __init__(self, bucket_of: Sequence[int | None], buckets: Sequence[Bucket], num_replicas: int = 1,
                 rank: int = 0, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside num_replicas={num_replicas}")
        self.bucket_of, self.buckets = list(bucket_of), list(buckets)
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.consumed = 0, 0
        bad = [b for b in self.bucket_of if b is not None and not 0 <= b < len(self.buckets)]
        if bad:
            raise BucketConfigError(f"bucket index {bad[0]} is outside the {len(self.buckets)} buckets")
        self.num_batches = self._count_batches()

    def _members(self) -> list[list[int]]:
        members: list[list[int]] = [[] for _ in self.buckets]
        for i, b in enumerate(self.bucket_of):
            if b is not None:
                members[b].append(i)
        return members

    def _count_batches(self) -> int:
        members = self._members()
        per_bucket = [len(m) // b.batch_size if self.drop_last else math.ceil(len(m) / b.batch_size)
                      for m, b in zip(members, self.buckets)]
        total = sum(per_bucket)
        per_rank = total // self.num_replicas if self.drop_last else math.ceil(total / self.num_replicas)
        if per_rank == 0:
            counts = ", ".join(f"{b.shape} batch {b.batch_size}: {len(m)} samples"
                               for b, m in zip(self.buckets, members))
            skipped = sum(b is None for b in self.bucket_of)
            raise BucketConfigError(
                f"this bucket configuration yields no batch for {self.num_replicas} rank(s) from "
                f"{len(self.bucket_of)} samples ({skipped} fit no bucket; {counts}), so an epoch would be empty. "
                "Fix: lower the buckets' batch sizes, add buckets that match the data's lengths and aspect "
                "ratios, or add data")
        return per_rank

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches of `epoch`, in order (batch k goes to rank k % num_replicas)."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        batches = []
        for members, bucket in zip(self._members(), self.buckets):
            if self.shuffle:
                members = [members[i] for i in torch.randperm(len(members), generator=g).tolist()]
            for start in range(0, len(members), bucket.batch_size):
                chunk = members[start:start + bucket.batch_size]
                if len(chunk) == bucket.batch_size or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        total = self.num_batches * self.num_replicas
        while len(batches) < total:  # drop_last=False: pad from the start
            batches += batches[: total - len(batches)]
        return batches[:total]

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.epoch_batches(self.epoch)[self.rank::self.num_replicas]
        for k in range(self.consumed, len(mine)):
            self.consumed = k + 1
            yield mine[k]
        self.epoch += 1
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_batches - self.consumed

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("num_replicas", self.num_replicas)) != self.num_replicas:
            raise ValueError(f"this bucket sampler position was saved on {state['num_replicas']} ranks; resume it on "
                             f"the same number (now {self.num_replicas})")
        self.epoch, self.consumed, self.seed = int(state["epoch"]), int(state["consumed"]), int(state["seed"])


class BucketBatches(Dataset):
    """Whole batches as dataset items: item k = collate_fn([dataset[i] for i in batch k]). The
    grouping is the sampler's epoch-0 grouping on one rank (the loop's own sampler then shuffles
    and deals these batches to ranks every epoch)."""

    def __init__(self, dataset, bucket_of: Sequence[int | None], buckets: Sequence[Bucket],
                 collate_fn: Callable, seed: int = 0):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.batches = BucketBatchSampler(bucket_of, buckets, seed=seed).epoch_batches(0)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int):
        return self.collate_fn([self.dataset[i] for i in self.batches[k]])


def unwrap_single(items: list):
    """collate_fn for a DataLoader over `BucketBatches` with batch size 1."""
    if len(items) != 1:
        raise ValueError(f"BucketBatches items are whole batches: load them with micro_batch_size=1, got {len(items)}")
    return items[0]
