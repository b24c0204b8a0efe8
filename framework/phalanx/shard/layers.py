"""The layers a tensor-parallel model is made of; each holds only this rank's piece of its weights.

They take over the parameters of the Hugging Face module they replace under the same attribute
names (`weight`, `bias`), so parameter names and state-dict keys do not change. `transposed=True`
means the weight is stored [in, out] (GPT-2's `Conv1D`) instead of `nn.Linear`'s [out, in].

Under Megatron-style split-gather sequence parallelism, activations outside these layers are
split along the sequence over the tensor-parallel group: the input of a group of column-parallel
projections is all-gathered along the sequence (`InputComm`, or input_comm="gather"), a
row-parallel layer reduce-scatters its output back to sequence shards.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.shard import comm


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:
        y = x @ weight
        return y + bias if bias is not None else y
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r (+ b_r): this rank computes its slice of the output features.

    input_comm: "copy" (identity forward, gradient all-reduced over the group), "gather" (the
    input is a sequence shard: all-gather it along `seq_dim`, reduce-scatter the gradient) or
    "none" (the enclosing attention/MLP module already did one of those for all its projections:
    see `InputComm`)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, group, transposed: bool = False,
                 input_comm: str = "copy", seq_dim: int = -2):
        super().__init__()
        if input_comm not in ("copy", "gather", "none"):
            raise ValueError(f"input_comm={input_comm!r}")
        self.weight = weight
        self.bias = bias
        self.group = group
        self.transposed = transposed
        self.input_comm = input_comm
        self.seq_dim = seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_comm == "gather":
            x = comm.gather_along(x, self.seq_dim, self.group)
        elif self.input_comm == "copy":
            x = comm.copy_to_group(x, self.group)
        return _matmul(x, self.weight, self.bias, self.transposed)

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, transposed={self.transposed}, input={self.input_comm}"


class ReplicatedHeadsLinear(ColumnParallelLinear):
    """A key/value projection with fewer heads than tensor-parallel ranks: every rank keeps the
    whole (small) weight and uses only the output features of the head its query heads read,
    `[keep_start, keep_end)`. The weight's gradient is partial on each rank (summed over the
    group by the optimizer)."""

    def __init__(self, weight, bias, *, keep: tuple[int, int], **kwargs):
        super().__init__(weight, bias, **kwargs)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y[..., self.keep[0]:self.keep[1]]


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r W_r + b: the input features are this rank's slice; partial products are summed
    over the group, or reduce-scattered along `seq_dim` under sequence parallelism; the bias is
    added once, after the sum."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, group, transposed: bool = False,
                 sequence_parallel: bool = False, seq_dim: int = -2):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.transposed = transposed
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(x, self.weight, None, self.transposed)
        if self.sequence_parallel:
            y = comm.reduce_scatter_along(y, self.seq_dim, self.group)
        else:
            y = comm.reduce_from_group(y, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, transposed={self.transposed}, sp={self.sequence_parallel}"


class InputComm:
    """A forward pre-hook for an attention or MLP module whose projections are column parallel
    with input_comm="none": one copy-to-group (or, under sequence parallelism, one all-gather
    along the sequence) of the module's input serves all its projections. The module then sees
    the whole sequence, so shapes it derives from its input match its projections' outputs."""

    def __init__(self, group, gather: bool, seq_dim: int = -2):
        self.group = group
        self.gather = gather
        self.seq_dim = seq_dim

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather:
            return comm.gather_along(x, self.seq_dim, self.group)
        return comm.copy_to_group(x, self.group)

    def __call__(self, module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=self._apply(kwargs["hidden_states"]))
        elif args:
            args = (self._apply(args[0]), *args[1:])
        else:
            raise RuntimeError(f"{type(module).__name__} was called without hidden states to distribute")
        return args, kwargs


class VocabRange:
    """Rows [start, end) of a vocabulary of `vocab_size` that this rank holds; its local piece has
    `chunk` rows, the last `chunk - (end - start)` of them padding."""

    def __init__(self, vocab_size: int, rank: int, tp: int):
        self.vocab_size = vocab_size
        self.chunk = -(-vocab_size // tp)
        self.start = min(rank * self.chunk, vocab_size)
        self.end = min(self.start + self.chunk, vocab_size)

    @property
    def real(self) -> int:
        return self.end - self.start


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over the group: each rank looks up the ids in its vocabulary range,
    zeros elsewhere, and the sum over the group is the full lookup."""

    def __init__(self, weight: nn.Parameter, *, vocab: VocabRange, group, padding_idx: int | None = None):
        super().__init__()
        self.weight = weight
        self.vocab = vocab
        self.group = group
        self.num_embeddings = vocab.vocab_size
        self.embedding_dim = weight.shape[1]
        self.padding_idx = padding_idx
        inside = padding_idx is not None and vocab.start <= padding_idx < vocab.end
        self._local_padding_idx = padding_idx - vocab.start if inside else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if comm._size(self.group) == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        outside = (ids < self.vocab.start) | (ids >= self.vocab.end)
        local = (ids - self.vocab.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.reduce_from_group(out, self.group)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab.vocab_size}, rows=[{self.vocab.start}, {self.vocab.end}), local={tuple(self.weight.shape)}"


class VocabParallelLMHead(ColumnParallelLinear):
    """The output projection split over the vocabulary. It returns the full logits (gathered over
    the group: what `generate` and any caller of the plain model expect), or, inside
    `with head.local_logits():` (the HybridParallelPlugin and the pipeline runtime enter it when
    only the loss needs the logits), this rank's vocabulary range only (padding columns included;
    `real_logits` drops them), for `phalanx.shard.loss.vocab_parallel_cross_entropy`."""

    def __init__(self, weight, bias, *, vocab: VocabRange, **kwargs):
        super().__init__(weight, bias, **kwargs)
        self.vocab = vocab
        self.out_features = vocab.vocab_size
        self._local = False  # set by `local_logits` only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self._local else self.gather_logits(y)

    @contextlib.contextmanager
    def local_logits(self, on: bool = True) -> Iterator[None]:
        """Forwards inside return this rank's vocabulary range (`on`) or the gathered logits (not
        `on`); the setting before is back after."""
        before, self._local = self._local, on
        try:
            yield
        finally:
            self._local = before

    def is_local(self, logits: torch.Tensor) -> bool:
        return logits.shape[-1] == self.vocab.chunk and self.vocab.chunk != self.vocab.vocab_size

    def real_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., :self.vocab.real]

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from every rank's local ones (differentiable)."""
        if comm._size(self.group) == 1:
            return logits[..., :self.vocab.vocab_size]
        full = comm.gather_replicated(logits, logits.dim() - 1, self.group)
        return unpad_vocab(full, self.vocab)


def unpad_vocab(gathered: torch.Tensor, vocab: VocabRange) -> torch.Tensor:
    """Drop the padding columns from logits gathered over the group ([..., tp * chunk])."""
    parts = gathered.split(vocab.chunk, dim=-1)
    keep = [p[..., :max(0, min(vocab.chunk, vocab.vocab_size - r * vocab.chunk))] for r, p in enumerate(parts)]
    return torch.cat(keep, dim=-1)
