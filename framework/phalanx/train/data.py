"""Training data: the default collate function and an endless, resumable micro-batch stream.

The user gives a map-style dataset. `fit` builds a shuffling DataLoader over it and
`Booster.boost` swaps in `ResumableDistributedSampler`, which shards the data over the
data-parallel ranks. `MicroBatches` then walks epoch after epoch and records its position as the
number of micro-batches *handed to the loop* -- not the sampler's own counter, which worker
prefetching runs ahead of -- so a resumed run continues with exactly the next sample.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx.data.sampler import ResumableDistributedSampler


def pad_rows(rows: list[list[int]], pad_id: int = 0, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token-id lists padded to one width, on the right (scoring,
    training) or on the left (how Hugging Face `generate` takes a batch)."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r}: choose 'left' or 'right'")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def default_collate(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack samples that are dicts of equal-shape tensors (or lists of numbers) into a batch."""
    first = samples[0]
    if not isinstance(first, Mapping):
        raise TypeError(f"fit's default collate_fn expects each sample to be a dict of tensors such as "
                        f"{{'input_ids': ...}}, got {type(first).__name__}; pass collate_fn= to fit")
    batch = {}
    for key in first:
        values = [torch.as_tensor(s[key]) for s in samples]
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(f"samples have different shapes for {key!r} ({sorted(shapes)[:3]}): pad or pack them "
                             "to one length in the dataset, or pass a collate_fn that pads")
        batch[key] = torch.stack(values)
    return batch


def check_dataset(dataset: Any, micro_batch_size: int, dp_size: int) -> int:
    """The number of samples, after checking the dataset can fill one step on every rank."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"fit needs a map-style dataset (with __len__ and __getitem__), got {type(dataset).__name__}; "
                        "materialise the data (e.g. a list of samples) or wrap it in torch.utils.data.Dataset")
    n = len(dataset)
    needed = micro_batch_size * dp_size
    if n < needed:
        raise ValueError(f"the training dataset has {n} samples, but one micro-batch on {dp_size} data-parallel "
                         f"rank(s) needs micro_batch_size x ranks = {micro_batch_size} x {dp_size} = {needed}; "
                         "check the data path and preprocessing, or lower micro_batch_size")
    return n


def check_first_sample(dataset: Any, collate_fn, required_keys: tuple[str, ...] = ()) -> None:
    """Collate the first sample once, so a malformed record or a missing key stops the run with
    a clear message before the output directory is touched."""
    batch = collate_fn([dataset[0]])
    if not isinstance(batch, Mapping):
        raise TypeError(f"collate_fn must return a dict of tensors (the model's keyword arguments), got "
                        f"{type(batch).__name__}")
    missing = [k for k in required_keys if k not in batch]
    if missing:
        raise ValueError(f"batches lack {missing} (they have keys {sorted(batch)}): the default causal-LM loss needs "
                         "'input_ids' (and optionally 'labels', 'attention_mask'); fix the dataset/collate_fn or "
                         "pass loss_fn= to fit")


class MicroBatches:
    """This rank's micro-batches, forever (epoch after epoch), with an exact, restorable position."""

    def __init__(self, loader: DataLoader):
        if not isinstance(loader.sampler, ResumableDistributedSampler):
            raise TypeError("MicroBatches needs a DataLoader re-wired by Booster.boost (ResumableDistributedSampler)")
        self.loader = loader
        self.sampler: ResumableDistributedSampler = loader.sampler
        self.micro_batch_size = loader.batch_size
        self.epoch = self.sampler.epoch
        self.batches_in_epoch = 0
        self._iterator = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.batches_in_epoch * self.micro_batch_size,
                "seed": self.sampler.seed, "num_replicas": self.sampler.num_replicas}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue after `state`. Saved with another number of data-parallel ranks, the per-rank
        position is rescaled so the run continues at the same point of the global order."""
        consumed = int(state["consumed"])
        saved_replicas = int(state.get("num_replicas", self.sampler.num_replicas))
        if saved_replicas != self.sampler.num_replicas:
            consumed = consumed * saved_replicas // self.sampler.num_replicas
        self.batches_in_epoch = consumed // self.micro_batch_size
        self.epoch = int(state["epoch"])
        self.sampler.load_state_dict({"epoch": self.epoch, "consumed": self.batches_in_epoch * self.micro_batch_size,
                                      "seed": int(state.get("seed", self.sampler.seed))})
        self._iterator = None

    def _start(self) -> None:
        # A dataset with `set_epoch(epoch)` learns the epoch before each pass; the worker processes
        # get the copy made by `iter`. Random draws inside `__getitem__` on workers come from the
        # workers' own RNG, which no checkpoint holds and which restarts at a resume point, so a
        # dataset that draws (random crops, offsets, a caption per draw) seeds each item from
        # (its seed, the epoch, the index) to resume exactly (apps/video_gen/manifest.py).
        set_epoch = getattr(self.loader.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        # Creating a DataLoader iterator draws a base seed from the global RNG; keep the training
        # RNG streams (dropout, ...) independent of when iterators are created, or a resumed run
        # would drift from an uninterrupted one.
        with torch.random.fork_rng(devices=[]):
            self._iterator = iter(self.loader)

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._start()
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self.batches_in_epoch = 0
            self.sampler.set_epoch(self.epoch)
            self._start()
            batch = next(self._iterator)
        self.batches_in_epoch += 1
        return batch
