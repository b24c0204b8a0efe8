"""The fine-tuning stage through `fit`: tiny_finetune.yaml continues a tiny.yaml run (init_from)
with AlphaFold's fine-tuning losses (violation, experimentally resolved, PAE with a new PAE head)."""
from __future__ import annotations

import math

import pytest
import torch


@pytest.mark.slow
def test_tiny_finetune_runs_3_steps_from_a_trained_checkpoint(tmp_path):
    """tiny.yaml trains 3 steps with seed 1; tiny_finetune.yaml (seed 0, so its own initial weights
    differ) fine-tunes that run 3 steps: the losses are finite, it evaluates, and its weights are
    the initial run's moved by 3 small steps -- not a fresh model's (which would differ by about
    the weights' own norm)."""
    from phalanx.testing import spawn
    from protein_tiny import finetune_rank

    result, = spawn(finetune_rank, 1, str(tmp_path), timeout=600)
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
    assert "lddt_ca" in str(result["eval"])
    initial, tuned = result["initial"], result["finetune"]
    assert set(tuned) - set(initial) == {"heads.pae.weight", "heads.pae.bias"}
    shared = sorted(initial)
    moved = math.sqrt(sum(float((tuned[k] - initial[k]).square().sum()) for k in shared))
    norm = math.sqrt(sum(float(initial[k].square().sum()) for k in shared))
    assert 0 < moved / norm < 0.1, f"fine-tuned weights moved {moved / norm:.3f} of their norm from the initial run"
    assert any(not torch.equal(tuned[k], initial[k]) for k in shared)
