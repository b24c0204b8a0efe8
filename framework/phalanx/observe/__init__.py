"""Observability for training runs: rank-0 logging, a progress bar, metrics JSONL, optional
wandb (offline by default), a throughput/MFU meter, peak memory, and a loss-curve plot.

Every heavy or optional dependency (tqdm, wandb, matplotlib) is imported only when the object
that needs it is created, so `import phalanx.observe` stays cheap and side-effect free.
"""
from phalanx.observe.log import get_logger, is_main_process
from phalanx.observe.memory import (PeakResident, current_memory_bytes, peak_memory_bytes, release_free_memory,
                                    reset_peak_memory, resident_bytes)
from phalanx.observe.metrics import MetricsWriter, read_metrics
from phalanx.observe.plot import plot_loss_curve
from phalanx.observe.progress import ProgressBar
from phalanx.observe.throughput import (ThroughputMeter, causal_lm_flops_per_token, measure_matmul_flops)
from phalanx.observe.wandb_run import WandbRun

__all__ = [
    "get_logger", "is_main_process", "current_memory_bytes", "peak_memory_bytes", "release_free_memory",
    "reset_peak_memory", "resident_bytes", "PeakResident", "MetricsWriter",
    "read_metrics", "plot_loss_curve", "ProgressBar", "ThroughputMeter", "causal_lm_flops_per_token",
    "measure_matmul_flops", "WandbRun",
]
