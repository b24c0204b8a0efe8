"""Megatron-style sequence parallelism on the tensor-parallel group ("split_gather").

The decoder layers run on sequence shards: the hidden states are split along the sequence at the
first layer's input and gathered at the last layer's output, so everything the model does before
(embeddings, position ids, masks) and after (final norm, LM head, loss) sees the whole sequence,
unchanged. Inside the layers, `apply_tp(sequence_parallel=True)` all-gathers the input of
attention/MLP and reduce-scatters the row-parallel outputs, so norms, residuals and dropout hold
1/tp of the activations.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from phalanx.mesh import LayoutError
from phalanx.shard import comm


class _SplitInput:
    def __init__(self, group):
        self.group = group

    def __call__(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        n = dist.get_world_size(self.group)
        if hidden.shape[1] % n:
            raise LayoutError(f"split-gather sequence parallelism cuts the sequence over {n} tensor-parallel ranks: "
                              f"length {hidden.shape[1]} % {n} = {hidden.shape[1] % n} (generation, which feeds one "
                              "token at a time, needs a model without split-gather)")
        hidden = comm.split_along(hidden, 1, self.group)
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=hidden)
        return (hidden, *args[1:]), kwargs


class _GatherOutput:
    def __init__(self, group):
        self.group = group

    def __call__(self, module, args, kwargs, output):
        if isinstance(output, tuple):
            return (comm.gather_replicated(output[0], 1, self.group), *output[1:])
        return comm.gather_replicated(output, 1, self.group)


def apply_split_gather(layers: nn.ModuleList, group) -> None:
    """Hook the first and last decoder layers (the sequence length must divide by the group size;
    the plugin checks it before the forward)."""
    layers[0].register_forward_pre_hook(_SplitInput(group), with_kwargs=True)
    layers[-1].register_forward_hook(_GatherOutput(group), with_kwargs=True)
