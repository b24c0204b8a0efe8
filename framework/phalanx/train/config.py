"""`TrainConfig`: every knob of the training loop, typed, documented where it is declared.

It is a plain dataclass, so a recipe embeds it as a section of its own config and
`phalanx.config.load_config` fills it from YAML plus `train.lr=3e-4` overrides, checking keys
and types; `validate()` then checks the values and names the key to fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from phalanx.amp.precision import CHOICES
from phalanx.config import ConfigError


@dataclass
class TrainConfig:
    # --- where and how long ----------------------------------------------------------------
    output_dir: str = "runs/train"      # checkpoints/, metrics.jsonl, loss.png and wandb/ go here
    max_steps: int = 100                # optimizer steps (each = micro_batch_size x grad_accum_steps x dp ranks samples)
    micro_batch_size: int = 4           # samples per rank per forward/backward
    grad_accum_steps: int = 1           # micro-batches accumulated per optimizer step

    # --- optimizer (AdamW) and schedule (linear warm-up, cosine decay) ----------------------------
    lr: float = 3e-4                    # peak learning rate, reached after warmup_steps
    warmup_steps: int = 0               # linear warm-up from lr / (warmup_steps + 1) to lr
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio ...
    decay_steps: int | None = None      # ... at this step (default: max_steps), constant after
    weight_decay: float = 0.0           # decoupled decay on matrices; never on norms and biases
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0          # global gradient-norm clipping; 0 disables

    # --- parallel layout and precision ----------------------------------------------------------
    plugin: str = "ddp"                 # a name make_plugin knows: ddp | fsdp | zero1 | zero2 | gemini | hybrid
    plugin_options: dict[str, Any] = field(default_factory=dict)  # the plugin's own keyword arguments,
                                        # e.g. {reduce_bucket_mb: 50} for zero2, {tp_size: 2} for hybrid
    precision: Literal[CHOICES] = "fp32"  # amp.precision.CHOICES; bf16/fp16 compute with fp32 master
                                        # weights; auto: bf16 where the device computes it natively, else fp32

    # --- evaluation, checkpoints, logging ---------------------------------------------------------
    eval_every: int = 0                 # run eval_fn every N steps (0: only at the end)
    save_every: int = 0                 # checkpoint every N steps (0: only the final one)
    keep_last: int = 2                  # complete checkpoints to keep (0: keep all)
    log_every: int = 1                  # metrics line / progress postfix every N steps
    resume: bool = True                 # continue from the latest complete checkpoint in output_dir
    seed: int = 42                      # data order and per-rank RNG streams

    # --- surviving faults (see docs/reliability.md) ------------------------------------------
    async_save: bool = False            # snapshot to host memory, write checkpoints in a background thread
    on_save_error: Literal["warn", "stop"] = "warn"  # a save that fails (disk full): warn and train on
                                        # (the previous checkpoint stays intact), or stop; a failed final save always stops
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"  # NaN/inf loss: stop; skip the step; or
                                        # reload the last checkpoint and scale lr by rollback_lr_factor
    max_nonfinite: int = 10             # skips or rollbacks allowed in one run before stopping anyway
    rollback_lr_factor: float = 0.5     # learning-rate multiplier applied at each rollback
    hang_timeout_s: float = 0.0         # watchdog: name the missing rank and stop when an operation
                                        # takes longer than this (0: off)

    # --- observability ------------------------------------------------------------------------
    wandb: bool = False                 # also log to Weights & Biases
    wandb_project: str = "phalanx"
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: nothing leaves the machine
    progress_bar: bool = True           # rank-0 tqdm bar with loss / lr / tokens per second
    plot: bool = True                   # write loss.png at the end
    peak_tflops: float | None = None    # one device's peak, for MFU; None: measure a matmul; 0: no MFU

    # --- data and loss ------------------------------------------------------------------------
    num_workers: int = 0                # DataLoader worker processes per rank
    loss_chunk_size: int | None = None  # tokens per chunk of the fused LM-head loss (None: kernel default)

    @property
    def pp_size(self) -> int:
        """pp_size of a hybrid layout (1 without a pipeline): each rank then holds only its stages,
        so fit trains with the built-in loss and one micro-batch per step (the schedule accumulates)."""
        return int(self.plugin_options.get("pp_size", 1)) if self.plugin == "hybrid" else 1

    def with_replica_groups(self, ranks: int, key: str, plugins: tuple[str, ...] | None = None) -> "TrainConfig":
        """This config with data replicas of `ranks` consecutive ranks (the plugin's
        `ranks_per_replica`), for a recipe whose `key` setting splits one sample over that many ranks;
        `ranks` = 1 gives the config unchanged. Raises ConfigError naming `key` when `plugin` is not
        one of `plugins` (default: every plugin that takes replica groups)."""
        from phalanx.booster.plugins import REPLICA_GROUP_PLUGINS

        plugins = plugins or REPLICA_GROUP_PLUGINS
        if ranks == 1:
            return self
        if self.plugin not in plugins:
            raise ConfigError(f"config '{key}'={ranks} runs under train.plugin = {' / '.join(plugins)} (its groups of "
                              f"{ranks} ranks are the data replicas, the plugin's ranks_per_replica), got "
                              f"train.plugin={self.plugin!r}: choose one of those, or {key}=1")
        return dataclasses.replace(self, plugin_options={**self.plugin_options, "ranks_per_replica": ranks})

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value cannot work."""
        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"train config '{key}'={getattr(self, key)!r}: {why}")

        from phalanx.booster.plugins import PLUGIN_NAMES  # the one list of plugin names

        need(bool(str(self.output_dir).strip()), "output_dir", "must name a directory")
        need(self.plugin in PLUGIN_NAMES, "plugin", f"choose one of {', '.join(PLUGIN_NAMES)}")
        need(self.precision in CHOICES, "precision", f"choose one of {', '.join(CHOICES)}")
        need(self.max_steps >= 1, "max_steps", "must be at least 1")
        need(self.micro_batch_size >= 1, "micro_batch_size", "must be at least 1")
        need(self.grad_accum_steps >= 1, "grad_accum_steps", "must be at least 1")
        need(self.lr > 0, "lr", "must be positive")
        need(self.warmup_steps >= 0, "warmup_steps", "must be 0 or more")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be between 0 and 1")
        need(self.decay_steps is None or self.decay_steps > self.warmup_steps, "decay_steps",
             f"must be larger than warmup_steps={self.warmup_steps}")
        need(self.weight_decay >= 0, "weight_decay", "must be 0 or more")
        need(0.0 <= self.adam_beta1 < 1.0, "adam_beta1", "must be in [0, 1)")
        need(0.0 <= self.adam_beta2 < 1.0, "adam_beta2", "must be in [0, 1)")
        need(self.adam_eps > 0, "adam_eps", "must be positive")
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be 0 (off) or positive")
        for key in ("eval_every", "save_every", "keep_last"):
            need(getattr(self, key) >= 0, key, "must be 0 or more")
        need(self.log_every >= 1, "log_every", "must be at least 1")
        need(self.peak_tflops is None or self.peak_tflops >= 0, "peak_tflops", "must be 0 (off), positive, or null")
        need(self.num_workers >= 0, "num_workers", "must be 0 or more")
        need(self.on_save_error in ("warn", "stop"), "on_save_error", "choose 'warn' or 'stop'")
        need(self.on_nonfinite in ("stop", "skip", "rollback"), "on_nonfinite", "choose 'stop', 'skip' or 'rollback'")
        need(self.max_nonfinite >= 1, "max_nonfinite", "must be at least 1")
        need(0.0 < self.rollback_lr_factor <= 1.0, "rollback_lr_factor", "must be in (0, 1]")
        need(self.hang_timeout_s >= 0, "hang_timeout_s", "must be 0 (off) or positive seconds")
        need(self.loss_chunk_size is None or self.loss_chunk_size >= 1, "loss_chunk_size", "must be positive or null")

    @property
    def lr_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else self.max_steps
