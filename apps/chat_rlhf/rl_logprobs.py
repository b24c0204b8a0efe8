"""The one log-prob implementation of online RL (GRPO, PPO's actor, the reference models).

log p(token) = logit[token] - logsumexp(logits row), computed in chunks of rows (`_TokenLogProbs`):
no full-vocabulary float32 log-softmax is ever built, forward or backward; the float32
temporaries are at most `CHUNK_ELEMENTS` at a time, and the gradient is written into one buffer of
the logits' own dtype. `completion_logprobs` runs a model over a rollout batch (plain or
shared-prompt) and reads the completion tokens' log-probs; `shifted_logprobs` does the same for
logits a caller already has ([B, T+1, V], position t predicting token t).
"""
from __future__ import annotations

import torch


class _TokenLogProbs(torch.autograd.Function):
    """log p(target) = logit[target] - logsumexp(logits) for chosen rows of [N, V] logits, in row
    chunks, with the gradient written straight into one [N, V] buffer: no full-vocabulary
    log-softmax (or float copy of it) is kept for backward. Several outputs may read one row (the
    first completion token of every sample of a prompt reads the prompt's last position)."""

    CHUNK_ELEMENTS = 1 << 24  # ~64 MB of float32 temporaries per chunk

    @staticmethod
    def forward(ctx, logits, rows, targets, with_entropy: bool):
        N, V = logits.shape
        chunk = max(1, _TokenLogProbs.CHUNK_ELEMENTS // max(V, 1))
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(N if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for s in range(0, N, chunk):
            x = logits[s:s + chunk].float()
            lse[s:s + chunk] = torch.logsumexp(x, dim=-1)
            if with_entropy:  # H = lse - sum p * logit
                p = (x - lse[s:s + chunk, None]).exp_()
                entropy[s:s + chunk] = lse[s:s + chunk] - (p * x).sum(-1)
        logp = logits[rows, targets].float() - lse[rows]
        entropy = entropy[rows] if with_entropy else entropy
        ctx.save_for_backward(logits, lse, rows, targets)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        logits, lse, rows, targets = ctx.saved_tensors
        N, V = logits.shape
        chunk = max(1, _TokenLogProbs.CHUNK_ELEMENTS // max(V, 1))
        grad_logp = grad_logp.float()
        per_row = torch.zeros(N, dtype=torch.float32, device=logits.device).index_add_(0, rows, grad_logp)
        grad = torch.empty_like(logits)
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            g = (logits[s:e].float() - lse[s:e, None]).exp_().mul_(-per_row[s:e, None])  # -softmax * sum of grads
            here = (rows >= s) & (rows < e)
            g.index_put_((rows[here] - s, targets[here]), grad_logp[here], accumulate=True)
            grad[s:e] = g
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 log p(targets[m]) under the softmax of logits[rows[m]] (logits [N, V]), differentiable
    in the logits, and the (non-differentiable) entropy of those rows when asked."""
    logp, entropy = _TokenLogProbs.apply(logits, rows, targets, with_entropy)
    return logp, entropy if with_entropy else None


def shifted_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, with_entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probs of `targets` [B, T] under logits [B, T+1, V] (position t predicts token t;
    the last position is not read), masked; and the masked entropy when asked."""
    B, T = targets.shape
    dev = targets.device
    rows = (torch.arange(B, device=dev)[:, None] * logits.shape[1] + torch.arange(T, device=dev)).reshape(-1)
    logp, entropy = token_logprobs(logits.reshape(-1, logits.shape[-1]), rows, targets.reshape(-1),
                                   with_entropy=with_entropy)
    mask = mask.to(logp.dtype)
    return logp.view(B, T) * mask, (entropy.view(B, T) * mask if with_entropy else None)


def completion_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, with_entropy: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of the completion tokens under `model` (raw distribution, temperature 1),
    and optionally the per-token entropy. Only the positions that predict completion tokens go
    through the LM head. `batch`: from `completion_batch`, or `shared_prompt_batch` (one forward
    over the packed rows: one call, so DDP / ZeRO / FSDP2 / tensor-parallel wrappers see a normal
    forward)."""
    mask = batch["completion_mask"]
    B, T = mask.shape
    if "logit_index" not in batch:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], logits_to_keep=T + 1, use_cache=False)
        # position P-1+t predicts completion token t
        return shifted_logprobs(out.logits, batch["input_ids"][:, -T:], mask, with_entropy=with_entropy)
    from .rollout import supports_shared_prompt
    reason = supports_shared_prompt(model)
    if reason is not None:
        raise ValueError(f"a shared-prompt batch cannot run on this model: {reason}; build it with "
                         "completion_batch (grpo.shared_prompt_forward=false)")
    attn = batch["attention_mask"]
    from phalanx.booster.plugins.base import unwrap_model
    if unwrap_model(model).config._attn_implementation == "eager":  # eager adds the mask to the scores
        attn = torch.zeros(attn.shape, device=attn.device).masked_fill_(~attn, torch.finfo(torch.float32).min)
    out = model(input_ids=batch["input_ids"], attention_mask=attn, position_ids=batch["position_ids"],
                logits_to_keep=int(batch["logits_to_keep"]), use_cache=False)
    rows, targets = batch["logit_index"].reshape(-1), batch["targets"].reshape(-1)
    logits = out.logits
    logp, entropy = token_logprobs(logits.reshape(-1, logits.shape[-1]), rows, targets, with_entropy=with_entropy)
    logp = logp.view(B, T) * mask
    return logp, (entropy.view(B, T) * mask if with_entropy else None)
