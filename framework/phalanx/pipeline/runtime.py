"""Running one training step through the pipeline: torch.distributed.pipelining's schedules over
our stage modules.

`PipelineRunner` wraps this rank's `StageModule`s in torch's `PipelineStage`s on the pipeline
process group and builds the named schedule once (the user never builds one). `run(input_ids,
labels)` cuts the batch into microbatches, lets the schedule run forward and backward, and
returns the loss of the whole batch on every pipeline rank (broadcast from the last stage).

The loss is token-weighted over the whole batch: each microbatch contributes Σ(its token
losses) / (tokens of the whole batch), the schedule does not rescale gradients
(`scale_grads=False`), so the accumulated gradient is the full-batch mean's gradient even when
ignore-index labels leave microbatches with different token counts.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)

from phalanx.launch import collective
from phalanx.models.shape_inference import in_shape_inference, marked_shape_inference  # noqa: F401 (re-exported)
from phalanx.pipeline.layout import StageLayout, check_microbatches
from phalanx.data.labels import IGNORE_INDEX
from phalanx.pipeline.stage import StageModule
from phalanx.shard.layers import VocabParallelLMHead
from phalanx.shard.loss import CausalLMLoss

log = logging.getLogger(__name__)
_TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                    "zero_bubble": ScheduleZBVZeroBubble}
_MAX_DIMS = 6  # activations sent by pipeline evaluation: [batch, seq, hidden] in practice
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# torch's methods that run a stage (and the last stage's loss) once to learn activation shapes at a
# schedule's first step (2.10+: forward and backward metadata inference; earlier: _shape_inference)
_SHAPE_INFERENCE_METHODS = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")


class _MicrobatchLoss:
    """The schedule's loss function: causal-LM loss of one microbatch over the tokens of the whole
    batch (or a user criterion's value / microbatches), times the fp16 loss scale."""

    def __init__(self, lm_loss: CausalLMLoss, microbatches: int, router_losses=None):
        self.lm_loss = lm_loss
        self.microbatches = microbatches
        self.router_losses = router_losses
        self.tokens: torch.Tensor | None = None
        self.criterion: Callable | None = None
        self.scale = 1.0

    def __call__(self, logits, labels: torch.Tensor) -> torch.Tensor:
        carried = ()
        if isinstance(logits, tuple):  # the last stage's logits and the router losses' totals
            logits, *carried = logits
        if self.criterion is not None:
            loss = self.criterion(logits, labels) / self.microbatches
        else:
            loss = self.lm_loss(logits, labels, num_items_in_batch=self.tokens)
        if carried:
            loss = loss + self.router_losses.loss(*carried, sequences=logits.shape[0], microbatches=self.microbatches)
        return loss * self.scale if self.scale != 1.0 else loss


class _Busy:
    """Seconds this rank spent computing inside the schedule (forward, backward, weight
    gradients); the rest of a step is bubble and communication (`bench/pipeline.py`)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, stage: PipelineStage) -> None:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            fn = getattr(stage, name, None)
            if fn is not None:
                setattr(stage, name, self._timed(fn))

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


class PipelineRunner:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, stages: list[StageModule], layout: StageLayout, *, pp_group, microbatches: int,
                 device: torch.device, lm_loss: CausalLMLoss, router_losses=None):
        """`router_losses`: a `phalanx.pipeline.router_losses.RouterLossCarry` whose totals ride
        along the hidden states and whose losses the last stage adds (None: the loss alone)."""
        check_microbatches(layout.schedule, layout.pp, microbatches)
        self.stages = stages
        self.layout = layout
        self.group = pp_group
        self.microbatches = microbatches
        self.router_losses = router_losses
        if router_losses is not None:
            for stage in stages:
                router_losses.attach(stage)
        self.loss = _MicrobatchLoss(lm_loss, microbatches, router_losses)
        self.busy = _Busy()
        self.has_last = any(s.is_last for s in stages)
        self.last_rank = dist.get_global_rank(pp_group, layout.rank_of(layout.num_stages - 1))
        self.pipeline_stages = [PipelineStage(s, s.index, layout.num_stages, device, group=pp_group) for s in stages]
        for stage in self.pipeline_stages:
            self.busy.wrap(stage)
            marked = [name for name in _SHAPE_INFERENCE_METHODS if hasattr(stage, name)]
            for name in marked:  # the forwards that must not count (in_shape_inference)
                setattr(stage, name, marked_shape_inference(getattr(stage, name)))
            if not marked:
                log.warning("this torch's PipelineStage has none of %s: its shape-inference forwards are not marked "
                            "(phalanx.pipeline.in_shape_inference stays False)", _SHAPE_INFERENCE_METHODS)
        cls = _TORCH_SCHEDULES[layout.schedule]
        first = self.pipeline_stages if layout.virtual > 1 else self.pipeline_stages[0]
        self.schedule = cls(first, n_microbatches=microbatches, loss_fn=self.loss, scale_grads=False)

    def _head(self):
        return next((s.head for s in self.stages if s.is_last), None)

    def _head_logits(self, return_outputs: bool):
        """Inside: a vocabulary-parallel head on this rank returns local logits unless the caller
        wants the outputs (the loss needs no gathered logits)."""
        head = self._head()
        if isinstance(head, VocabParallelLMHead):
            return head.local_logits(not return_outputs)
        return contextlib.nullcontext()

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, criterion: Callable | None = None,
            return_outputs: bool = False, loss_scale: float = 1.0) -> dict:
        """One forward+backward of the whole (data-parallel rank's) batch. Returns {"loss": the
        batch's loss on every pipeline rank, "outputs": the last stage's logits or None}."""
        labels = input_ids if labels is None else labels
        batch = input_ids.shape[0]
        if batch % self.microbatches:
            raise ValueError(f"the batch of {batch} rows does not split into num_microbatches={self.microbatches}: "
                             f"{batch} % {self.microbatches} = {batch % self.microbatches}; use a batch size that is a "
                             f"multiple of {self.microbatches} (per data-parallel rank)")
        shifted = labels[..., 1:]
        self.loss.tokens = (shifted != IGNORE_INDEX).sum().clamp(min=1).float()
        self.loss.criterion = criterion
        self.loss.scale = loss_scale
        losses: list[torch.Tensor] = []
        device = self.pipeline_stages[0].device
        with self._head_logits(return_outputs):
            outputs = self.schedule.step(input_ids.to(device), target=labels.to(device), losses=losses,
                                         return_outputs=return_outputs)
        if isinstance(outputs, tuple):  # the router losses' totals beside the logits
            outputs = outputs[0]
        return {"loss": self._batch_loss(losses, loss_scale, device),
                "outputs": outputs if self.has_last and return_outputs else None}

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                 criterion: Callable | None = None, return_outputs: bool = False) -> dict:
        """One forward of the whole batch, no backward, with the same token-weighted loss as `run`.

        The batch goes through the stages in order as one piece, each activation sent with its
        shape: torch's schedules fix activation shapes at their first step, while evaluation
        batches differ in rows and length. There is no overlap between stages, which an
        evaluation does not need. Returns {"loss" on every pipeline rank, "outputs": the last
        stage's logits if asked for}."""
        labels = input_ids if labels is None else labels
        device = self.pipeline_stages[0].device
        me = dist.get_rank(self.group)
        last = self.layout.num_stages - 1
        by_index = {s.index: s for s in self.stages}
        x, losses = input_ids.to(device), []
        # one tensor between stages and the cross-entropy alone: the router losses' totals stay home
        no_carry = self._router_losses_off() if self.router_losses is not None else contextlib.nullcontext()
        with self._head_logits(return_outputs), no_carry:
            for index in range(self.layout.num_stages):
                if self.layout.rank_of(index) != me:
                    continue
                if index > 0 and self.layout.rank_of(index - 1) != me:
                    x = self._receive(self.layout.rank_of(index - 1), device)
                x = by_index[index](x)
                if index < last and self.layout.rank_of(index + 1) != me:
                    self._send(x, self.layout.rank_of(index + 1))
        if self.has_last:
            labels = labels.to(device)
            if criterion is not None:
                losses.append(criterion(x, labels))
            else:
                tokens = (labels[..., 1:] != IGNORE_INDEX).sum().clamp(min=1).float()
                losses.append(self.loss.lm_loss(x, labels, num_items_in_batch=tokens))
        return {"loss": self._batch_loss(losses, 1.0, device),
                "outputs": x if self.has_last and return_outputs else None}

    @contextlib.contextmanager
    def _router_losses_off(self):
        self.router_losses.enabled = False
        try:
            yield
        finally:
            self.router_losses.enabled = True

    def _send(self, x: torch.Tensor, stage_rank: int) -> None:
        """An activation to the pipeline rank `stage_rank`: its shape and dtype first, then the data."""
        if x.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline evaluation sends activations of at most {_MAX_DIMS} dimensions, got {x.dim()}")
        header = [x.dim(), _DTYPES.index(x.dtype), *x.shape] + [0] * (_MAX_DIMS - x.dim())
        dst = dist.get_global_rank(self.group, stage_rank)
        with collective("pp.eval_send"):
            dist.send(torch.tensor(header, dtype=torch.long, device=x.device), dst=dst, group=self.group)
            dist.send(x.contiguous(), dst=dst, group=self.group)

    def _receive(self, stage_rank: int, device) -> torch.Tensor:
        src = dist.get_global_rank(self.group, stage_rank)
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.long, device=device)
        with collective("pp.eval_receive"):
            dist.recv(header, src=src, group=self.group)
            ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
            x = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
            dist.recv(x, src=src, group=self.group)
        return x

    def _batch_loss(self, losses: list[torch.Tensor], loss_scale: float, device) -> torch.Tensor:
        """The batch's loss (the sum of the last stage's microbatch losses), on every pipeline rank."""
        value = torch.zeros(1, dtype=torch.float32, device=device)
        if self.has_last:
            value += sum(float(x.detach()) for x in losses) / loss_scale
        if dist.get_world_size(self.group) > 1:
            with collective("pp.broadcast_loss"):
                dist.broadcast(value, src=self.last_rank, group=self.group)
        return value[0]


class PipelineModel(nn.Module):
    """This rank's pipeline stages; they run only inside `booster.execute_pipeline`."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args: Any, **kwargs: Any):
        raise RuntimeError("a pipeline-parallel model (pp_size > 1) holds only some layers on each rank: run it with "
                           "booster.execute_pipeline(iter(dataloader), model, criterion, optimizer); save it and load "
                           "it with pp_size=1 for generation")


def batch_tensors(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels or None) from a dict, a tensor or an (input_ids, labels) pair."""
    if isinstance(batch, dict):
        if "input_ids" not in batch:
            raise ValueError(f"execute_pipeline: the batch has keys {sorted(batch)} but no 'input_ids'")
        if batch.get("attention_mask") is not None and not bool(batch["attention_mask"].all()):
            raise ValueError("execute_pipeline takes no padding attention_mask: pack sequences, or mark padding in "
                             "labels with -100 (the loss is token-weighted)")
        return batch["input_ids"], batch.get("labels")
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"execute_pipeline: a batch must be a dict with input_ids[, labels], a tensor or a pair, "
                    f"not {type(batch).__name__}")
