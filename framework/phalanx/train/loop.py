"""`fit`: the one training loop every Phalanx app uses.

The flow, top to bottom (each phase a method of `run.TrainingRun`):

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

from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from torch import nn

from phalanx.train.config import TrainConfig
from phalanx.train.nonfinite import NonFiniteLossError
from phalanx.train.result import TrainResult
from phalanx.train.run import EvalFn, TrainingRun
from phalanx.train.step import LossFn

__all__ = ["fit", "TrainHook", "NonFiniteLossError", "EvalFn"]


class TrainHook(Protocol):
    """What `fit(..., hooks=[...])` calls; see `phalanx.train.EMA` for one."""
    name: str  # its directory inside each checkpoint

    def bind(self, model: nn.Module) -> Any: ...
    def after_step(self, step: int) -> None: ...
    def save(self, directory: Path) -> None: ...  # called on every rank (collectives allowed)
    def load(self, directory: Path) -> None: ...
    # Optional: `snapshot(directory) -> Callable[[], None]` copies the state now (every rank,
    # collectives allowed) and returns the file write, which an async checkpoint runs in its
    # background thread (`EMA` has one); hooks without it `save` synchronously.


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
    run = TrainingRun(cfg, model, train_dataset, collate_fn, loss_fn, eval_fn, flops_per_token,
                      tokenizer=tokenizer, hooks=hooks)
    run.setup()
    try:
        run.train()
    finally:
        run.close()
    return run.result()
