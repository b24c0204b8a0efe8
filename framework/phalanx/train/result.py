"""What `fit` returns, on every rank."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainResult:
    final_step: int                       # the last optimizer step completed (== max_steps on success)
    losses: list[float]                   # global mean loss of each step this call ran (start_step+1 ... final_step)
    metrics_path: Path                    # output_dir/metrics.jsonl (written by rank 0)
    checkpoint_dir: Path | None           # the last complete checkpoint, or None
    last_eval: dict[str, float] = field(default_factory=dict)  # what eval_fn returned last
    start_step: int = 0                   # the step this call resumed from (0 for a fresh run)
    tokens_per_s: float | None = None     # global, excluding the first (warm-up) step
    tflops_per_rank: float | None = None  # achieved model FLOP/s per rank, in TFLOP/s
    mfu: float | None = None              # tflops_per_rank / one device's peak
    loss_plot: Path | None = None         # output_dir/loss.png
    wall_time_s: float = 0.0
