"""A loss computed past the DDP wrapper (e.g. through `model.get_decoder()`) would leave each rank
with its own gradients; `booster.backward` refuses it with an error that names the fix."""
import forward_guard_workers as w

from phalanx.testing import spawn

REFUSAL = "did not go through the boosted model's forward"


def test_ddp_refuses_a_loss_past_its_wrapper_and_trains_through_it():
    for result in spawn(w.backward_paths, 2, "ddp"):
        assert REFUSAL in result["decoder"] and "get_decoder" in result["decoder"]
        assert result["boosted"] == "ok"


def test_one_rank_and_hook_reducing_plugins_have_nothing_to_refuse():
    assert spawn(w.backward_paths, 1, "ddp") == [{"decoder": "ok", "boosted": "ok"}]
    assert spawn(w.backward_paths, 2, "zero2") == [{"decoder": "ok", "boosted": "ok"}] * 2
