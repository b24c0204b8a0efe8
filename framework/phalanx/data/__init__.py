"""Data helpers: resumable distributed sampling and dataloader re-wiring for data parallelism."""
from phalanx.data.sampler import ResumableDistributedSampler
from phalanx.data.loader import distribute_dataloader
from phalanx.data.buckets import Bucket, BucketBatchSampler, BucketBatches, BucketConfigError, assign_buckets

__all__ = ["ResumableDistributedSampler", "distribute_dataloader", "Bucket", "BucketBatchSampler", "BucketBatches",
           "BucketConfigError", "assign_buckets"]
