"""Pipeline parallelism: splitting a Hugging Face causal LM into stages by its shard policy, and
running GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-V) schedules over them
(torch.distributed.pipelining). Used through `HybridParallelPlugin(pp_size=...)` and
`Booster.execute_pipeline`; see docs/pipeline.md."""
from phalanx.pipeline.layout import (SCHEDULES, StageLayout, bubble_fraction, check_microbatches, split_layers,
                                     virtual_stages_for)
from phalanx.pipeline.runtime import PipelineModel, PipelineRunner, batch_tensors, in_shape_inference
from phalanx.pipeline.stage import StageModule, split_model, tie_aliases

__all__ = ["SCHEDULES", "StageLayout", "StageModule", "PipelineModel", "PipelineRunner", "batch_tensors", "bubble_fraction", "in_shape_inference", "check_microbatches",
           "split_layers", "split_model", "tie_aliases", "virtual_stages_for"]
