"""FSDPPlugin's gloo collectives (fsdp_comms) give what torch's all-gather / reduce-scatter give.
The plugin-level equivalence (FSDPPlugin on 2 and 4 ranks = one process) is test_plugins.py."""
from __future__ import annotations

import pytest

import fsdp_comms_workers as workers
from phalanx.testing import spawn


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_replacements_equal_torch_collectives(world):
    for rank, diffs in enumerate(spawn(workers.compare_with_torch_collectives, world)):
        assert set(diffs) == {"all_gather"} | {f"reduce_scatter_{op}_{exchange}" for op in ("sum", "avg")
                                               for exchange in ("all_to_all", "all_reduce")}
        # all-gather copies bits; the reductions add the same world-size terms, maybe in another order
        assert diffs.pop("all_gather") == 0.0, (rank, diffs)
        assert max(diffs.values()) <= 1e-6, (rank, diffs)


def test_overlapped_gradient_reduce_is_exact_and_deferred():
    """The gradient reduction left running during backward (fsdp_comms.PendingReduces) gives the
    same gradients as the synchronous one when backward returns, and falls back to synchronous
    where FSDP2 would read the output at once (a second backward accumulating, no zero_grad)."""
    for rank, r in enumerate(spawn(workers.overlapped_reduce_gradients, 2)):
        assert r["nonzero"] > 0, (rank, r)
        assert r["first"] == 0.0 and r["accumulated"] == 0.0, (rank, r)
        # the first backward defers every block's reduce (the root runs last, synchronously); the
        # accumulating one defers none
        assert r["deferred"] == 2, (rank, r)  # tiny_llama has 2 blocks
        # ... but holds at most one block's full-size reduce input at a time (the next one's
        # arrival finishes it): FSDP2's own memory, not every block's input until backward ends
        assert r["most_pending"] == 1, (rank, r)


def test_forward_prefetch_starts_the_next_blocks_gather_and_changes_no_number():
    """`FSDPPlugin(forward_prefetch=True)` (the default): when the first block computes, the root's,
    its own and the second block's all-gathers have started (without: the first two only); the
    loss and gradients are bit-identical either way."""
    for rank, r in enumerate(spawn(workers.forward_prefetch_gathers, 2)):
        assert r["gathers"] == (2, 3), (rank, r)
        assert r["loss_diff"] == 0.0 and r["grads_diff"] == 0.0, (rank, r)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_gradients_travel_in_bf16_and_are_summed_in_fp32(world):
    """bf16 FSDPPlugin on gloo: each block's and the root's gradients go into the exchange in bf16
    (half the bytes, no fp32 copy-in) and are added in fp32: the gradients equal FSDP2's own fp32
    reduce-scatter (bit for bit on 2 ranks, where both add the same two numbers; to fp32 rounding on
    4, the order of the adds differs). After a backward without gradient sync FSDP2 holds fp32
    accumulated gradients: that reduce takes an fp32 input, and the accumulation stays exact."""
    for rank, r in enumerate(spawn(workers.compute_dtype_exchange, world)):
        assert r["grad_dtype"] == "float32", (rank, r)
        assert r["plain_dtypes"] == [("bfloat16", "float32")] * 3, (rank, r)  # 2 blocks + the root
        assert r["accumulated_dtypes"] == [("float32", "float32")] * 3, (rank, r)
        tol = 0.0 if world == 2 else 1e-6
        assert r["plain_diff"] <= tol and r["accumulated_diff"] <= tol, (rank, r)
