"""The plan's estimate for a run that is about to start (or just ended), to print beside the
measured peak: `estimate_for_run(model, plugin, seq, micro_batch, world)`."""
from __future__ import annotations

from typing import Any

from phalanx.plan.layout import Layout
from phalanx.plan.planner import LayoutEstimate, estimate_layout
from phalanx.plan.units import gib
from phalanx.plan.workload import Hardware, Workload


def layout_of(plugin: Any, world: int) -> tuple[Layout, dict]:
    """The Layout of a Booster plugin object (or a TrainConfig: its plugin name and options),
    and the workload settings the plugin fixes (precision, bucket and chunk sizes, pipeline
    microbatches)."""
    if hasattr(plugin, "plugin_options") and hasattr(plugin, "micro_batch_size"):  # a TrainConfig
        from phalanx.amp.precision import resolve_precision
        from phalanx.booster.plugins import make_plugin
        plugin = make_plugin(plugin.plugin, resolve_precision(plugin.precision), None, **plugin.plugin_options)
    kind = type(plugin).__name__
    extra = {"dtype": getattr(plugin, "precision", "fp32")}
    if kind == "DDPPlugin":
        return Layout("ddp", world), extra
    if kind == "FSDPPlugin":
        return Layout("fsdp", world), extra
    if kind == "ZeroPlugin":
        c = plugin.config
        extra["bucket_mb"] = c.reduce_bucket_mb
        return Layout("zero", world, zero_stage=c.stage, offload_optim=c.cpu_offload), extra
    if kind == "GeminiPlugin":
        if plugin.chunk_size_mb is not None:
            extra["gemini_chunk_mb"] = plugin.chunk_size_mb
        return Layout("gemini", world, offload_optim=plugin.offload_optim_frac > 0,
                      offload_param=plugin.offload_param_frac > 0), extra
    if kind == "HybridParallelPlugin":
        extra["bucket_mb"] = plugin.zero_options.get("reduce_bucket_mb", 25.0)
        extra["microbatches"] = plugin.num_microbatches or 1
        return Layout("hybrid", world, zero_stage=plugin.zero_stage, tp=plugin.tp_size, pp=plugin.pp_size,
                      sp=plugin.sp_size, sp_mode=plugin.sequence_parallelism, pp_schedule=plugin.pp_schedule,
                      checkpointing=bool(plugin.gradient_checkpointing),
                      offload_optim=bool(plugin.zero_options.get("cpu_offload", False))), extra
    raise ValueError(f"estimate_for_run does not know plugin {kind}: pass DDPPlugin, FSDPPlugin, ZeroPlugin, "
                     "GeminiPlugin, HybridParallelPlugin or a TrainConfig")


def estimate_for_run(model: Any, plugin: Any, seq: int, micro_batch: int, world: int, *,
                     loss: str = "fused", checkpointing: bool | None = None,
                     microbatches: int | None = None) -> LayoutEstimate:
    """Estimate the per-rank peak of training `model` (an HF model, its config, a config dict or
    a preset name) under `plugin` (a Booster plugin or a TrainConfig) with `micro_batch` samples
    of `seq` tokens per rank. `loss`: "fused" for phalanx.train.fit's loss, "hf" for the model's
    own. The estimate's `memory.device_total` is what to print beside the measured peak."""
    from phalanx.plan.model import load_spec

    spec = load_spec(getattr(model, "config", model))
    layout, extra = layout_of(plugin, world)
    if checkpointing is not None:
        layout = Layout(**{**layout.__dict__, "checkpointing": checkpointing})
    dtype = extra.pop("dtype")
    from_plugin = extra.pop("microbatches", 1)
    m = microbatches or from_plugin
    if dtype not in ("fp32", "bf16", "fp16"):
        from phalanx.amp.precision import resolve_precision
        dtype = resolve_precision(dtype)
    if layout.pp > 1:  # the pipeline cuts the rank's batch into m microbatches
        per_microbatch = max(1, micro_batch // m)
        work = Workload(seq=seq, micro_batch=per_microbatch, global_batch=per_microbatch * m * layout.dp,
                        dtype=dtype, loss=loss, **extra)
    else:
        work = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype, loss=loss, **extra)
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

    On a GPU the peak is `torch.cuda.max_memory_allocated` since the probe started. On CPU it is
    the resident high-water mark minus the baseline at the start, where the baseline leaves out
    the model's own parameters and buffers (already resident, and part of what the plan counts)."""

    def __init__(self, model: Any, device: Any = None):
        from phalanx.observe.memory import current_memory_bytes, reset_peak_memory

        import torch

        from phalanx_kernels.accelerator import current_device

        self.model = model
        self.device = torch.device(device) if device is not None else None
        on_cpu = (self.device or current_device()).type == "cpu"
        resident_model = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                             if t.device.type == "cpu") if on_cpu and hasattr(model, "parameters") else 0
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
