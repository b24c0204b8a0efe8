"""Gemini: train a model larger than device memory by moving chunks of it between tiers.

- `tiers`: byte accounting per tier (device, host, disk) and the device and host budgets;
- `chunk`: packing parameters into chunks (cut at a fixed capacity, sized to their contents), the chunk state machine;
- `chunk_search`: the chunk size when none is given (tightest packing within the device budget);
- `disk`: optimizer chunks in checksummed files on local disk, read ahead of the optimizer step;
- `manager`: gathering chunks for compute, releasing them, reducing their gradients;
- `hooks`: the module/parameter hooks that call the manager from forward and backward;
- `placement`: static and auto placement policies, what goes to disk, the "does not fit" errors;
- `tracer`: non-model memory per step, recorded in the warm-up iteration (auto);
- `optimizer`: the hybrid CPU/device Adam over chunk shards;
- `checkpoint`: full weights and optimizer fragments for the Booster's checkpoints.

See docs/gemini.md. The entry point is `phalanx.booster.plugins.GeminiPlugin`.
"""
from phalanx.gemini.chunk import Chunk, ChunkState, search_chunk_size
from phalanx.gemini.manager import ChunkManager
from phalanx.gemini.optimizer import GeminiOptimizer, adam_update
from phalanx.gemini.disk import CorruptChunkFile
from phalanx.gemini.placement import AutoPlacement, NotEnoughDeviceMemory, NotEnoughHostMemory, StaticPlacement
from phalanx.gemini.tiers import MemoryTiers, parse_bytes

__all__ = ["Chunk", "ChunkState", "search_chunk_size", "ChunkManager", "GeminiOptimizer", "adam_update",
           "AutoPlacement", "StaticPlacement", "NotEnoughDeviceMemory", "NotEnoughHostMemory", "CorruptChunkFile",
           "MemoryTiers", "parse_bytes"]
