"""Memory per rank and step time of each parallel layout, and a recommendation (docs/plan.md).

    from phalanx.plan import plan
    for e in plan("llama2-7b", world_size=8, device_memory="80GiB")[:3]:
        print(e.name, e.fits, e.memory.device_total, e.time.total)
"""
from phalanx.plan.layout import Layout, candidate_layouts
from phalanx.plan.lora import LoRA
from phalanx.plan.memory import MemoryEstimate, estimate_memory
from phalanx.plan.model import PRESETS, ModelSpec, load_spec, spec_from_config
from phalanx.plan.planner import LayoutEstimate, estimate_layout, plan, suggest_fix
from phalanx.plan.run import MemoryProbe, estimate_for_run, estimate_vs_measured
from phalanx.plan.timing import StepTime, estimate_time
from phalanx.plan.workload import Hardware, Workload

__all__ = ["plan", "suggest_fix", "LoRA", "estimate_layout", "estimate_for_run", "estimate_vs_measured", "MemoryProbe", "LayoutEstimate", "Layout", "candidate_layouts",
           "MemoryEstimate", "estimate_memory", "StepTime", "estimate_time", "ModelSpec", "load_spec",
           "spec_from_config", "PRESETS", "Hardware", "Workload"]
