"""`fit` on 2 gloo ranks: equal to one process on the same global batch, exact resume after a
real process restart (10 straight steps == 5 steps, new processes, 5 more steps), and the same
result through every plugin. One set of rank processes serves all checks but the restart."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_helpers as th
from phalanx.booster.plugins import PLUGIN_NAMES
from phalanx.testing import spawn

STEPS = 10
# Every data-parallel plugin must train the same through fit ("hybrid" adds tensor/sequence
# parallelism, which needs its own options and a vocabulary-parallel head loss).
PLUGINS = tuple(name for name in PLUGIN_NAMES if name != "hybrid")


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def first_session(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    return root, spawn(th.rank_first_session, 2, str(root), STEPS, PLUGINS)


def test_two_ranks_match_one_process_and_resume_exactly(first_session, tmp_path):
    root, first = first_session
    # A real restart: fresh processes, nothing shared with the first session but the files.
    second = spawn(th.rank_resume, 2, str(root / "half"), STEPS)
    single, _ = th.train(tmp_path / "single", max_steps=STEPS, micro_batch_size=4)

    straight = first[0]["straight"]
    assert first[1]["straight"] == straight  # every rank reports the same global losses

    # 2 ranks x micro-batch 2 == 1 process x micro-batch 4 (same samples, token-weighted mean)
    for a, b in zip(straight, single.losses):
        assert abs(a - b) <= 1e-5 * abs(b), (straight, single.losses)

    # the half run is the straight run's first half; the restarted run is its second half
    assert first[0]["half"] == straight[: STEPS // 2]
    resumed = second[0]
    assert resumed["start_step"] == STEPS // 2
    assert resumed["losses"] == straight[STEPS // 2:], (resumed["losses"], straight[STEPS // 2:])
    final_straight, final_resumed = _weights(first[0]["straight_ckpt"]), _weights(resumed["ckpt"])
    for name, value in final_straight.items():
        assert torch.equal(value, final_resumed[name]), name

    # every rank's RNG state is in the checkpoint
    half_ckpt = Path(first[0]["half_ckpt"])
    assert sorted(p.name for p in (half_ckpt / "rng").iterdir()) == ["rank00000.json", "rank00001.json"]


def test_fit_runs_every_plugin_to_the_same_result(first_session):
    """fit through DDP, FSDP2, ZeRO-1/2 and Gemini (accumulation, uneven padding, eval, checkpoint):
    same losses, same eval, same saved weights, on 2 ranks."""
    results = first_session[1][0]["plugins"]
    ddp = results["ddp"]
    reference = _weights(ddp["ckpt"])
    for name in PLUGINS:
        got = results[name]
        for a, b in zip(got["losses"], ddp["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["losses"], ddp["losses"])
        assert abs(got["eval"] - ddp["eval"]) <= 1e-5 * ddp["eval"], name
        for key, value in _weights(got["ckpt"]).items():
            assert torch.allclose(value, reference[key], atol=1e-5), (name, key)
