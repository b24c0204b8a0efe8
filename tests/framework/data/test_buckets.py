"""phalanx.data.buckets: assignment by aspect ratio and length, every sample once per epoch over
ranks, mid-epoch resume, and a clear error for a configuration that yields no batch."""
from __future__ import annotations

import pytest

from phalanx.data.buckets import Bucket, BucketBatches, BucketBatchSampler, BucketConfigError, assign_buckets

BUCKETS = [Bucket(1, 16, 16, 4), Bucket(8, 16, 16, 2), Bucket(8, 16, 28, 3)]


def test_assignment_by_aspect_and_length():
    shapes = [(1, 16, 16), (8, 16, 16), (20, 32, 32), (8, 36, 64), (4, 16, 16), (8, 16, 80), (1, 36, 64)]
    # a still image goes to the image bucket; a long square clip to the longest square bucket; a wide
    # clip to the wide bucket; a 4-frame clip to the 1-frame bucket; 5:1 fits nothing; a wide image
    # has no wide 1-frame bucket within the aspect tolerance
    assert assign_buckets(shapes, BUCKETS) == [0, 1, 1, 2, 0, None, None]


def _shapes(n_img: int, n_vid: int, n_wide: int) -> list[tuple[int, int, int]]:
    return [(1, 16, 16)] * n_img + [(8, 16, 16)] * n_vid + [(8, 36, 64)] * n_wide


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_once_per_epoch_across_ranks(world):
    bucket_of = assign_buckets(_shapes(12, 6, 9), BUCKETS)  # 3 + 3 + 3 = 9 batches: divides 1, 3; not 2
    samplers = [BucketBatchSampler(bucket_of, BUCKETS, num_replicas=world, rank=r, seed=5, drop_last=world != 2)
                for r in range(world)]
    for epoch in range(2):
        batches = [b for s in samplers for b in s]
        seen = [i for b in batches for i in b]
        if world == 2:  # 9 batches on 2 ranks without drop_last: the first batch repeats to even them out
            assert len(batches) == 10 and sorted(set(seen)) == list(range(27))
        else:
            assert sorted(seen) == list(range(27)), epoch
        for b in batches:  # one bucket per batch, at its batch size
            assert len({bucket_of[i] for i in b}) == 1 and len(b) == BUCKETS[bucket_of[b[0]]].batch_size
    assert all(s.epoch == 2 for s in samplers)
    if world == 1:
        first, second = samplers[0].epoch_batches(0), samplers[0].epoch_batches(1)
        assert first != second  # reshuffled every epoch


def test_resume_mid_epoch_gives_the_same_batches():
    bucket_of = assign_buckets(_shapes(16, 8, 12), BUCKETS)
    full = list(BucketBatchSampler(bucket_of, BUCKETS, num_replicas=2, rank=1, seed=3))
    run = BucketBatchSampler(bucket_of, BUCKETS, num_replicas=2, rank=1, seed=3)
    it = iter(run)
    head = [next(it) for _ in range(3)]
    state = run.state_dict()
    resumed = BucketBatchSampler(bucket_of, BUCKETS, num_replicas=2, rank=1, seed=0)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full) - 3
    assert head + list(resumed) == full
    with pytest.raises(ValueError, match="same number"):
        BucketBatchSampler(bucket_of, BUCKETS, num_replicas=1).load_state_dict(state)


def test_a_configuration_without_batches_stops_clearly():
    bucket_of = assign_buckets(_shapes(3, 1, 0) + [(8, 16, 80)], BUCKETS)
    with pytest.raises(BucketConfigError, match=r"yields no batch.*1 fit no bucket.*\(1, 16, 16\) batch 4: 3 samples"):
        BucketBatchSampler(bucket_of, BUCKETS, num_replicas=1)
    # enough for one rank, not for four
    bucket_of = assign_buckets(_shapes(8, 0, 0), BUCKETS)
    BucketBatchSampler(bucket_of, BUCKETS, num_replicas=2)
    with pytest.raises(BucketConfigError, match="for 4 rank"):
        BucketBatchSampler(bucket_of, BUCKETS, num_replicas=4)
    with pytest.raises(BucketConfigError, match="batch_size must be at least 1"):
        Bucket(1, 16, 16, 0)
    with pytest.raises(BucketConfigError, match="frames, height, width, batch_size"):
        Bucket.parse([1, 16, 16])


def test_bucket_batches_dataset():
    bucket_of = assign_buckets(_shapes(8, 4, 0), BUCKETS)
    data = list(range(12))
    ds = BucketBatches(data, bucket_of, BUCKETS, collate_fn=lambda xs: xs, seed=0)
    assert len(ds) == 4 and sorted(i for k in range(len(ds)) for i in ds[k]) == list(range(12))
