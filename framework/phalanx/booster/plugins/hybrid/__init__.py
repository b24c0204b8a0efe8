"""HybridParallelPlugin: pipeline × data × sequence × tensor parallelism for Hugging Face models,
with ZeRO.

    plugin = HybridParallelPlugin(tp_size=2, sp_size=1, zero_stage=1, precision="bf16")
    model, optimizer, *_ = Booster(plugin).boost(model, optimizer)

One module per concern (docs/hybrid.md):
- `plugin`: the options, the layout checks and the process groups of the mesh;
- `boost`: `configure_model` (tensor/sequence split, pipeline stages, cast, replica sync) and
  `configure_optimizer` (ZeRO-1/2 over the data × sequence group, or all-reduce for zero_stage=0);
- `model`: `HybridModel`, the boosted model's forward (sequence shards, vocabulary-parallel loss);
- `pipeline`: `execute_pipeline`, one batch through the pipeline schedule;
- `checkpoint`: the full model in Hugging Face layout and layout-independent optimizer fragments,
  loadable by every plugin.
"""
from phalanx.booster.plugins.hybrid.model import HybridModel
from phalanx.booster.plugins.hybrid.plugin import HybridParallelPlugin

__all__ = ["HybridModel", "HybridParallelPlugin"]
