"""`TrainingRun`: what `fit` does, as phases over explicit state.

    run = TrainingRun(cfg, model, dataset, ...)   # 1. check inputs, pick the plugin (nothing written)
    run.setup()                                   # 2-4. resume point, optimizer, layout, output dir, restore
    try:
        run.train()                               # 5. steps, evals, checkpoints
    finally:
        run.close()
    result = run.result()                         # 6. loss plot, summary, memory line

The loop's numbers live in `Progress` (what a rollback rewinds); the observers (metrics, wandb,
progress bar, watchdog) in `RunObservers`. Loss normalisation is explained in `loop.py`.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from phalanx.amp.optimizer_wrapper import OptimizerWrapper
from phalanx.amp.precision import resolve_precision
from phalanx.booster import Booster
from phalanx.booster.plugins import make_plugin
from phalanx.checkpoint.train_state import TrainState, checkpoint_path
from phalanx.checkpoint.writer import CheckpointSaveError, CheckpointWriter
from phalanx.config import ConfigError, config_to_dict
from phalanx.device import to_device
from phalanx.launch import context, seed_everything
from phalanx.malloc import give_back_freed_memory
from phalanx.observe import get_logger, plot_loss_curve
from phalanx.plan import MemoryProbe
from phalanx.train.checkpointing import existing_checkpoints, from_rank0, remove_partial_saves, resume_checkpoint
from phalanx.train.config import TrainConfig
from phalanx.train.data import MicroBatches, check_dataset, check_first_sample, default_collate
from phalanx.train.evaluate import eval_mode, eval_results
from phalanx.train.losses import CausalLMLoss, check_causal_lm
from phalanx.train.nonfinite import NonFiniteLossError, NonFinitePolicy
from phalanx.train.observers import METRICS_FILE, PLOT_FILE, RunObservers
from phalanx.train.optim import build_lr_scheduler, build_optimizer
from phalanx.train.result import TrainResult
from phalanx.train.step import LossFn, step_flops_estimator, train_step
from phalanx.watchdog import set_step, track

# fp16 skips steps whose gradients overflow (the loss scaler backs off); this many non-finite
# losses in a row means the run itself is broken, not the scale.
FP16_MAX_NONFINITE_STEPS = 10

EvalFn = Callable[[nn.Module, int], Mapping[str, Any]]


@dataclasses.dataclass
class Progress:
    """Where the run is; a rollback rewinds it to a checkpoint's step."""
    start_step: int
    step: int
    tokens_seen: int
    losses: list[float] = dataclasses.field(default_factory=list)         # one per completed step
    window_losses: list[float] = dataclasses.field(default_factory=list)  # since the last log line
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    evaluated_at: int | None = None
    nonfinite_streak: int = 0
    last_micro: list = dataclasses.field(default_factory=list)  # the last step's batches (for the memory line)


class TrainingRun:
    """One call of `fit`. Construction checks everything that can be wrong with the inputs and
    touches no file; `setup` applies the layout and restores; `train` runs the steps."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, train_dataset: Any, collate_fn: Callable | None = None,
                 loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None,
                 flops_per_token: float | None = None, *, tokenizer: Any = None, hooks: Sequence[Any] = ()):
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"fit expects a TrainConfig, got {type(cfg).__name__}")
        cfg.validate()
        self.wall_start = time.perf_counter()
        self.device = context().device
        self.log = get_logger("phalanx.train")
        # `auto` becomes what this device computes fast, once: the plugin, the MFU meter, the
        # logs and the saved config all name the precision that actually runs.
        self.precision = resolve_precision(cfg.precision, self.device)
        self.cfg = cfg = dataclasses.replace(cfg, precision=self.precision.name)
        self.model, self.dataset, self.loss_fn, self.eval_fn = model, train_dataset, loss_fn, eval_fn
        self.tokenizer, self.hooks = tokenizer, list(hooks)
        self.output_dir = Path(cfg.output_dir)

        _check_pipeline_options(cfg, loss_fn)
        self.plugin = _make_plugin(cfg, self.precision)
        # A tensor/sequence-parallel plugin installs a vocabulary-parallel loss in the model itself;
        # every other layout gets the fused head + cross-entropy wrapper.
        self.model_computes_loss = loss_fn is None and self.plugin.model_computes_causal_lm_loss
        if self.model_computes_loss:
            check_causal_lm(model)
        self.train_module = (CausalLMLoss(model, chunk_size=cfg.loss_chunk_size)
                             if loss_fn is None and not self.model_computes_loss else model)
        self.step_flops = step_flops_estimator(model, flops_per_token)
        self.booster = Booster(self.plugin)
        self.dp_size = self.booster.plugin.dp_size
        check_dataset(train_dataset, cfg.micro_batch_size, self.dp_size)
        self.collate_fn = collate_fn or default_collate
        check_first_sample(train_dataset, self.collate_fn, ("input_ids",) if loss_fn is None else ())
        # Which checkpoint to continue from (read-only: rank 0 looks, every rank follows).
        self.resume_from = resume_checkpoint(self.output_dir) if cfg.resume else None
        if not cfg.resume:
            found = existing_checkpoints(self.output_dir)
            if found:
                raise FileExistsError(f"{str(self.output_dir)!r} already holds checkpoints (steps {found}); set "
                                      "resume=true to continue that run, or choose a new output_dir")

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        """Optimizer and schedule on the original model, the parallel layout (a plugin that rejects
        the layout or the optimizer fails here, still before anything is written), then the output
        directory, resume and the observers."""
        cfg = self.cfg
        seed_everything(cfg.seed, self.plugin.seed_rank, per_rank=True)
        self.optimizer = build_optimizer(self.train_module, cfg)
        scheduler = build_lr_scheduler(self.optimizer, cfg)
        loader = DataLoader(self.dataset, batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True,
                            collate_fn=self.collate_fn, num_workers=cfg.num_workers)
        self.memory_probe = MemoryProbe(self.model, self.device)  # this run's peak, beside the plan's estimate
        self.model_b, optim_b, _, loader_b, self.scheduler = self.booster.boost(
            self.train_module, self.optimizer, None, loader, scheduler, seed=cfg.seed)
        if not isinstance(optim_b, OptimizerWrapper):
            raise TypeError(f"plugin {cfg.plugin!r} returned a {type(optim_b).__name__}, not an OptimizerWrapper")
        self.optim_b: OptimizerWrapper = optim_b
        self.batches = MicroBatches(loader_b)
        for hook in self.hooks:
            hook.bind(self.model_b)

        if dist.get_rank() == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_saves(self.output_dir)
        state = TrainState()
        if self.resume_from is not None:
            state = self._restore(self.resume_from)
            if state.world_size != dist.get_world_size():
                self.log.warning(f"resuming a {state.world_size}-rank checkpoint on {dist.get_world_size()} ranks: "
                                 "the data position is carried over, the per-rank RNG streams restart")
            self.log.info(f"resumed from {self.resume_from} (step {state.step})")
            self._warn_if_schedule_changed(state.extra.get("train_config"))
        self.progress = Progress(start_step=state.step, step=state.step, tokens_seen=state.tokens_seen)
        self.log.info(f"training {type(self.model).__name__} with {self.booster.plugin.describe()}: steps "
                      f"{state.step + 1}..{cfg.max_steps}, global batch {cfg.micro_batch_size} x "
                      f"{cfg.grad_accum_steps} x {self.dp_size} samples")
        self.nonfinite = NonFinitePolicy(cfg, lr_scale=state.extra.get("lr_scale", 1.0))
        self.writer = CheckpointWriter(self.booster, self.output_dir, keep_last=cfg.keep_last,
                                       async_write=cfg.async_save, on_error=cfg.on_save_error,
                                       last_good=self.resume_from)
        self.observers = RunObservers(cfg, self.precision, self.device, self.output_dir, start_step=state.step,
                                      resumed=self.resume_from is not None,
                                      wandb_run_id=state.extra.get("wandb_run_id"),
                                      measure_flops=self.step_flops is not None, log=self.log)
        self.wandb_run_id = self.observers.wandb_id or state.extra.get("wandb_run_id")

    def _warn_if_schedule_changed(self, saved: dict | None) -> None:
        """The learning-rate schedule is rebuilt from the config, not stored: resuming with other
        schedule settings (most often a raised max_steps with decay_steps unset, which moves the
        cosine's end) continues on another curve than the checkpoint's run. Say so, once."""
        if not saved:
            return
        cfg, changed = self.cfg, []
        for key in ("lr", "warmup_steps", "min_lr_ratio"):
            if key in saved and saved[key] != getattr(cfg, key):
                changed.append(f"{key} {saved[key]!r} -> {getattr(cfg, key)!r}")
        was = saved["decay_steps"] if saved.get("decay_steps") is not None else saved.get("max_steps")  # lr_decay_steps
        if was is not None and was != cfg.lr_decay_steps:
            changed.append(f"the cosine ends at step {was} -> {cfg.lr_decay_steps} (decay_steps, else max_steps)")
        if changed:
            self.log.warning("resuming with another learning-rate schedule than the checkpoint's run: "
                             + "; ".join(changed) + ". The resumed steps follow the new one; to extend a run on its "
                             "schedule, set train.decay_steps to the old horizon when raising max_steps")

    def _restore(self, checkpoint: Path) -> TrainState:
        restored = self.booster.load_checkpoint(checkpoint, self.model_b, self.optim_b, self.scheduler)
        self.batches.load_state_dict(restored.sampler)
        for hook in self.hooks:
            hook.load(checkpoint / hook.name)
        return restored

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> None:
        """Steps up to max_steps with their logs, evals and checkpoints; then the final eval."""
        cfg, p = self.cfg, self.progress
        self.model_b.train()
        while p.step < cfg.max_steps:
            if not self.step():
                continue
            if self.eval_fn is not None and cfg.eval_every and p.step % cfg.eval_every == 0:
                with track("eval"):
                    p.last_eval, p.evaluated_at = self.evaluate(p.step), p.step
            if (cfg.save_every and p.step % cfg.save_every == 0) or p.step == cfg.max_steps:
                self.checkpoint(p.step)
        with track("wait for checkpoint"):
            self.writer.wait()
        final = self.writer.outcomes[-1] if self.writer.outcomes else None
        if final is not None and final.step == p.step and not final.ok:  # the only copy of the final weights
            raise CheckpointSaveError(self.writer.failure_message(final) + " The final checkpoint is missing.")
        # The final checkpoint was written at max_steps above (a resumed run that was already
        # complete keeps its checkpoint); then the final eval.
        if self.eval_fn is not None and p.evaluated_at != p.step:
            p.last_eval = self.evaluate(p.step)

    def step(self) -> bool:
        """One optimizer step; False when a non-finite loss rolled the run back instead."""
        cfg, p = self.cfg, self.progress
        p.step += 1
        set_step(p.step)
        t0 = time.perf_counter()
        with track("load batch"):
            p.last_micro = [_to_device(next(self.batches), self.device) for _ in range(cfg.grad_accum_steps)]
        loss, tokens, flops = train_step(self.booster, self.model_b, self.optim_b, p.last_micro, self.loss_fn,
                                         self.dp_size, self.step_flops, self.device,
                                         model_computes_loss=self.model_computes_loss)
        skip = False
        if not math.isfinite(loss):
            p.nonfinite_streak += 1
            if not self.precision.loss_scaling or p.nonfinite_streak >= FP16_MAX_NONFINITE_STEPS:
                if self.nonfinite.decide(self._nonfinite_message(loss)) == "rollback":
                    self.optim_b.zero_grad()
                    self.roll_back(loss)
                    return False
                skip = True
                self.log.warning(f"training loss is {loss} at step {p.step}: skipped the step (gradients dropped, "
                                 f"skip {self.nonfinite.count} of at most {cfg.max_nonfinite})")
                self.observers.event({"step": p.step, "event": "nonfinite_skip", "skips": self.nonfinite.count})
        else:
            p.nonfinite_streak = 0
        lr = self.optimizer.param_groups[0]["lr"]
        if not skip:
            with track("optimizer step"):
                self.optim_b.step()
        with warnings.catch_warnings():
            # The order is right by construction; a plugin whose optimizer steps its own copy
            # (Gemini) just never calls the wrapped `step` the scheduler looks for.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        self.optim_b.zero_grad()
        for hook in self.hooks:
            hook.after_step(p.step)
        self.observers.meter.step(tokens, time.perf_counter() - t0, flops)
        p.tokens_seen += tokens
        if not skip:
            p.losses.append(loss)
            p.window_losses.append(loss)
        self._report_step(lr, skip)
        self.observers.bar.update(1)
        return True

    def _report_step(self, lr: float, skip: bool) -> None:
        p = self.progress
        if not ((p.step % self.cfg.log_every == 0 or p.step == self.cfg.max_steps) and p.window_losses):
            return
        record = {"step": p.step, "loss": sum(p.window_losses) / len(p.window_losses), "lr": lr,
                  "grad_norm": self.optim_b.last_grad_norm, "tokens_seen": p.tokens_seen,
                  "epoch": self.batches.epoch, **self.observers.meter.window(),
                  "skipped": skip or self.optim_b.skipped, "elapsed_s": time.perf_counter() - self.wall_start}
        record.update(getattr(self.plugin, "step_metrics", dict)())  # e.g. per-expert token counts (hybrid, ep)
        p.window_losses.clear()
        self.observers.log_step(record)

    # -- evaluate, checkpoint, roll back --------------------------------------------------------
    def evaluate(self, at_step: int) -> dict[str, float]:
        with eval_mode(self.model_b, self.model):
            raw = self.eval_fn(self.model, at_step)
        result = eval_results(raw, at_step)
        self.observers.log_eval(at_step, result)
        return result

    def checkpoint(self, at_step: int) -> None:
        p = self.progress
        train_state = TrainState(step=at_step, epoch=self.batches.epoch, sampler=self.batches.state_dict(),
                                 tokens_seen=p.tokens_seen,
                                 extra={"wandb_run_id": self.wandb_run_id, "train_config": config_to_dict(self.cfg),
                                        "lr_scale": self.nonfinite.lr_scale})
        hooks_writer = self._write_hooks if self.hooks else None
        with track("checkpoint snapshot"):
            self.writer.save(checkpoint_path(self.output_dir, at_step), at_step, self.model_b, self.optim_b,
                             self.scheduler, train_state, tokenizer=self.tokenizer, hooks_writer=hooks_writer)

    def _write_hooks(self, checkpoint_dir: Path) -> Callable[[], None]:
        """Every hook's state into the checkpoint: hooks with `snapshot(dir)` copy now and write
        with the checkpoint's other files (in the background under async_save); `save(dir)` writes now."""
        later = [hook.snapshot(checkpoint_dir / hook.name) if hasattr(hook, "snapshot")
                 else hook.save(checkpoint_dir / hook.name) for hook in self.hooks]

        def write() -> None:
            for files in later:
                if files is not None:
                    files()
        return write

    def roll_back(self, loss: float) -> None:
        """Load the last complete checkpoint, scale the learning rate down, rewind the progress."""
        p = self.progress
        with track("wait for checkpoint"):
            self.writer.wait()
        if self.writer.last_good is None:
            raise NonFiniteLossError(self._nonfinite_message(loss) + " (on_nonfinite='rollback' needs a "
                                     "checkpoint to return to: set save_every)")
        restored = self._restore(self.writer.last_good)
        self.nonfinite.scale_lr(self.scheduler, self.optimizer, restored_scale=restored.extra.get("lr_scale", 1.0))
        self.log.warning(f"training loss is {loss} at step {p.step}: rolled back to {self.writer.last_good} (step "
                         f"{restored.step}) with the learning rate scaled by {self.nonfinite.lr_scale:g} "
                         f"(rollback {self.nonfinite.count} of at most {self.cfg.max_nonfinite})")
        self.observers.event({"step": p.step, "event": "nonfinite_rollback", "to_step": restored.step,
                              "lr_scale": self.nonfinite.lr_scale})
        del p.losses[max(0, restored.step - p.start_step):]
        p.step, p.tokens_seen = restored.step, restored.tokens_seen
        p.window_losses.clear()

    def _nonfinite_message(self, loss: float) -> str:
        last = self.writer.last_good
        where = f"the last checkpoint, {last}, is intact" if last else "no checkpoint was written"
        hint = ("lower lr or raise warmup_steps, set max_grad_norm, check the data for empty or corrupt samples"
                + (", or train in bf16/fp32 instead of fp16" if self.precision.loss_scaling else ""))
        return (f"training loss is {loss} at step {self.progress.step}; stopped before applying that step "
                f"({where}). Fix: {hint}")

    # -- the end --------------------------------------------------------------------------------
    def close(self) -> None:
        """Always runs (also after an error): the writer's thread, freed memory, the observers."""
        self.writer.close()
        give_back_freed_memory()
        self.observers.close()

    def result(self) -> TrainResult:
        """The loss plot, the summary lines and the `TrainResult` (every rank)."""
        cfg, p = self.cfg, self.progress
        plot = None
        if dist.get_rank() == 0 and cfg.plot:
            plot = plot_loss_curve(self.output_dir / METRICS_FILE, self.output_dir / PLOT_FILE,
                                   title=f"{type(self.model).__name__} ({cfg.plugin}, {self.precision.name})")
        plot = from_rank0(str(plot) if plot else None)
        summary = self.observers.meter.summary()
        if summary["tokens_per_s"] is not None:
            self.log.info(f"done at step {p.step}: {summary['tokens_per_s']:.0f} tokens/s"
                          + (f", {summary['tflops_per_rank']:.3g} TFLOP/s per rank" if summary["tflops_per_rank"]
                             else "")
                          + (f", MFU {summary['mfu']:.1%}" if summary["mfu"] else ""))
        if p.step > p.start_step:
            self.log.info(self._memory_line())
        return TrainResult(final_step=p.step, losses=p.losses, metrics_path=self.output_dir / METRICS_FILE,
                           checkpoint_dir=self.writer.last_good, last_eval=p.last_eval, start_step=p.start_step,
                           tokens_per_s=summary["tokens_per_s"], tflops_per_rank=summary["tflops_per_rank"],
                           mfu=summary["mfu"], loss_plot=Path(plot) if plot else None,
                           wall_time_s=time.perf_counter() - self.wall_start)

    def _memory_line(self) -> str:
        """The measured peak per rank beside `phalanx plan`'s estimate for this layout (docs/plan.md)."""
        micro = self.progress.last_micro
        ids = micro[0].get("input_ids") if micro else None
        measured = f"memory per rank: measured peak {self.memory_probe.measured() / 2**30:.2f} GiB"
        if not isinstance(ids, torch.Tensor):
            return measured
        try:
            return self.memory_probe.report(self.plugin, ids.shape[-1], self.cfg.micro_batch_size,
                                            dist.get_world_size(), loss="hf" if self.model_computes_loss else "fused")
        except Exception as exc:  # the planner knows LLM families only; the peak is still worth printing
            return f"{measured} (no plan estimate: {exc})"


def _check_pipeline_options(cfg: TrainConfig, loss_fn: LossFn | None) -> None:
    """What a pipelined model (hybrid pp_size > 1) cannot do in fit, refused before any work."""
    if cfg.pp_size == 1:
        return
    problems = []
    if cfg.grad_accum_steps != 1:
        problems.append(f"grad_accum_steps={cfg.grad_accum_steps}: use grad_accum_steps=1 and let the schedule "
                        "accumulate (plugin_options.num_microbatches)")
    if loss_fn is not None:
        problems.append("loss_fn: a pipeline trains with the built-in causal-LM loss (or call "
                        "booster.execute_pipeline with a criterion yourself)")
    if problems:
        raise ConfigError(f"train config with plugin 'hybrid' and pp_size={cfg.pp_size}: " + "; ".join(problems))


def _make_plugin(cfg: TrainConfig, precision: Any):
    try:
        return make_plugin(cfg.plugin, precision, cfg.max_grad_norm or None, **cfg.plugin_options)
    except TypeError as exc:  # an option the plugin does not take
        raise ConfigError(f"train config 'plugin_options'={cfg.plugin_options!r} does not fit plugin "
                          f"{cfg.plugin!r}: {exc}") from exc


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Mapping):
        return to_device(dict(batch), device)
    raise TypeError(f"batches must be dicts of tensors (keyword arguments of the model), got {type(batch).__name__}; "
                    "make collate_fn return a dict")
