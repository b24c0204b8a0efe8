"""The plan's estimate for a run that is about to start (or just ended), to print beside the
measured peak: `estimate_for_run(model, plugin, seq, micro_batch, world)`."""
from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.plan.layout import Layout
from phalanx.plan.planner import LayoutEstimate, estimate_layout
from phalanx.plan.units import gib
from phalanx.plan.workload import Hardware, Workload


def layout_of(plugin: Any, world: int) -> tuple[Layout, dict]:
    """The Layout of a Booster plugin object (or a TrainConfig: its plugin name and options),
    and the workload settings the plugin fixes (precision, bucket and chunk sizes, pipeline
    microbatches): each plugin says its own (`Plugin.plan_layout`)."""
    if hasattr(plugin, "plugin_options") and hasattr(plugin, "micro_batch_size"):  # a TrainConfig
        from phalanx.booster.plugins import make_plugin
        plugin = make_plugin(plugin.plugin, plugin.precision, None, **plugin.plugin_options)
    if not callable(getattr(plugin, "plan_layout", None)):
        raise ValueError(f"estimate_for_run does not know plugin {type(plugin).__name__}: pass a Booster plugin "
                         "(DDPPlugin, FSDPPlugin, ZeroPlugin, GeminiPlugin, HybridParallelPlugin) or a TrainConfig")
    layout, extra = plugin.plan_layout(world)
    # the planner's Layout carries expert parallelism (HybridParallelPlugin's ep_size)
    return Layout.of(layout, ep=max(getattr(layout, "ep", 1), getattr(plugin, "ep_size", 1) or 1)), extra


def lora_of(model: Any):
    """The LoRA of a `peft.PeftModel` (its active adapter's rank and targets), else None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    config = configs.get(getattr(model, "active_adapter", None)) or next(iter(configs.values()))
    if not hasattr(config, "r"):
        return None
    targets = config.target_modules or ()
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    params = config.target_parameters or ()
    return dict(rank=config.r, target_modules=targets, target_parameters=tuple(params))


def estimate_for_run(model: Any, plugin: Any, seq: int, micro_batch: int, world: int, *,
                     loss: str = "fused", checkpointing: bool | None = None,
                     microbatches: int | None = None, lora=None) -> LayoutEstimate:
    """Estimate the per-rank peak of training `model` (an HF model, its config, a config dict or
    a preset name) under `plugin` (a Booster plugin or a TrainConfig) with `micro_batch` samples
    of `seq` tokens per rank. `loss`: "fused" for phalanx.train.fit's loss, "hf" for the model's
    own. `lora`: the run's adapters ({rank, target_modules}, a recipe's `lora:` section, or None
    for full fine-tuning). The estimate's `memory.device_total` is what to print beside the measured peak."""
    from phalanx.plan.model import load_spec

    spec = load_spec(getattr(model, "config", model))
    layout, extra = layout_of(plugin, world)
    if lora is None:
        lora = lora_of(model)
    if checkpointing is not None:
        layout = dataclasses.replace(layout, checkpointing=checkpointing)
    dtype = extra.pop("dtype")
    from_plugin = extra.pop("microbatches", 1)
    m = microbatches or from_plugin
    if layout.pp > 1:  # the pipeline cuts the rank's batch into m microbatches
        per_microbatch = max(1, micro_batch // m)
        work = Workload(seq=seq, micro_batch=per_microbatch, global_batch=per_microbatch * m * layout.dp,
                        dtype=dtype, loss=loss, lora=lora, **extra)
    else:
        work = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype, loss=loss, lora=lora, **extra)
    return estimate_layout(spec, layout, work, Hardware(device_memory=2**62, reserve=0))


def estimate_vs_measured(estimate: LayoutEstimate, measured_bytes: float) -> str:
    """One line for the end of a run: the plan's estimate beside the measured peak."""
    est = estimate.memory.device_total
    if measured_bytes <= 0:
        return f"memory per rank: plan estimate {gib(est)} for {estimate.name} (no measured peak)"
    return (f"memory per rank: measured peak {gib(measured_bytes)}, plan estimate {gib(est)} "
            f"({est / measured_bytes - 1:+.1%}) for {estimate.name}")


class MemoryProbe:
    """Peak memory of a run against the plan's estimate, in two lines of a training loop:

        probe = MemoryProbe(model, device)          # before boost (the model may already exist)
        ...train...
        log.info(probe.report(plugin_or_cfg, seq, micro_batch, world))

    The measured peak is the high-water mark since the probe started (on a GPU the allocator's
    `max_memory_allocated`, on CPU the resident set's VmHWM) minus a baseline taken at the start
    that leaves out the model's own parameters and buffers already on that device: they are part
    of what the plan counts, as are the gradients, optimizer state and activations that come later.
    On CPU, memory freed earlier in the process (a previous model, a warm-up) stays resident until
    it is handed back; later allocations would reuse it without raising the resident set, so the
    probe hands it back before taking the baseline."""

    def __init__(self, model: Any, device: Any = None):
        from phalanx.observe.memory import (current_memory_bytes, release_free_memory, reset_peak_memory,
                                            tensor_bytes_on)

        import torch

        from phalanx_kernels.accelerator import current_device

        self.model = model
        self.device = torch.device(device) if device is not None else current_device()
        release_free_memory()
        tensors = list(model.parameters()) + list(model.buffers()) if hasattr(model, "parameters") else []
        resident_model = tensor_bytes_on(tensors, self.device)
        reset_peak_memory(self.device)
        self.baseline = current_memory_bytes(self.device) - resident_model

    def measured(self) -> int:
        from phalanx.observe.memory import peak_memory_bytes

        return peak_memory_bytes(self.device) - self.baseline

    def report(self, plugin: Any, seq: int, micro_batch: int, world: int, *, loss: str = "fused") -> str:
        try:
            est = estimate_for_run(self.model, plugin, seq, micro_batch, world, loss=loss)
        except ValueError as exc:  # a model family or plugin the planner does not know
            return f"memory per rank: measured peak {gib(self.measured())} (no plan estimate: {exc})"
        return estimate_vs_measured(est, self.measured())
