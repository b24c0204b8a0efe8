"""Building blocks: LayerNorm and gated multi-head attention through phalanx_kernels.

`masked_softmax` (the Evoformer's biased, masked softmax) and `layer_norm` run as Triton kernels
on GPU and as their torch references on CPU. `chunk_size` splits attention over the batch-like
axis of long inputs, so the [.., H, Q, K] logits never exist for all rows at once; under autograd
each chunk is checkpointed, so the softmax weights of all rows are not kept for the backward
pass either (`chunked`).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx_kernels import layer_norm, masked_softmax


def chunked(fn, rows: int, chunk_size: int | None, dim: int = 1) -> torch.Tensor:
    """`fn(part)` for row slices `part` of `rows` rows, `chunk_size` at a time, concatenated along
    `dim`. Under autograd each chunk is checkpointed (its intermediates are recomputed, one chunk
    at a time, in the backward pass), so the saved activations shrink as well as the forward peak."""
    if chunk_size is None or rows <= chunk_size:
        return fn(slice(0, rows))
    grad = torch.is_grad_enabled()
    outs = []
    for start in range(0, rows, chunk_size):
        part = slice(start, start + chunk_size)
        outs.append(checkpoint(fn, part, use_reentrant=False) if grad else fn(part))
    return torch.cat(outs, dim)


def distance_bin_index(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """[.., i, j]: how many of `edges` (Angstrom, increasing) the distance between points i and j of
    x [.., L, 3] exceeds (squared-distance comparison, as AlphaFold). The one binning of distances:
    the distogram target takes it as the class, the recycling and template embedders as lower edges."""
    d2 = ((x[..., :, None, :] - x[..., None, :, :]) ** 2).sum(-1, keepdim=True)
    return (d2 > edges.to(x.device, x.dtype) ** 2).sum(-1)


def lower_edge_one_hot(x: torch.Tensor, low: float, high: float, n: int) -> torch.Tensor:
    """[.., i, j, n]: AlphaFold's distogram feature of points x [.., L, 3] (`dgram_from_positions`):
    n bins with lower edges linspace(low, high, n), the last open-ended; a pair closer than `low`
    is in no bin (an all-zero one-hot)."""
    index = distance_bin_index(x, torch.linspace(low, high, n))
    return torch.nn.functional.one_hot(index, n + 1)[..., 1:].to(x.dtype)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 when it is in a 16-bit dtype, else unchanged (fp32 and fp64 models keep their
    dtype): the entry to an fp32 island of a bf16 model (softmax inputs, counts, geometry)."""
    return x.float() if x.element_size() < 4 else x


def in_fp32(module: nn.Module, *args, **kwargs):
    """module(*args, **kwargs) computed in fp32 when its weights are 16-bit (an fp32 island of a
    bf16 model): fp32 copies of its parameters (differentiable: the gradients reach the bf16
    weights, and from there the optimizer's fp32 masters) and of its floating-point tensor inputs.
    An fp32 or fp64 module runs as it is."""
    params = dict(module.named_parameters())
    if not params or next(iter(params.values())).element_size() >= 4:
        return module(*args, **kwargs)
    up = {name: p.float() for name, p in params.items()}

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return fp32(x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x
    return torch.func.functional_call(module, up, tuple(cast(a) for a in args), cast(kwargs), strict=False)


class SharedDropout(nn.Module):
    """AlphaFold's row-wise / column-wise dropout (supplement 1.11.6): one Bernoulli mask shared
    along `shared_dim` (every MSA row, or every pair row i, sees the same mask), kept entries scaled
    by 1 / (1 - rate); the identity in eval mode.

    Under Dynamic Axial Parallelism the update arrives split along `split_dim`: the mask is drawn
    for the whole tensor on every rank of the group (their random streams agree, as for MSA
    sampling) and each rank takes its slice, so the layout does not change the draw."""

    def __init__(self, rate: float, shared_dim: int):
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout rate {rate!r}: give a probability in [0, 1)")
        self.rate, self.shared_dim = rate, shared_dim

    def forward(self, x: torch.Tensor, ax=None, split_dim: int = 1) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        size = 1 if ax is None else ax.size
        shape = list(x.shape)
        shape[split_dim] *= size
        shape[self.shared_dim] = 1
        keep = (torch.rand(shape, device=x.device) >= self.rate).to(x.dtype) / (1.0 - self.rate)
        if size > 1 and shape[split_dim] > 1:
            keep = ax.scatter(keep, split_dim)
        return x * keep

    def extra_repr(self) -> str:
        return f"rate={self.rate}, shared_dim={self.shared_dim}"


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


def linear(c_in: int, c_out: int, bias: bool = True, init: str = "default") -> nn.Linear:
    """AlphaFold's initialisations: "default" (LeCun normal), "relu" (He), "zeros" (last layer of
    every residual branch, so each block starts as the identity), "gating" (weights 0, bias 1)."""
    layer = nn.Linear(c_in, c_out, bias=bias)
    with torch.no_grad():
        if init in ("zeros", "gating"):
            layer.weight.zero_()
        else:
            scale = 2.0 if init == "relu" else 1.0
            layer.weight.normal_(0.0, math.sqrt(scale / c_in))
        if bias:
            layer.bias.fill_(1.0 if init == "gating" else 0.0)
    return layer


class Attention(nn.Module):
    """Gated multi-head attention: q from `x_q`, k/v from `x_kv`, an additive `bias` (e.g. the pair
    representation) and a key `mask`. Shapes: x [*, Q, c], bias broadcast to [*, H, Q, K]."""

    def __init__(self, c_in: int, c_hidden: int, heads: int, gating: bool = True):
        super().__init__()
        self.heads, self.c_hidden = heads, c_hidden
        self.q = linear(c_in, heads * c_hidden, bias=False)
        self.k = linear(c_in, heads * c_hidden, bias=False)
        self.v = linear(c_in, heads * c_hidden, bias=False)
        self.g = linear(c_in, heads * c_hidden, init="gating") if gating else None
        self.o = linear(heads * c_hidden, c_in, init="zeros")

    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None,
                chunk_size: int | None = None) -> torch.Tensor:
        """x [B, N, Q, c] (N rows attended independently), mask [B, N, K] (1 keep), bias
        [B, 1, H, Q, K]. chunk_size: rows per chunk (None: all at once)."""
        return chunked(lambda part: self._attend(x[..., part, :, :], mask[..., part, :], bias),
                       x.shape[-3], chunk_size, dim=-3)

    def _attend(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        *lead, q_len, _ = x.shape
        def heads(t):
            return t.view(*lead, q_len, self.heads, self.c_hidden).transpose(-2, -3)
        q = heads(self.q(x)) / math.sqrt(self.c_hidden)
        k, v = heads(self.k(x)), heads(self.v(x))
        logits = q @ k.transpose(-1, -2)                     # [*, H, Q, K]
        weights = masked_softmax(logits, mask[..., None, None, :], bias)
        out = (weights @ v).transpose(-2, -3).reshape(*lead, q_len, self.heads * self.c_hidden)
        if self.g is not None:
            out = out * torch.sigmoid(self.g(x))
        return self.o(out)


class Transition(nn.Module):
    """The two-layer MLP after each attention (n x wider in the middle)."""

    def __init__(self, c: int, n: int = 4):
        super().__init__()
        self.norm = LayerNorm(c)
        self.fc1 = linear(c, n * c, init="relu")
        self.fc2 = linear(n * c, c, init="zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))
