"""`apply_sp`: switch a (possibly tensor-parallel) Hugging Face model to sequence parallelism.

- "split_gather": the decoder layers run on sequence shards over the *tensor-parallel* group
  (needs `apply_tp(..., sequence_parallel=True)`, which does the gathers inside the layers);
- "ulysses": each rank holds a contiguous shard of the sequence; attention all-to-alls it to
  whole sequences of 1/sp of the heads (`phalanx_ulysses` attention);
- "ring": each rank holds two zigzag chunks; key/value blocks circle the ring
  (`phalanx_ring` attention).

For Ulysses and ring, batches must be cut with `phalanx.sequence.inputs.shard_inputs` before the
model runs (the HybridParallelPlugin's model wrapper does it).
"""
from __future__ import annotations

import logging

from torch import nn

from phalanx.mesh import LayoutError
from phalanx.sequence.attention import RING, ULYSSES, register_attention_functions
from phalanx.sequence.context import SequenceContext
from phalanx.sequence.split_gather import apply_split_gather
from phalanx.shard.policy import Policy

log = logging.getLogger(__name__)


def check_sequence_layout(mode: str | None, *, sp: int, tp: int, local_heads: int | None = None,
                          heads: int | None = None) -> None:
    """Stop before any work when a sequence-parallel layout cannot work (for this model, when its
    head counts are given)."""
    if mode is None:
        if sp > 1:
            raise LayoutError(f"sp_size={sp} needs sequence_parallelism='ulysses' or 'ring'")
        return
    if mode not in ("split_gather", "ulysses", "ring"):
        raise LayoutError(f"sequence_parallelism={mode!r} is not one of split_gather, ulysses, ring")
    if mode == "split_gather":
        if sp != 1:
            raise LayoutError(f"sequence_parallelism='split_gather' splits the sequence over the tensor-parallel "
                              f"group: use tp_size={tp * sp} (or tp_size>1) with sp_size=1, not sp_size={sp}")
        if tp == 1:
            raise LayoutError("sequence_parallelism='split_gather' needs tp_size > 1 (it splits the sequence over "
                              "the tensor-parallel ranks); for sequence parallelism without tensor parallelism use "
                              "'ulysses' or 'ring' with sp_size > 1")
    elif mode == "ulysses" and local_heads is not None and local_heads % sp:
        raise LayoutError(f"Ulysses spreads attention heads over sp ranks: {heads} heads / tp_size {tp} = "
                          f"{local_heads} heads per tensor-parallel rank, not divisible by sp_size={sp} "
                          f"({local_heads} % {sp} = {local_heads % sp}); use ring attention or another sp_size")


class _RequireShardedInputs:
    """Refuse calls of the model on whole sequences (`generate`, a direct forward): under Ulysses
    or ring each rank must run on its cut of the batch, which the plugin's wrapper makes."""

    def __init__(self, seq: SequenceContext):
        self.seq = seq

    def __call__(self, module, args):
        if not self.seq.inputs_sharded:
            raise RuntimeError(f"this model runs {self.seq.mode} sequence parallelism: call the boosted model "
                               "(it cuts each batch into sequence shards); generation is not supported in this "
                               "layout — save the model and load it without sequence parallelism to generate")


def apply_sp(model: nn.Module, policy: Policy, *, mode: str, group) -> SequenceContext:
    """Prepare `model` for sequence parallelism over `group` (the tp group for split_gather)."""
    seq = SequenceContext.create(mode, group)
    if mode == "split_gather":
        apply_split_gather(policy.decoder_layers(model), group)
    else:
        register_attention_functions()
        for attention in policy.attention_modules(model):
            seq.attach(attention)
        model.config._attn_implementation = ULYSSES if mode == "ulysses" else RING
        model.register_forward_pre_hook(_RequireShardedInputs(seq))
    log.info("sequence parallel: %s over %d ranks", mode, seq.size)
    return seq
