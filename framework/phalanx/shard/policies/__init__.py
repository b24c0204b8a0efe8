"""Built-in shard policies, one file per model family (imported on first use by `policy_for`)."""
