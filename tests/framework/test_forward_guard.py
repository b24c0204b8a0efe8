"""A loss computed past the DDP wrapper (e.g. through `model.get_decoder()`) would leave each rank
with its own gradients; `booster.backward` refuses it with an error that names the fix."""
import pytest

import forward_guard_workers as w

from phalanx.testing import spawn
from spawn_batch import spawn_suites

REFUSAL = "did not go through the boosted model's forward"
DDP, NOTHING = ("test_ddp_refuses_a_loss_past_its_wrapper_and_trains_through_it",
                "test_one_rank_and_hook_reducing_plugins_have_nothing_to_refuse")


@pytest.fixture(scope="module")
def two_ranks(request):
    """Both tests' 2-rank runs in one spawn (spawn_batch: rank start-up costs seconds)."""
    suites = {DDP: (w.backward_paths, ("ddp",), {}), f"{NOTHING}:zero2": (w.backward_paths, ("zero2",), {})}
    return spawn_suites(request, 2, suites, timeout=480)


def test_ddp_refuses_a_loss_past_its_wrapper_and_trains_through_it(two_ranks):
    for result in two_ranks.get(DDP):
        assert REFUSAL in result["decoder"] and "get_decoder" in result["decoder"]
        assert result["boosted"] == "ok"


def test_one_rank_and_hook_reducing_plugins_have_nothing_to_refuse(two_ranks):
    assert spawn(w.backward_paths, 1, "ddp") == [{"decoder": "ok", "boosted": "ok"}]
    assert two_ranks.get(f"{NOTHING}:zero2") == [{"decoder": "ok", "boosted": "ok"}] * 2
