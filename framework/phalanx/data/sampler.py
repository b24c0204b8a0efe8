"""A distributed sampler that can resume mid-epoch.

Every rank draws the same permutation (seeded by `seed + epoch`) and takes every
`num_replicas`-th index starting at `rank`, so the union over ranks of one step's batches is
exactly the batch a single process would see with `batch_size × num_replicas`. The sampler
records how many of its indices were consumed; `state_dict()` saves that position and
`load_state_dict()` skips ahead, so a resumed run sees the same data as an uninterrupted one.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    def __init__(self, dataset_len: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True):
        if dataset_len <= 0:
            raise ValueError("the dataset is empty: check the data path and preprocessing")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside num_replicas={num_replicas}")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0  # indices of this epoch already yielded to this rank
        if drop_last:
            self.num_samples = dataset_len // num_replicas
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)
        if self.num_samples == 0:
            raise ValueError(f"the dataset has {dataset_len} samples, fewer than the {num_replicas} data-parallel ranks")

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        total = self.num_samples * self.num_replicas
        if total > len(order):
            order += order[: total - len(order)]
        return order[:total][self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        indices = self._indices()
        start = self.consumed
        for i in range(start, len(indices)):
            self.consumed = i + 1
            yield indices[i]
        # epoch finished: next iteration starts a new epoch
        self.epoch += 1
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples - self.consumed

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.seed = int(state.get("seed", self.seed))
