"""Cross-entropy over vocabulary-parallel logits, and the causal-LM loss a split model uses.

`vocab_parallel_cross_entropy` never gathers the logits: each rank holds the logits of its
vocabulary range; the softmax denominator, the running maximum and the target's logit are
combined with three small all-reduces of one value per token.

`CausalLMLoss` replaces a Hugging Face model's `loss_function` (same signature), so the model's
own forward computes the loss on vocabulary-sharded logits and, under Ulysses/ring sequence
parallelism, on this rank's sequence shard with labels shifted *before* the sequence was split.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.shard import comm


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group):
        logits = logits.float()
        n_local = logits.shape[-1]
        maxima = logits.max(dim=-1).values
        comm.all_reduce_no_grad(maxima, group, dist.ReduceOp.MAX)
        shifted = logits - maxima.unsqueeze(-1)
        exp = shifted.exp()
        denom = exp.sum(dim=-1)
        local_target = target - vocab_start
        mine = (local_target >= 0) & (local_target < n_local)
        safe = local_target.clamp(0, n_local - 1)
        target_logit = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mine
        stats = torch.stack([denom, target_logit])
        comm.all_reduce_no_grad(stats, group)
        denom, target_logit = stats[0], stats[1]
        valid = target != ignore_index
        loss = (denom.log() - target_logit) * valid
        exp.div_(denom.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, safe, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, safe, hit, valid = ctx.saved_tensors
        g = softmax.mul_((grad * valid).unsqueeze(-1))
        g.scatter_add_(-1, safe.unsqueeze(-1), -(grad * hit).unsqueeze(-1).to(g.dtype))
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy (0 where target == ignore_index) from logits [N, V_local] that hold
    columns [vocab_start, vocab_start + V_local) of the vocabulary (padding columns removed)."""
    if comm._size(group) == 1:
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")
    return _VocabParallelCE.apply(logits, target, vocab_start, ignore_index, group)


class _SumOverShards(torch.autograd.Function):
    """Forward: the sum of every sequence shard's partial loss (the full loss, on every rank).
    Backward: each rank back-propagates its own part, scaled by `scale` (see CausalLMLoss)."""

    @staticmethod
    def forward(ctx, x, group, scale):
        ctx.scale = scale
        out = x.detach().clone()
        comm.all_reduce_no_grad(out, group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None, None


class CausalLMLoss:
    """A Hugging Face `loss_function` for a split model.

    head: the model's `VocabParallelLMHead` (or None when the vocabulary is not split);
    tp_group: its group. Logits of this rank's vocabulary range take the vocabulary-parallel
    cross-entropy; full logits (the head gathers them unless told otherwise) the plain one. seq_group: set under Ulysses/ring sequence parallelism, where each rank
    holds a shard of the sequence: the loss is Σ(token losses)/(tokens of the whole sequence),
    summed over the shards. The optimizer averages gradients over data × sequence ranks, so each
    shard's backward is scaled by the sequence-parallel size to make that average the gradient
    of the full-sequence loss.
    """

    def __init__(self, head=None, tp_group=None, seq_group=None):
        self.head = head
        self.tp_group = tp_group
        self.seq_group = seq_group

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        if self.head is not None and self.head.is_local(logits):
            local = self.head.real_logits(logits)
            per_token = vocab_parallel_cross_entropy(local.reshape(-1, local.shape[-1]), target,
                                                     vocab_start=self.head.vocab.start, group=self.tp_group,
                                                     ignore_index=ignore_index)
        else:
            per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target,
                                        ignore_index=ignore_index, reduction="none")
        total = per_token.sum()
        if num_items_in_batch is not None:
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=total.device)
        else:
            count = (target != ignore_index).sum().float()
            if self.seq_group is not None:
                comm.all_reduce_no_grad(count, self.seq_group)
        loss = total / count.clamp(min=1)
        if self.seq_group is not None and comm._size(self.seq_group) > 1:
            loss = _SumOverShards.apply(loss, self.seq_group, float(comm._size(self.seq_group)))
        return loss
