"""The default causal-LM loss: next-token cross-entropy without ever building the logits.

`CausalLMLoss` wraps a Hugging Face `...ForCausalLM` so that its forward runs the decoder and
feeds the last hidden states straight into `phalanx_kernels.fused_linear_cross_entropy` with
the LM head's weight. A [tokens, vocab] logits tensor (and its fp32 copy and gradient) is never
materialised: on a 32k vocabulary that is most of a small model's activation memory.

The loss is computed *inside* `forward`, so the parallel wrappers see an ordinary forward: DDP's
gradient hooks fire, and FSDP2 gathers the LM head (a root parameter) for the root forward. The
HF model is stored as `self.module`, which is how `unwrap_model` reaches it, so checkpoints are
written from the HF model itself and `model/` stays a plain Hugging Face directory.

The forward returns the *sum* of token losses, not the mean: the loop divides by the number of
target tokens in the whole global batch (all micro-batches, all ranks), which is the only
normalisation under which gradient accumulation and data parallelism give exactly the gradient
of one big batch when micro-batches hold different numbers of real (non-ignored) tokens.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.data.labels import IGNORE_INDEX


def causal_lm_labels(batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The batch's labels in the Hugging Face convention (aligned with input_ids, not shifted):
    "labels" if present, else the inputs with padding (attention_mask == 0) ignored."""
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"]
        mask = batch.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, ignore_index)
    return labels


def next_token_targets(batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets aligned with each position: targets[:, t] = labels[:, t + 1]; the last position
    has no next token and is ignored (labels as in `causal_lm_labels`)."""
    return F.pad(causal_lm_labels(batch, ignore_index)[:, 1:], (0, 1), value=ignore_index)


def model_loss_sum(model: nn.Module, batch: Mapping[str, Any], targets: int) -> torch.Tensor:
    """Sum of the batch's `targets` token losses from a model whose forward computes their mean from
    `labels` (a tensor/sequence-parallel model: the hybrid plugin installs a vocabulary-parallel
    loss in it)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, labels=causal_lm_labels(batch), use_cache=False).loss * targets


def count_target_tokens(batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> int:
    return int((next_token_targets(batch, ignore_index) != ignore_index).sum().item())


def _fused_linear_cross_entropy():
    try:
        from phalanx_kernels import fused_linear_cross_entropy
    except ImportError as exc:
        raise RuntimeError(
            "the default causal-LM loss needs phalanx_kernels.fused_linear_cross_entropy, which cannot be "
            f"imported ({exc}); reinstall phalanx (`pip install -e .`), or pass loss_fn= to fit") from exc
    return fused_linear_cross_entropy


def check_causal_lm(model: nn.Module) -> None:
    """Fail early, naming the fix, for models the fused head loss would get wrong."""
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"{name} has no output (LM) head: fit's default loss needs a Hugging Face causal LM "
                        "(…ForCausalLM); for other models pass loss_fn=")
    get_decoder = getattr(model, "get_decoder", None)
    if not callable(get_decoder) or get_decoder() is model:
        raise TypeError(f"cannot find the decoder inside {name} (model.get_decoder()); pass loss_fn= to fit")
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(config, attr, None)
        if value not in (None, 0, 1, 1.0):
            raise TypeError(f"{name} transforms its logits ({attr}={value}), which the fused LM-head loss does not "
                            "apply; pass loss_fn= to fit")


def causal_lm_loss_sum(model: nn.Module, batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX,
                       chunk_size: int | None = None, loss_impl=None) -> torch.Tensor:
    """Sum of next-token cross-entropies of `batch` under the HF causal LM `model` (fp32 scalar)."""
    loss_impl = loss_impl or _fused_linear_cross_entropy()
    targets = next_token_targets(batch, ignore_index)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model.get_decoder()(**inputs, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    head = model.get_output_embeddings()
    return loss_impl(hidden, head.weight, targets, getattr(head, "bias", None), ignore_index=ignore_index,
                     reduction="sum", chunk_size=chunk_size)


class CausalLMLoss(nn.Module):
    """`forward(**batch)` -> sum of next-token losses of the wrapped causal LM (see module doc)."""

    def __init__(self, model: nn.Module, *, ignore_index: int = IGNORE_INDEX, chunk_size: int | None = None):
        super().__init__()
        check_causal_lm(model)
        self.module = model
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self._loss_impl = _fused_linear_cross_entropy()

    def forward(self, **batch: Any) -> torch.Tensor:
        if "input_ids" not in batch:
            raise ValueError(f"the causal-LM loss needs batches with 'input_ids' (got keys {sorted(batch)}); "
                           "fix the dataset/collate_fn or pass loss_fn= to fit")
        return causal_lm_loss_sum(self.module, batch, ignore_index=self.ignore_index, chunk_size=self.chunk_size,
                                  loss_impl=self._loss_impl)
