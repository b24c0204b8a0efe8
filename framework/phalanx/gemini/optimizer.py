"""The hybrid Adam: Adam/AdamW run on each chunk's fp32 master shard where that shard lives.

Chunks whose optimizer data (master, moments, gradient) the placement put on the host are
updated by the CPU, the others on the device, with the same vectorised torch ops (which torch
runs multi-threaded on the CPU): no compiled extension. The arithmetic is torch's own Adam/AdamW
(`torch.optim.Adam(W)` with foreach=False), element for element, so training matches a plain
torch run.

Chunks may mix parameters of several optimizer param groups: each chunk keeps the contiguous
ranges of its shard that belong to one group, and every range is updated with its group's
hyper-parameters, read from the *user's* optimizer at every step, so an LR scheduler built on it
keeps working. Adam's step count is per group.

Chunks whose optimizer state lives on disk (`phalanx.gemini.disk`) are updated on the CPU too,
in the same model order: their files are read a few chunks ahead (started before the gradient
norm, so the first reads overlap it) and each is written back right after its update.

Before the update: the gradient norm over all shards (one all-reduce of per-rank sums of
squares; replicated chunks are counted on rank 0 only), which also detects an fp16 overflow on
any rank (every rank then skips the step), unscaling and clipping.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist

from phalanx.amp.loss_scaler import DynamicLossScaler
from phalanx.amp.precision import Precision, precision_of_dtype, resolve_precision
from phalanx.gemini.manager import ChunkManager
from phalanx.gemini.tiers import DISK
from phalanx.launch import collective
from phalanx.param_binding import FOREIGN_PARAM
from phalanx.amp.optimizer_wrapper import OptimizerWrapper


def adam_update(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, decoupled: bool) -> None:
    """One Adam(W) step on flat fp32 tensors, in place (torch's single-tensor formula)."""
    if weight_decay:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = exp_avg_sq.sqrt().div_(math.sqrt(bias_correction2)).add_(eps)  # the one temporary
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


NORM_BLOCK = 1 << 16  # elements: the gradient norm's float64 temporary stays at 0.5 MiB


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """sum(t**2) in float64 (on t's device), block by block: widening a whole chunk at once would
    take 4x its fp32 size in memory the placement never planned for."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for block in t.split(NORM_BLOCK):
        total += block.double().pow_(2).sum()
    return total


def _segments(chunk, group_of: dict[int, int]) -> list[tuple[int, int, int]]:
    """(start, end, group) ranges of the chunk's shard, merged where neighbours share a group."""
    out: list[list[int]] = []
    for k, a, b in chunk.owned():
        g = group_of.get(id(chunk.params[k]))
        if g is None:
            continue
        start = chunk.layout.to_shard(chunk.rank, chunk.layout.slots[k].offset + a)
        if out and out[-1][2] == g and out[-1][1] == start:
            out[-1][1] = start + (b - a)
        else:
            out.append([start, start + (b - a), g])
    return [tuple(s) for s in out]


class GeminiOptimizer(OptimizerWrapper):
    """Wraps the user's torch.optim.Adam/AdamW (kept as `.optim`, whose param groups and
    hyper-parameters it reads); surface: backward, step, zero_grad, param_groups, scaler,
    last_grad_norm, skipped, clip_grad_norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, manager: ChunkManager, *, max_norm: float | None = None,
                 precision: str | Precision | None = None):
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"GeminiPlugin runs its own hybrid Adam on the chunks: pass torch.optim.Adam or AdamW "
                             f"(got {type(optimizer).__name__}); other optimizers: ZeroPlugin or FSDPPlugin")
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("GeminiPlugin's hybrid Adam supports neither amsgrad nor maximize")
        self.optim = optimizer
        self.manager = manager
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self.max_norm = max_norm
        self.last_grad_norm: float | None = None
        self.skipped = False
        dtype = manager.chunks[0].dtype if manager.chunks else torch.float32
        self.precision = resolve_precision(precision) if precision is not None else precision_of_dtype(dtype)
        self.scaler = DynamicLossScaler.for_precision(self.precision)
        self.group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in manager.where:
                    raise ValueError(FOREIGN_PARAM)
                self.group_of[id(p)] = gi
        self.segments = [_segments(c, self.group_of) for c in manager.chunks]
        self.steps = [0] * len(optimizer.param_groups)
        optimizer.state.clear()

    # ------------------------------------------------------------------ torch.optim-like surface
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gemini reduces every micro-step (holding whole gradients would defeat its memory
        purpose); the reduced fp32 gradients add up until `step`."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.manager.chunks:
            chunk.master_grad.zero_()
            for p in chunk.params:
                p.grad = None

    def _grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64)
        for chunk, segs in zip(self.manager.chunks, self.segments):
            if not chunk.sharded and self.manager.dp_rank != 0:
                continue
            for a, b, _ in segs:
                local += sum_of_squares(chunk.master_grad[a:b]).cpu()
        total = local.to(self.manager.tiers.device).reshape(1)
        if self.manager.dp_size > 1:
            with collective("gemini.grad_norm"):
                dist.all_reduce(total, group=self.manager.group)
        return float(total.item()) ** 0.5

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("GeminiOptimizer does not take closures; call backward before step")
        if self.manager.in_backward:
            self.manager.finish_backward()
        on_disk = [c for c, segs in zip(self.manager.chunks, self.segments) if segs and c.optim_tier == DISK]
        stream = self.manager.disk.stream(on_disk) if on_disk else None  # reads start now
        try:
            self._step(stream)
        finally:
            if stream is not None:
                stream.finish()

    def _step(self, stream) -> None:
        norm = self._grad_norm()
        self.skipped = not math.isfinite(norm)
        if self.skipped:
            self.scaler.update(True)
            self.last_grad_norm = float("inf")
            self.zero_grad()
            return
        coef = 1.0 / self.scaler.scale if self.scaler.enabled else 1.0
        norm *= coef
        self.last_grad_norm = norm
        if self.max_norm and norm > self.max_norm:
            coef *= self.max_norm / (norm + 1e-6)
        active = {g for segs in self.segments for _, _, g in segs}
        for g in active:
            self.steps[g] += 1
        for chunk, segs in zip(self.manager.chunks, self.segments):
            if not segs:
                continue
            if coef != 1.0:
                chunk.master_grad.mul_(coef)
            if chunk.optim_tier == DISK:
                stream.take(chunk)  # waits for its read; the next ones are under way
            for a, b, g in segs:
                group = self.optim.param_groups[g]
                beta1, beta2 = group["betas"]
                adam_update(chunk.master[a:b], chunk.master_grad[a:b], chunk.exp_avg[a:b], chunk.exp_avg_sq[a:b],
                            step=self.steps[g], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                            eps=group["eps"], weight_decay=group["weight_decay"], decoupled=self.decoupled)
            self.manager.publish(chunk)
            if chunk.optim_tier == DISK:
                stream.done(chunk)  # written back in the background
        if self.scaler.enabled:
            self.scaler.update(False)
        self.zero_grad()

    def state_dict(self):
        raise NotImplementedError("Gemini's optimizer state lives in chunks sharded over ranks: save it with "
                                  "booster.save_optimizer / booster.save_checkpoint")

    def load_state_dict(self, state_dict):
        raise NotImplementedError("Gemini's optimizer state lives in chunks sharded over ranks: load it with "
                                  "booster.load_optimizer / booster.load_checkpoint")
