"""`fit`: the one training loop every Phalanx app uses.

The flow, top to bottom:

1. check the config, the model and the data;
2. find the checkpoint to resume (rank 0 decides);
3. build AdamW and the warm-up + cosine schedule on the *original* model, then let the Booster
   apply the plugin's parallel layout to model, optimizer and data loader -- up to here nothing
   is written, so every input error stops the run before a checkpoint is touched;
4. create the output directory, delete partial saves, and restore model, optimizer, scheduler,
   loss scaler, RNGs and data position from the checkpoint;
5. per optimizer step: `grad_accum_steps` micro-batches (gradient sync only on the last), one
   all-reduce for the global loss, a NaN check, the (clipping) optimizer step, logging, eval,
   checkpoint, pruning;
6. at the end: final checkpoint and eval, loss-curve PNG, a `TrainResult` on every rank.

Loss normalisation. With the default causal-LM loss each micro-batch returns the *sum* of its
token losses; before the forward passes the loop counts the target tokens of the whole global
batch (all micro-batches, one all-reduce over ranks) and scales each micro-batch's sum by
`dp_size / global_tokens`. Since every plugin *averages* gradients over data-parallel ranks, the
accumulated gradient is exactly that of (sum of all token losses) / (all target tokens), the
single-big-batch gradient, even when padding makes micro-batches uneven. A custom `loss_fn`
returns a mean per micro-batch; those are weighted equally (exact when micro-batches have equal
weight, which is the usual case for non-token losses).
"""
from __future__ import annotations

import dataclasses

import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from phalanx.device import to_device
from phalanx.amp.precision import dtype_of, resolve_precision
from phalanx.booster import Booster
from phalanx.booster.plugins import make_plugin
from phalanx.checkpoint.train_state import TrainState, checkpoint_path
from phalanx.config import ConfigError, config_to_dict
from phalanx.launch import context, seed_everything
from phalanx.observe import (MetricsWriter, ProgressBar, ThroughputMeter, WandbRun, get_logger,
                             measure_matmul_flops, plot_loss_curve)
from phalanx.checkpoint.writer import CheckpointSaveError, CheckpointWriter
from phalanx.malloc import give_back_freed_memory
from phalanx.train.checkpointing import existing_checkpoints, from_rank0, remove_partial_saves, resume_checkpoint
from phalanx.train.config import TrainConfig
from phalanx.train.data import MicroBatches, check_dataset, check_first_sample, default_collate
from phalanx.train.evaluate import eval_mode, eval_results
from phalanx.train.losses import CausalLMLoss, check_causal_lm
from phalanx.train.nonfinite import NonFiniteLossError, NonFinitePolicy
from phalanx.train.optim import build_lr_scheduler, build_optimizer
from phalanx.train.result import TrainResult
from phalanx.plan import MemoryProbe
from phalanx.train.step import LossFn, step_flops_estimator, train_step
from phalanx.watchdog import Watchdog, set_step, track

METRICS_FILE, PLOT_FILE = "metrics.jsonl", "loss.png"
# fp16 skips steps whose gradients overflow (the loss scaler backs off); this many non-finite
# losses in a row means the run itself is broken, not the scale.
FP16_MAX_NONFINITE_STEPS = 10

EvalFn = Callable[[nn.Module, int], Mapping[str, Any]]


class TrainHook(Protocol):
    """What `fit(..., hooks=[...])` calls; see `phalanx.train.EMA` for one."""
    name: str  # its directory inside each checkpoint

    def bind(self, model: nn.Module) -> Any: ...
    def after_step(self, step: int) -> None: ...
    def save(self, directory: Path) -> None: ...  # called on every rank (collectives allowed)
    def load(self, directory: Path) -> None: ...


def _hooks_writer(hooks: Sequence[TrainHook]) -> Callable[[Path], None]:
    def write(checkpoint_dir: Path) -> None:
        for hook in hooks:
            hook.save(checkpoint_dir / hook.name)
    return write


def fit(cfg: TrainConfig, model: nn.Module, train_dataset: Any, collate_fn: Callable | None = None,
        loss_fn: LossFn | None = None, eval_fn: EvalFn | None = None, flops_per_token: float | None = None,
        *, tokenizer: Any = None, hooks: Sequence[TrainHook] = ()) -> TrainResult:
    """Train `model` on `train_dataset` as `cfg` says; see docs/training.md.

    model: the user's model (a Hugging Face causal LM for the default loss). It is trained in
        place: DDP and ZeRO update it directly (in the training dtype), FSDP shards it.
    train_dataset: map-style; each sample a dict of tensors unless `collate_fn` is given.
    loss_fn: loss_fn(model, batch) -> scalar mean loss of the micro-batch, where `model` is the
        boosted model (call it like the original). Default: next-token loss of a causal LM through
        the fused linear + cross-entropy kernel, batch {"input_ids", "labels"?, "attention_mask"?}.
    eval_fn: eval_fn(model, step) -> {name: number}, given the original model in eval mode under
        no_grad, every `eval_every` steps and at the end. See `phalanx.train.causal_lm_eval`; under
        tensor, sequence or pipeline parallelism score batches with `phalanx.train.eval_loss_sum`
        (a pipelined rank's model holds only its stages) and split them by `data_replica(model)`.
    flops_per_token: training FLOPs per token (or per sample when batches have no input_ids) for
        the MFU meter; default: estimated from a causal LM's config.
    tokenizer: optional; saved into every checkpoint's model/ directory.
    hooks: objects that follow the training (e.g. `phalanx.train.EMA`): `bind(boosted_model)` once
        the layout is applied, `after_step(step)` after every optimizer step, and `save(dir)` /
        `load(dir)` with every checkpoint (in `<checkpoint>/<hook.name>/`, so resume is exact).
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"fit expects a TrainConfig, got {type(cfg).__name__}")
    cfg.validate()
    wall_start = time.perf_counter()
    ctx = context()
    log = get_logger("phalanx.train")
    rank = dist.get_rank()
    output_dir = Path(cfg.output_dir)
    # `auto` becomes what this device computes fast (bf16 or fp32), so the plugin, the MFU meter,
    # the logs and the saved config all name the precision that actually runs.
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, ctx.device))

    # 1. Everything that can be wrong with the inputs fails here, before any file is touched.
    _check_pipeline_options(cfg, loss_fn)
    plugin = _make_plugin(cfg)
    # A tensor/sequence-parallel plugin installs a vocabulary-parallel loss in the model itself;
    # every other layout gets the fused head + cross-entropy wrapper.
    model_computes_loss = loss_fn is None and plugin.model_computes_causal_lm_loss
    if model_computes_loss:
        check_causal_lm(model)
    train_module = CausalLMLoss(model, chunk_size=cfg.loss_chunk_size) if loss_fn is None and not model_computes_loss \
        else model
    step_flops = step_flops_estimator(model, flops_per_token)
    booster = Booster(plugin)
    dp_size = booster.plugin.dp_size
    check_dataset(train_dataset, cfg.micro_batch_size, dp_size)
    collate_fn = collate_fn or default_collate
    check_first_sample(train_dataset, collate_fn, ("input_ids",) if loss_fn is None else ())

    # 2. Which checkpoint to continue from (read-only: rank 0 looks, every rank follows).
    resume_from = resume_checkpoint(output_dir) if cfg.resume else None
    if not cfg.resume:
        found = existing_checkpoints(output_dir)
        if found:
            raise FileExistsError(f"{str(output_dir)!r} already holds checkpoints (steps {found}); set resume=true to "
                                  "continue that run, or choose a new output_dir")

    # 3. Optimizer and schedule on the original model, then the parallel layout (a plugin that
    # rejects the layout or the optimizer fails here, still before anything is written).
    seed_everything(cfg.seed, plugin.seed_rank, per_rank=True)
    optimizer = build_optimizer(train_module, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    loader = DataLoader(train_dataset, batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True,
                        collate_fn=collate_fn, num_workers=cfg.num_workers)
    memory_probe = MemoryProbe(model, ctx.device)  # the peak of this run, printed beside the plan's estimate
    model_b, optim_b, _, loader_b, scheduler = booster.boost(train_module, optimizer, None, loader, scheduler,
                                                             seed=cfg.seed)
    batches = MicroBatches(loader_b)
    for hook in hooks:
        hook.bind(model_b)

    # 4. The output directory, and resume.
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
    remove_partial_saves(output_dir)
    state = TrainState()

    def restore(checkpoint: Path) -> TrainState:
        restored = booster.load_checkpoint(checkpoint, model_b, optim_b, scheduler)
        batches.load_state_dict(restored.sampler)
        for hook in hooks:
            hook.load(checkpoint / hook.name)
        return restored

    if resume_from is not None:
        state = restore(resume_from)
        if state.world_size != dist.get_world_size():
            log.warning(f"resuming a {state.world_size}-rank checkpoint on {dist.get_world_size()} ranks: the data "
                        "position is carried over, the per-rank RNG streams restart")
        log.info(f"resumed from {resume_from} (step {state.step})")
    start_step = state.step
    log.info(f"training {type(model).__name__} with {booster.plugin.describe()}: steps {start_step + 1}..{cfg.max_steps}, "
             f"global batch {cfg.micro_batch_size} x {cfg.grad_accum_steps} x {dp_size} samples")

    # 5. Observers (rank 0 writes; every rank measures).
    main = rank == 0
    peak = _peak_flops(cfg, ctx.device) if step_flops is not None else None
    meter = ThroughputMeter(world_size=dist.get_world_size(), peak_flops=peak)
    metrics = MetricsWriter(output_dir / METRICS_FILE, enabled=main,
                            resume_step=start_step if resume_from is not None else None)
    wandb = None
    if cfg.wandb and main:
        wandb = WandbRun(project=cfg.wandb_project, directory=output_dir, config=config_to_dict(cfg),
                         mode=cfg.wandb_mode, run_id=state.extra.get("wandb_run_id"))
    show_bar = main and cfg.progress_bar and _is_tty()
    bar = ProgressBar(cfg.max_steps, initial=start_step, enabled=show_bar)

    losses: list[float] = []
    window_losses: list[float] = []
    last_eval: dict[str, float] = {}
    tokens_seen = state.tokens_seen
    nonfinite_streak = 0
    nonfinite = NonFinitePolicy(cfg, lr_scale=state.extra.get("lr_scale", 1.0))
    step = start_step
    evaluated_at = None
    writer = CheckpointWriter(booster, output_dir, keep_last=cfg.keep_last, async_write=cfg.async_save,
                              on_error=cfg.on_save_error, last_good=resume_from)
    dog = Watchdog(cfg.hang_timeout_s).start() if cfg.hang_timeout_s else None

    def run_eval(at_step: int) -> dict[str, float]:
        with eval_mode(model_b, model):
            raw = eval_fn(model, at_step)
        result = eval_results(raw, at_step)
        metrics.log({"step": at_step, **{f"eval/{k}": v for k, v in result.items()}})
        if wandb:
            wandb.log({f"eval/{k}": v for k, v in result.items()}, step=at_step)
        log.info(f"step {at_step} eval: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
        return result

    def save(at_step: int) -> None:
        train_state = TrainState(step=at_step, epoch=batches.epoch, sampler=batches.state_dict(),
                                 tokens_seen=tokens_seen,
                                 extra={"wandb_run_id": wandb.id if wandb else state.extra.get("wandb_run_id"),
                                        "train_config": config_to_dict(cfg), "lr_scale": nonfinite.lr_scale})
        give_back_freed_memory()  # the steps' kept blocks go back before the save's own peak
        with track("checkpoint snapshot"):
            writer.save(checkpoint_path(output_dir, at_step), at_step, model_b, optim_b, scheduler, train_state,
                        tokenizer=tokenizer, hooks_writer=_hooks_writer(hooks) if hooks else None)

    def roll_back(at_step: int, loss: float) -> TrainState:
        """Load the last complete checkpoint, scale the learning rate down, return its step."""
        with track("wait for checkpoint"):
            writer.wait()
        if writer.last_good is None:
            raise NonFiniteLossError(_nonfinite_message(loss, at_step, cfg, None) + " (on_nonfinite='rollback' "
                                     "needs a checkpoint to return to: set save_every)")
        restored = restore(writer.last_good)
        nonfinite.scale_lr(scheduler, optimizer, restored_scale=restored.extra.get("lr_scale", 1.0))
        log.warning(f"training loss is {loss} at step {at_step}: rolled back to {writer.last_good} (step "
                    f"{restored.step}) with the learning rate scaled by {nonfinite.lr_scale:g} "
                    f"(rollback {nonfinite.count} of at most {cfg.max_nonfinite})")
        metrics.log({"step": at_step, "event": "nonfinite_rollback", "to_step": restored.step,
                     "lr_scale": nonfinite.lr_scale})
        del losses[max(0, restored.step - start_step):]
        return restored

    try:
        model_b.train()
        while step < cfg.max_steps:
            step += 1
            set_step(step)
            t0 = time.perf_counter()
            with track("load batch"):
                micro = [_to_device(next(batches), ctx.device) for _ in range(cfg.grad_accum_steps)]
            loss, tokens, flops = train_step(booster, model_b, optim_b, micro, loss_fn, dp_size, step_flops,
                                              ctx.device, model_computes_loss=model_computes_loss)
            skip = False
            if not math.isfinite(loss):
                nonfinite_streak += 1
                if cfg.precision != "fp16" or nonfinite_streak >= FP16_MAX_NONFINITE_STEPS:
                    action = nonfinite.decide(_nonfinite_message(loss, step, cfg, writer.last_good))
                    if action == "rollback":
                        optim_b.zero_grad()
                        restored = roll_back(step, loss)
                        step, tokens_seen = restored.step, restored.tokens_seen
                        window_losses.clear()
                        continue
                    skip = True
                    log.warning(f"training loss is {loss} at step {step}: skipped the step (gradients dropped, "
                                f"skip {nonfinite.count} of at most {cfg.max_nonfinite})")
                    metrics.log({"step": step, "event": "nonfinite_skip", "skips": nonfinite.count})
            else:
                nonfinite_streak = 0
            lr = optimizer.param_groups[0]["lr"]
            if not skip:
                with track("optimizer step"):
                    optim_b.step()
            with warnings.catch_warnings():
                # The order is right by construction; a plugin whose optimizer steps its own
                # copy (Gemini) just never calls the wrapped `step` the scheduler looks for.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                scheduler.step()
            optim_b.zero_grad()
            for hook in hooks:
                hook.after_step(step)
            meter.step(tokens, time.perf_counter() - t0, flops)
            tokens_seen += tokens
            if not skip:
                losses.append(loss)
                window_losses.append(loss)

            if (step % cfg.log_every == 0 or step == cfg.max_steps) and window_losses:
                rates = meter.window()
                record = {"step": step, "loss": sum(window_losses) / len(window_losses), "lr": lr,
                          "grad_norm": getattr(optim_b, "last_grad_norm", None), "tokens_seen": tokens_seen,
                          "epoch": batches.epoch, **rates, "skipped": skip or bool(getattr(optim_b, "skipped", False)),
                          "elapsed_s": time.perf_counter() - wall_start}
                window_losses.clear()
                metrics.log(record)
                if wandb:
                    wandb.log(record, step=step)
                if show_bar:
                    bar.update(0, loss=record["loss"], lr=lr, tok_s=rates["tokens_per_s"], mfu=rates["mfu"])
                else:
                    log.info(_log_line(record))
            bar.update(1)

            if eval_fn is not None and cfg.eval_every and step % cfg.eval_every == 0:
                with track("eval"):
                    last_eval, evaluated_at = run_eval(step), step
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.max_steps:
                save(step)
        with track("wait for checkpoint"):
            writer.wait()
        final = writer.outcomes[-1] if writer.outcomes else None
        if final is not None and final.step == step and not final.ok:  # the only copy of the final weights
            raise CheckpointSaveError(writer.failure_message(final) + " The final checkpoint is missing.")

        # 6. The end. The final checkpoint was written at max_steps above (a resumed run that was
        # already complete keeps its checkpoint); then the final eval and the loss curve.
        if eval_fn is not None and evaluated_at != step:
            last_eval = run_eval(step)
    finally:
        writer.close()
        give_back_freed_memory()
        if dog is not None:
            dog.stop()
        bar.close()
        metrics.close()
        if wandb:
            wandb.finish()

    plot = None
    if main and cfg.plot:
        plot = plot_loss_curve(output_dir / METRICS_FILE, output_dir / PLOT_FILE,
                               title=f"{type(model).__name__} ({cfg.plugin}, {cfg.precision})")
    plot = from_rank0(str(plot) if plot else None)
    summary = meter.summary()
    if summary["tokens_per_s"] is not None:
        log.info(f"done at step {step}: {summary['tokens_per_s']:.0f} tokens/s"
                 + (f", {summary['tflops_per_rank']:.3g} TFLOP/s per rank" if summary["tflops_per_rank"] else "")
                 + (f", MFU {summary['mfu']:.1%}" if summary["mfu"] else ""))
    if step > start_step:
        log.info(_memory_line(memory_probe, cfg, micro, dist.get_world_size(), model_computes_loss))
    return TrainResult(final_step=step, losses=losses, metrics_path=output_dir / METRICS_FILE,
                       checkpoint_dir=writer.last_good, last_eval=last_eval, start_step=start_step,
                       tokens_per_s=summary["tokens_per_s"], tflops_per_rank=summary["tflops_per_rank"],
                       mfu=summary["mfu"], loss_plot=Path(plot) if plot else None,
                       wall_time_s=time.perf_counter() - wall_start)


# ---------------------------------------------------------------------------------------------
# Helpers of the loop above.

def _check_pipeline_options(cfg: TrainConfig, loss_fn) -> None:
    """What a pipelined model (hybrid pp_size > 1) cannot do in fit, refused before any work."""
    pp_size = cfg.pp_size
    if pp_size == 1:
        return
    problems = []
    if cfg.grad_accum_steps != 1:
        problems.append(f"grad_accum_steps={cfg.grad_accum_steps}: use grad_accum_steps=1 and let the schedule "
                        "accumulate (plugin_options.num_microbatches)")
    if loss_fn is not None:
        problems.append("loss_fn: a pipeline trains with the built-in causal-LM loss (or call "
                        "booster.execute_pipeline with a criterion yourself)")
    if problems:
        raise ConfigError(f"train config with plugin 'hybrid' and pp_size={pp_size}: " + "; ".join(problems))


def _make_plugin(cfg: TrainConfig):
    try:
        return make_plugin(cfg.plugin, cfg.precision, cfg.max_grad_norm or None, **cfg.plugin_options)
    except TypeError as exc:  # an option the plugin does not take
        raise ConfigError(f"train config 'plugin_options'={cfg.plugin_options!r} does not fit plugin "
                          f"{cfg.plugin!r}: {exc}") from exc


def _memory_line(probe: MemoryProbe, cfg: TrainConfig, micro: list, world: int, model_computes_loss: bool) -> str:
    """The measured peak per rank beside `phalanx plan`'s estimate for this layout (docs/plan.md)."""
    ids = micro[0].get("input_ids") if micro and isinstance(micro[0], dict) else None
    if not isinstance(ids, torch.Tensor):
        return f"memory per rank: measured peak {probe.measured() / 2**30:.2f} GiB"
    try:
        return probe.report(cfg, ids.shape[-1], cfg.micro_batch_size, world, loss="hf" if model_computes_loss else "fused")
    except Exception as exc:  # the planner knows LLM families only; the peak is still worth printing
        return f"memory per rank: measured peak {probe.measured() / 2**30:.2f} GiB (no plan estimate: {exc})"


def _peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops == 0:
        return None
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    return measure_matmul_flops(device, dtype_of(cfg.precision), min_seconds=0.15)


def _nonfinite_message(loss: float, step: int, cfg: TrainConfig, last_checkpoint: Path | None) -> str:
    where = f"the last checkpoint, {last_checkpoint}, is intact" if last_checkpoint else "no checkpoint was written"
    hint = ("lower lr or raise warmup_steps, set max_grad_norm, check the data for empty or corrupt samples"
            + (", or train in bf16/fp32 instead of fp16" if cfg.precision == "fp16" else ""))
    return f"training loss is {loss} at step {step}; stopped before applying that step ({where}). Fix: {hint}"


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Mapping):
        return to_device(dict(batch), device)
    raise TypeError(f"batches must be dicts of tensors (keyword arguments of the model), got {type(batch).__name__}; "
                    "make collate_fn return a dict")


def _log_line(record: Mapping[str, Any]) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3g}"]
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3g}")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    if record.get("mfu"):
        parts.append(f"MFU {record['mfu']:.1%}")
    return " | ".join(parts)


def _is_tty() -> bool:
    import sys
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
