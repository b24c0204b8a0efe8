"""Sequence (context) parallelism: split-gather on the tensor-parallel group, Ulysses all-to-all
attention, and ring attention (zigzag load-balanced, blockwise with an online softmax).

See docs/hybrid.md. `apply_sp(model, policy, mode=..., group=...)` prepares a model;
`shard_inputs` cuts a batch for Ulysses/ring; `ring_attention` and the block functions are usable
on their own; `ulysses_attention` is the bidirectional [B, L, H, D] form for video diffusion transformers.
"""
from phalanx.sequence.apply import apply_sp, check_sequence_layout
from phalanx.sequence.attention import RING, ULYSSES, register_attention_functions
from phalanx.sequence.context import MODES, SequenceContext
from phalanx.sequence.inputs import gather_sequence, shard_inputs
from phalanx.sequence.ring import ring_attention
from phalanx.sequence.ulysses import token_shard, ulysses_attention

__all__ = ["apply_sp", "check_sequence_layout", "RING", "ULYSSES", "register_attention_functions", "MODES",
           "SequenceContext", "gather_sequence", "shard_inputs", "ring_attention", "token_shard", "ulysses_attention"]
