"""The Booster: one object that applies a plugin's parallel layout to a training script.

    booster = Booster(plugin=ZeroPlugin(stage=2, precision="bf16"))
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, criterion,
                                                                          dataloader, lr_scheduler)
    booster.backward(loss, optimizer); optimizer.step(); optimizer.zero_grad()
    booster.save_model(model, "ckpt/model", shard=True)

LoRA: `model = booster.enable_lora(model, peft.LoraConfig(...))` before the optimizer is built,
`booster.save_lora_as_pretrained(model, dir, merge=False)` after training (docs/lora.md).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster import lora
from phalanx.booster.plugins.base import Plugin, unwrap_model
from phalanx.booster.state import boosted_state
from phalanx.booster.wrappers import ModelWrapper
from phalanx.checkpoint.atomic import CheckpointError, atomic_directory, verify_manifest
from phalanx.checkpoint.hf import load_hf_state_dict, save_hf_model
from phalanx.checkpoint.optimizer import FragmentReader, OptimizerFragments, save_fragments
from phalanx.checkpoint.train_state import TrainState, load_rng_state, scheduler_state
from phalanx.checkpoint.writer import CheckpointWriter
from phalanx.launch import context

MODEL_DIR, OPTIM_DIR, SCHED_FILE = "model", "optimizer", "lr_scheduler.json"
LOSS_SCALER = "loss_scaler"  # key of the loss scaler's state in the optimizer checkpoint's index


class Booster:
    def __init__(self, plugin: Plugin | None = None, mixed_precision: str | None = None):
        from phalanx.booster.plugins.ddp import DDPPlugin

        context()  # launch a one-rank group if the script did not call phalanx.launch()
        self.plugin = plugin or DDPPlugin()
        if mixed_precision is not None:
            from phalanx.amp.precision import resolve_precision
            self.plugin.precision = resolve_precision(mixed_precision)
        self.plugin.setup()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    # ------------------------------------------------------------------ boosting
    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, criterion: Any = None,
              dataloader: Any = None, lr_scheduler: Any = None, *, seed: int = 0):
        """Wrap everything for the plugin's layout. Build the LR scheduler on the *original*
        optimizer before calling this: the wrapper keeps that optimizer's param groups."""
        if isinstance(model, ModelWrapper):
            raise ValueError("this model was already boosted; boost the original model once")
        if optimizer is not None and lora.is_lora_model(model):
            lora.keep_trainable(optimizer, model)  # adapters only: no state or buckets for the frozen base
        if self.plugin.precision.fp8_linears:
            from phalanx.amp.fp8_linear import FP8_PLUGINS, convert_linears_to_fp8
            if self.plugin.name not in FP8_PLUGINS:
                raise ValueError(f"precision=fp8 runs with the {', '.join(FP8_PLUGINS)} plugins; {self.plugin.name} "
                                 "shards or offloads the linear layers itself. Use precision=bf16 with it.")
            convert_linears_to_fp8(model)  # before the plugin wraps or shards the modules
        wrapped = self.plugin.configure_model(model)
        state = boosted_state(wrapped)
        if state is None:  # a plugin that records nothing about the boosted model
            state = boosted_state(self.plugin.boosted(wrapped))
        optim = None
        if optimizer is not None:
            optim = self.plugin.configure_optimizer(optimizer, wrapped)
            state.optimizer = optim
            state.attach(optim)
        if dataloader is not None:
            dataloader = self.plugin.configure_dataloader(dataloader, seed=seed)
        return wrapped, optim, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        self.plugin.backward(loss, optimizer)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None) -> Iterator[None]:
        """Skip gradient synchronisation for micro-steps of gradient accumulation."""
        with self.plugin.no_sync(model, optimizer):
            yield

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion: Any = None, optimizer: Any = None,
                         return_loss: bool = True, return_outputs: bool = False, loss_weight: float = 1.0,
                         forward_only: bool = False) -> dict:
        """Forward and backward of one batch (`next(data_iter)`: a dict with input_ids[, labels], a tensor,
        or an (input_ids, labels) pair) through the pipeline schedule. Returns {"loss": the batch's
        loss on every rank, "outputs": the last stage's logits if asked for (None elsewhere)}; then call
        `optimizer.step()` as usual. `criterion(logits, labels)` replaces the causal-LM loss (a mean
        per microbatch). `loss_weight` scales the gradients (not the returned loss): phalanx.train
        uses it to weight ranks by their share of the global batch's tokens. `forward_only=True`
        evaluates: no backward, no gradients, the batch through the stages as one piece, any shape.
        Only `HybridParallelPlugin(pp_size>1)` has pipeline stages."""
        run = getattr(self.plugin, "execute_pipeline", None)
        if run is None:
            raise NotImplementedError(f"{self.plugin.name} has no pipeline stages; pipeline parallelism comes with "
                                      "HybridParallelPlugin(pp_size>1)")
        out = run(data_iter, model, criterion, optimizer, return_outputs=return_outputs, loss_weight=loss_weight,
                  forward_only=forward_only)
        if not return_loss:
            out["loss"] = None
        return out

    # ------------------------------------------------------------------ LoRA
    def enable_lora(self, model: nn.Module, lora_config: Any, adapter_name: str = "default") -> nn.Module:
        """Add LoRA adapters (`lora_config`: a `peft.LoraConfig`) to the un-boosted `model` and
        freeze its base weights; returns the `peft.PeftModel` to build the optimizer on and boost.
        Only the adapters then get optimizer state and gradient buckets (`lora.keep_trainable`)."""
        return lora.enable_lora(model, lora_config, adapter_name=adapter_name)

    def save_lora_as_pretrained(self, model: nn.Module, path: str | Path, *, merge: bool = False,
                                tokenizer=None, **kwargs) -> Path:
        """Collective. Write the boosted LoRA model's adapter in PEFT's format
        (adapter_config.json + adapter_model.safetensors, for `peft.PeftModel.from_pretrained`), or
        with `merge=True` the base model with the adapter merged in, as a plain Hugging Face
        directory (`kwargs`: `save_model`'s shard / max_shard_size / dtype). Atomic, as `save_model`."""
        path = Path(path)
        with atomic_directory(path) as tmp:
            lora.save_lora(self.plugin, model, tmp, writer=self.rank == 0, merge=merge, tokenizer=tokenizer, **kwargs)
        return path

    # ------------------------------------------------------------------ model
    def save_model(self, model: nn.Module, path: str | Path, shard: bool = True, max_shard_size: str | int = "2GB",
                   tokenizer=None, dtype: torch.dtype | None = None) -> Path:
        """Write the full model in Hugging Face layout (gathered from every shard)."""
        path = Path(path)
        with atomic_directory(path) as tmp:
            self._write_model(model, tmp, shard=shard, max_shard_size=max_shard_size, tokenizer=tokenizer, dtype=dtype)
        return path

    def _write_model(self, model, directory: Path, **kwargs) -> None:
        """Rank 0 writes the tensors as the plugin gathers them, one at a time
        (`iter_full_model_state`, a collective every rank walks to the end)."""
        self.stream_model(model, directory, writer=self.rank == 0, **kwargs)

    # ------------------------------------------------------------------ what the checkpoint writer asks for
    # `phalanx.checkpoint.writer` sits below the booster and reaches it only through these.
    def stream_model(self, model: nn.Module, directory: Path, *, writer: bool, **kwargs) -> None:
        """Collective: every rank walks the plugin's gather of the full model; where `writer` is
        true the tensors are written into `directory` (HF layout) as they come
        (`write_streamed_model`)."""
        write_streamed_model(self.plugin, model, directory, writer, **kwargs)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The user's module inside the plugin's wrappers (its config is saved with the weights)."""
        return unwrap_model(model)

    def load_model(self, model: nn.Module, path: str | Path) -> None:
        """Load HF-layout weights (saved by any plugin and world size, or by transformers)."""
        path = Path(path)
        if (path / "manifest.json").is_file():
            verify_manifest(path)
        try:
            state = load_hf_state_dict(path)
        except CheckpointError:
            raise
        except Exception as exc:  # truncated/corrupt safetensors
            raise CheckpointError(f"cannot read model weights in {str(path)!r}: {exc}") from exc
        self.plugin.check_full_state_dict(model, state)
        self.plugin.load_full_model_state_dict(model, state)

    # ------------------------------------------------------------------ optimizer
    def save_optimizer(self, optimizer: Any, path: str | Path) -> Path:
        """Write optimizer state sharded (each rank its part); loadable on any world size."""
        path = Path(path)
        with atomic_directory(path) as tmp:
            save_fragments(self.optimizer_fragments(optimizer), tmp)
        return path

    def load_optimizer(self, optimizer: Any, path: str | Path) -> None:
        path = Path(path)
        verify_manifest(path)
        self._load_optimizer_fragments(optimizer, FragmentReader(path))

    def optimizer_fragments(self, optimizer: Any) -> OptimizerFragments:
        """The plugin's fragments of the optimizer state, plus the loss scaler's state: the one
        place it is saved (every rank's scaler agrees, the index keeps rank 0's)."""
        frags = self.plugin.optimizer_fragments(optimizer)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            frags.extra[LOSS_SCALER] = scaler.state_dict()
        return frags

    def _load_optimizer_fragments(self, optimizer: Any, reader: FragmentReader) -> None:
        self.plugin.load_optimizer_fragments(optimizer, reader)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and LOSS_SCALER in reader.extra:
            scaler.load_state_dict(reader.extra[LOSS_SCALER])

    # ------------------------------------------------------------------ scheduler
    def save_lr_scheduler(self, lr_scheduler: Any, path: str | Path) -> Path:
        path = Path(path)
        with atomic_directory(path) as tmp:
            if self.rank == 0:
                (tmp / SCHED_FILE).write_text(json.dumps(scheduler_state(lr_scheduler)))
        return path

    def load_lr_scheduler(self, lr_scheduler: Any, path: str | Path) -> None:
        path = Path(path)
        verify_manifest(path)
        lr_scheduler.load_state_dict(json.loads((path / SCHED_FILE).read_text()))

    # ------------------------------------------------------------------ whole training checkpoint
    def save_checkpoint(self, path: str | Path, model: nn.Module, optimizer: Any = None, lr_scheduler: Any = None,
                        train_state: TrainState | None = None, tokenizer=None,
                        extra_writer: Callable[[Path], Any] | None = None) -> Path:
        """One atomic directory: model/ (HF layout), optimizer/, train_state.json, rng/.

        extra_writer(tmp_dir), called on every rank, adds more state (e.g. EMA weights) inside the
        same atomic directory, so it is covered by the manifest and appears only when complete.
        The save is `fit`'s (`CheckpointWriter`, synchronous): when any rank cannot write, every
        rank raises `CheckpointSaveError` naming that rank and its error, and nothing appears at
        `path` (no rank is left waiting at a barrier for the one that failed)."""
        path = Path(path)
        writer = CheckpointWriter(self, path.parent, keep_last=0, async_write=False, on_error="stop")
        state = train_state or TrainState()
        writer.save(path, state.step, model, optimizer, lr_scheduler, state, tokenizer=tokenizer,
                    hooks_writer=extra_writer)
        return path

    def load_checkpoint(self, path: str | Path, model: nn.Module, optimizer: Any = None,
                        lr_scheduler: Any = None) -> TrainState:
        """Restore what `save_checkpoint` wrote; returns the TrainState (step, sampler, …)."""
        path = Path(path)
        verify_manifest(path)
        state = TrainState.load(path)
        self.load_model(model, path / MODEL_DIR)
        if optimizer is not None:
            if not (path / OPTIM_DIR).is_dir():
                raise CheckpointError(f"checkpoint {str(path)!r} has no optimizer state; load only the model")
            self._load_optimizer_fragments(optimizer, FragmentReader(path / OPTIM_DIR))
        if lr_scheduler is not None and state.lr_scheduler:
            lr_scheduler.load_state_dict(state.lr_scheduler)
        if state.world_size == dist.get_world_size():
            load_rng_state(path, self.rank)
        return state


def write_streamed_model(plugin: Plugin, model: nn.Module, directory: Path, writer: bool, **kwargs) -> None:
    """Walk `plugin.iter_full_model_state(model)` (every rank must: it is a collective); the
    `writer` rank writes the tensors into `directory` as they come. If writing fails there, the
    rest is still walked (the other ranks are inside its collectives) and the error raised after."""
    stream = plugin.iter_full_model_state(model)
    try:
        if writer:
            save_hf_model(unwrap_model(model), stream, directory, **kwargs)
    finally:
        for pair in stream:
            del pair  # not kept while the next tensor is gathered

