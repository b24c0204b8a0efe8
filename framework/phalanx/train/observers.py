"""What watches a training run: throughput/MFU, metrics.jsonl, wandb, the progress bar or log
lines, and the hang watchdog. Rank 0 writes; every rank measures."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from phalanx.amp.precision import Precision
from phalanx.config import config_to_dict
from phalanx.observe import MetricsWriter, ProgressBar, ThroughputMeter, WandbRun, measure_matmul_flops
from phalanx.train.config import TrainConfig
from phalanx.watchdog import Watchdog

METRICS_FILE, PLOT_FILE = "metrics.jsonl", "loss.png"


class RunObservers:
    def __init__(self, cfg: TrainConfig, precision: Precision, device: torch.device, output_dir: Path, *,
                 start_step: int, resumed: bool, wandb_run_id: str | None, measure_flops: bool, log: Any):
        self.log = log
        self.main = dist.get_rank() == 0
        peak = peak_flops(cfg, precision, device) if measure_flops else None
        self.meter = ThroughputMeter(world_size=dist.get_world_size(), peak_flops=peak)
        self.metrics = MetricsWriter(output_dir / METRICS_FILE, enabled=self.main,
                                     resume_step=start_step if resumed else None)
        self.wandb = None
        if cfg.wandb and self.main:
            self.wandb = WandbRun(project=cfg.wandb_project, directory=output_dir, config=config_to_dict(cfg),
                                  mode=cfg.wandb_mode, run_id=wandb_run_id)
        self.show_bar = self.main and cfg.progress_bar and _is_tty()
        self.bar = ProgressBar(cfg.max_steps, initial=start_step, enabled=self.show_bar)
        self.dog = Watchdog(cfg.hang_timeout_s).start() if cfg.hang_timeout_s else None

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb else None

    def event(self, record: Mapping[str, Any]) -> None:
        """A metrics.jsonl record that is not a step's numbers (a skip, a rollback)."""
        self.metrics.log(dict(record))

    def log_step(self, record: Mapping[str, Any]) -> None:
        self.metrics.log(dict(record))
        if self.wandb:
            self.wandb.log(dict(record), step=record["step"])
        if self.show_bar:
            self.bar.update(0, loss=record["loss"], lr=record["lr"], tok_s=record["tokens_per_s"], mfu=record["mfu"])
        else:
            self.log.info(log_line(record))

    def log_eval(self, step: int, result: Mapping[str, float]) -> None:
        named = {f"eval/{k}": v for k, v in result.items()}
        self.metrics.log({"step": step, **named})
        if self.wandb:
            self.wandb.log(named, step=step)
        self.log.info(f"step {step} eval: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))

    def close(self) -> None:
        if self.dog is not None:
            self.dog.stop()
        self.bar.close()
        self.metrics.close()
        if self.wandb:
            self.wandb.finish()


def peak_flops(cfg: TrainConfig, precision: Precision, device: torch.device) -> float | None:
    """One device's peak FLOP/s for the MFU meter: the config's figure, or measured (0: no MFU)."""
    if cfg.peak_tflops == 0:
        return None
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    return measure_matmul_flops(device, precision.compute_dtype, min_seconds=0.15)


def log_line(record: Mapping[str, Any]) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3g}"]
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3g}")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    if record.get("mfu"):
        parts.append(f"MFU {record['mfu']:.1%}")
    return " | ".join(parts)


def _is_tty() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
