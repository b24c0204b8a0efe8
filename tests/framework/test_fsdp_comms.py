"""FSDPPlugin's gloo collectives (fsdp_comms) give what torch's all-gather / reduce-scatter give.
The plugin-level equivalence (FSDPPlugin on 2 and 4 ranks = one process) is test_plugins.py."""
from __future__ import annotations

import pytest

import fsdp_comms_workers as workers
from phalanx.testing import spawn


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_replacements_equal_torch_collectives(world):
    for rank, diffs in enumerate(spawn(workers.compare_with_torch_collectives, world)):
        assert set(diffs) == {"all_gather", "reduce_scatter_sum", "reduce_scatter_avg"}
        # all-gather copies bits; the reductions add the same world-size terms, maybe in another order
        assert diffs["all_gather"] == 0.0, (rank, diffs)
        assert diffs["reduce_scatter_sum"] <= 1e-6 and diffs["reduce_scatter_avg"] <= 1e-6, (rank, diffs)
