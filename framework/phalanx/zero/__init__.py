"""The low-level ZeRO optimizer (stages 1 and 2) that `ZeroPlugin` uses.

- `partition`: the flat, rank-partitioned layout of a param group (index arithmetic only);
- `flat_group`: model params as views of one flat buffer, the fp32 master shard;
- `offload`: the host store for CPU offload, and the bytes it moves each way;
- `reducer`: gradient buckets reduce-scattered from backward hooks;
- `optimizer`: `ZeroOptimizer` and its `ZeroConfig`;
- `supported`: which torch optimizers are elementwise, hence shardable;
- `prefetch`: the parameter publication overlapped with the next forward (opt-in);
- `checkpoint`: optimizer state as layout-independent fragments.

The step with torch's fused kernel over the flat shards is `phalanx.amp.fused_step` (one floor
below: the one-process mixed-precision optimizer uses it too).

See docs/zero.md.
"""
from phalanx.zero.optimizer import ZeroConfig, ZeroOptimizer
from phalanx.zero.partition import FlatLayout
from phalanx.zero.supported import ELEMENTWISE_OPTIMIZERS, check_elementwise, register_elementwise_optimizer

__all__ = ["ZeroConfig", "ZeroOptimizer", "FlatLayout", "ELEMENTWISE_OPTIMIZERS", "check_elementwise",
           "register_elementwise_optimizer"]
