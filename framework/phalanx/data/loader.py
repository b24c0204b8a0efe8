"""Re-wire a user's DataLoader for data parallelism without changing what it yields."""
from __future__ import annotations

from torch.utils.data import DataLoader, RandomSampler

from phalanx.data.sampler import ResumableDistributedSampler


def distribute_dataloader(loader: DataLoader, num_replicas: int, rank: int, seed: int = 0) -> DataLoader:
    """Same dataset, batch size, collate function and workers; a resumable distributed sampler
    that shards the data over `num_replicas` data-parallel ranks (shuffled iff the original
    loader shuffled). The per-rank batch size stays the user's: the global batch grows with
    the number of ranks, as with torch DDP."""
    if isinstance(loader.sampler, ResumableDistributedSampler):
        return loader
    if loader.batch_size is None:
        raise ValueError("boost() needs a DataLoader built with batch_size (a custom batch_sampler cannot be sharded); "
                         "pass batch_size=… instead of batch_sampler=…")
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = ResumableDistributedSampler(len(loader.dataset), num_replicas=num_replicas, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=True)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                      collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                      pin_memory=loader.pin_memory, drop_last=True,
                      persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False)
