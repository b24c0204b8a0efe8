"""Fused linear + cross-entropy: the LM-head loss without ever holding [tokens, vocab] logits.

Tokens are processed in chunks: per chunk, logits = hidden_chunk @ weight.T (+ bias), then the
loss and, in place, the logits' gradient; the gradient is folded straight into grad_hidden and an
fp32 grad_weight accumulator, and the chunk is freed. Peak memory is one chunk of logits instead
of several copies of the full [N, V] matrix (logits, log-softmax, their gradient).

For `reduction="mean"`/`"sum"` the gradients are computed during the forward (the backward only
scales them by the incoming gradient), which saves recomputing the logits; `reduction="none"`
needs a per-token incoming gradient, so its backward recomputes each chunk.

Semantics follow `F.cross_entropy(logits.float(), labels, ignore_index=, reduction=,
label_smoothing=)`, except that a mean over zero non-ignored tokens is 0 (with zero gradients),
not NaN: an all-padding micro-batch must not poison a training run. The loss is always fp32.
The torch reference and the Triton path share the chunk loop and differ only in the per-chunk
step (softmax, loss, gradient), which is a Triton kernel on GPU.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .capability import fast_compute_dtype
from .dispatch import use_triton

REDUCTIONS = ("mean", "sum", "none")
# Bytes of fp32 logits per chunk. 128 MiB keeps the working set small against the eager
# path's several [N, V] tensors, while a chunk stays large enough for efficient matmuls.
CHUNK_BYTES = 128 << 20
# Bound on the temporary [rows, H] product when a low-precision weight gradient is accumulated.
WEIGHT_GRAD_SLICE_BYTES = 32 << 20


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk: about CHUNK_BYTES of fp32 logits, within [256, 4096]."""
    return max(256, min(4096, CHUNK_BYTES // (4 * vocab)))


def ce_step_reference(logits, target, ignore_index: int, smoothing: float,
                      scale: torch.Tensor | None):
    """Loss per row (fp32) and, when `scale` is given, `scale * dloss/dlogits`.

    Works in place on an fp32 copy of the logits (the logits themselves when already fp32), so a
    chunk costs one [rows, V] buffer and no temporaries of that size.
    """
    z = logits.float()
    vocab = z.shape[1]
    valid = target != ignore_index
    t = torch.where(valid, target, 0).unsqueeze(1)
    z_y = z.gather(1, t).squeeze(1)
    z_mean = z.mean(1) if smoothing else None
    m = z.amax(1, keepdim=True)
    z.sub_(m).exp_()
    s = z.sum(1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    loss = lse - z_y if not smoothing else lse - (1.0 - smoothing) * z_y - smoothing * z_mean
    loss = torch.where(valid, loss, 0.0)
    if scale is None:
        return loss, None
    scale = scale.unsqueeze(1)
    z.mul_(scale / s)  # softmax, already scaled
    if smoothing:
        z.sub_(scale * (smoothing / vocab))
    z.scatter_add_(1, t, scale * -(1.0 - smoothing))
    return loss, z


def _ce_step_triton(logits, target, ignore_index, smoothing, scale):
    from ._triton.cross_entropy import ce_step
    return ce_step(logits, target, ignore_index, smoothing, scale)


def _accumulate_weight_grad(gw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """gw (fp32) += g.T @ h. A low-precision g is multiplied in its own dtype, in
    vocabulary slices, so the temporary product stays within WEIGHT_GRAD_SLICE_BYTES instead of
    being a full [V, H] copy."""
    if g.dtype == torch.float32:
        gw.addmm_(g.t(), h.float())
        return
    rows = max(1, WEIGHT_GRAD_SLICE_BYTES // (h.shape[1] * h.element_size()))
    for v0 in range(0, gw.shape[0], rows):
        gw[v0:v0 + rows].add_(g[:, v0:v0 + rows].t() @ h)


def _chunked_pass(hidden, weight, bias, labels, *, ignore_index, smoothing, chunk, row_scale,
                  need, step: Callable):
    """One sweep over token chunks. Returns (loss per token, grad_hidden, grad_weight, grad_bias).

    row_scale is None for a loss-only sweep, else [N] fp32 factors (0 on ignored tokens) that
    multiply each token's gradient; `need` says which of (hidden, weight, bias) want a gradient.
    """
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grads = row_scale is not None
    gh = torch.empty_like(hidden) if grads and need[0] else None
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads and need[1] else None
    gb = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
          if grads and bias is not None and need[2] else None)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h = hidden[start:end]
        logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
        loss[start:end], g = step(logits, labels[start:end], ignore_index, smoothing,
                                  None if row_scale is None else row_scale[start:end])
        del logits
        if not grads:
            continue
        # Multiply in the activations' precision: on CPU a bf16 matmul is ~4x an fp32 one.
        g_mm = g if h.dtype == torch.float32 else g.to(h.dtype)
        if gh is not None:
            torch.mm(g_mm.to(weight.dtype), weight, out=gh[start:end])
        if gw is not None:
            _accumulate_weight_grad(gw, g_mm, h)
        if gb is not None:
            gb.add_(g.sum(0, dtype=torch.float32))
        del g
    return loss, gh, gw, gb


def _reduce(loss_rows, valid, reduction):
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp(min=1)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, smoothing, chunk, step):
        need = tuple(ctx.needs_input_grad[:3])
        valid = labels != ignore_index
        ctx.reduction, ctx.step, ctx.need = reduction, step, need
        ctx.kw = dict(ignore_index=ignore_index, smoothing=smoothing, chunk=chunk)
        if reduction == "none" or not any(need):
            # loss only now; a "none" backward recomputes each chunk with per-token scales
            loss_rows, *_ = _chunked_pass(hidden, weight, bias, labels, row_scale=None, need=need,
                                          step=step, **ctx.kw)
            if reduction == "none" and any(need):
                ctx.save_for_backward(hidden, weight, bias, labels)
            return _reduce(loss_rows, valid, reduction)
        row_scale = valid.float()
        if reduction == "mean":
            row_scale = row_scale / valid.sum().clamp(min=1)
        loss_rows, gh, gw, gb = _chunked_pass(hidden, weight, bias, labels, row_scale=row_scale,
                                              need=need, step=step, **ctx.kw)
        ctx.save_for_backward(gh, gw if gw is None else gw.to(weight.dtype),
                              gb if gb is None else gb.to(bias.dtype))
        return _reduce(loss_rows, valid, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return FusedLinearCrossEntropyFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        if ctx.reduction != "none":
            gh, gw, gb = ctx.saved_tensors
            scaled = [None if g is None else g * grad_out.to(g.dtype) for g in (gh, gw, gb)]
            return (*scaled, None, None, None, None, None, None)
        hidden, weight, bias, labels = ctx.saved_tensors
        row_scale = grad_out.float() * (labels != ctx.kw["ignore_index"])
        _, gh, gw, gb = _chunked_pass(hidden, weight, bias, labels, row_scale=row_scale,
                                      need=ctx.need, step=ctx.step, **ctx.kw)
        gw = None if gw is None else gw.to(weight.dtype)
        gb = None if gb is None else gb.to(bias.dtype)
        return gh, gw, gb, None, None, None, None, None, None


def _prepare(hidden, weight, labels, bias, reduction, label_smoothing, chunk_size):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., {hidden.shape[-1]}] does not match lm_head weight "
                         f"{tuple(weight.shape)} (expected [vocab, hidden])")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if y.numel() != h2.shape[0]:
        raise ValueError(f"{y.numel()} labels for {h2.shape[0]} tokens: labels must be shifted "
                         "by the caller and have one entry per hidden state")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match vocab {weight.shape[0]}")
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return h2, y, chunk


def _run(step, hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_size):
    h2, y, chunk = _prepare(hidden, weight, labels, bias, reduction, label_smoothing, chunk_size)
    device = h2.device.type
    # One compute dtype: autocast's if it is on (as F.linear would use), else the promoted one.
    # The casts happen outside the Function, so autograd carries gradients back to the originals.
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(h2.dtype, weight.dtype)
    # A CPU that emulates bf16 multiplies the head in fp32 instead (70-100x faster there, and
    # more accurate); gradients still reach the bf16 originals through the casts.
    dtype = fast_compute_dtype(dtype, h2.device)
    h2, weight = h2.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        loss = FusedLinearCrossEntropyFunction.apply(h2, weight, bias, y, ignore_index, reduction,
                                                     float(label_smoothing), chunk, step)
    return loss.view(labels.shape) if reduction == "none" else loss


def fused_linear_cross_entropy_reference(hidden, weight, labels, bias=None, *, ignore_index=-100,
                                         reduction="mean", label_smoothing=0.0, chunk_size=None):
    """The chunked torch path: used on CPU, and what the Triton path is tested against."""
    return _run(ce_step_reference, hidden, weight, labels, bias, ignore_index, reduction,
                label_smoothing, chunk_size)


def fused_linear_cross_entropy_triton(hidden, weight, labels, bias=None, *, ignore_index=-100,
                                      reduction="mean", label_smoothing=0.0, chunk_size=None):
    """The same chunk loop with the per-chunk softmax/loss/gradient as a Triton kernel."""
    return _run(_ce_step_triton, hidden, weight, labels, bias, ignore_index, reduction,
                label_smoothing, chunk_size)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               chunk_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, chunked over tokens.

    hidden [N, H] or [B, T, H]; weight [V, H] (the lm_head weight); labels with one entry per
    token, already shifted. Differentiable w.r.t. hidden, weight and bias. Returns an fp32
    scalar, or per-token losses shaped like labels for reduction="none".
    """
    fn = (fused_linear_cross_entropy_triton if use_triton(hidden, weight, bias)
          else fused_linear_cross_entropy_reference)
    return fn(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
              label_smoothing=label_smoothing, chunk_size=chunk_size)


def linear_cross_entropy_eager(hidden, weight, labels, bias=None, *, ignore_index=-100,
                               reduction="mean", label_smoothing=0.0):
    """The unfused computation (full logits, then F.cross_entropy): the oracle in tests and the
    baseline in benchmarks."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias).float()
    loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    return loss.view(labels.shape) if reduction == "none" else loss
