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
    for a, b in zip(straight, single.losses, strict=True):
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
        for a, b in zip(got["losses"], ddp["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["losses"], ddp["losses"])
        assert abs(got["eval"] - ddp["eval"]) <= 1e-5 * ddp["eval"], name
        for key, value in _weights(got["ckpt"]).items():
            assert torch.allclose(value, reference[key], atol=1e-5), (name, key)


def test_fit_through_hybrid_layouts_matches_ddp(tmp_path):
    """fit with plugin="hybrid": tensor parallel (vocabulary-parallel loss inside the model),
    pipeline (one execute_pipeline per step, gradients weighted by each rank's tokens; a forward-only
    pass for eval), Ulysses sequence parallel and ZeRO-1 data parallel give DDP's losses,
    weights and held-out eval on the same data."""
    results = spawn(th.rank_hybrid_layouts, 2, str(tmp_path), th.HYBRID_LAYOUTS, timeout=600)[0]
    references = {padded: results.pop(f"ddp-{'padded' if padded else 'packed'}") for padded in (True, False)}
    assert set(results) == set(th.HYBRID_LAYOUTS)
    for name, got in results.items():
        ddp = references[got["padded"]]
        reference = _weights(ddp["ckpt"])
        for a, b in zip(got["losses"], ddp["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["losses"], ddp["losses"])
        # The gradient norm of every step checks the scale of the gradients (AdamW's update would
        # hide a uniform scale error, e.g. data counted once per tensor-parallel rank).
        assert len(got["grad_norms"]) == len(ddp["grad_norms"]) == len(ddp["losses"])
        for a, b in zip(got["grad_norms"], ddp["grad_norms"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["grad_norms"], ddp["grad_norms"])
        # After 4 AdamW steps (lr 1e-2) a 1e-7 gradient difference on a near-zero element moves its
        # normalised update by up to ~1e-5, so the weights are compared at 1e-4 (measured <= 1.3e-5).
        worst = max((value - reference[key]).abs().max().item() for key, value in _weights(got["ckpt"]).items())
        assert worst <= 1e-4, (name, worst)
        # the held-out eval (tensor-parallel loss, forward-only pipeline, replicas scoring the same
        # batches) equals DDP's at both evaluations
        assert len(got["evals"]) == len(ddp["evals"]) == 2, (name, got["evals"], ddp["evals"])
        for a, b in zip(got["evals"], ddp["evals"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got["evals"], ddp["evals"])


def test_fit_refuses_what_a_pipeline_cannot_do(tmp_path):
    from phalanx.config import ConfigError
    from phalanx.train import causal_lm_eval

    cfg = th.config(tmp_path, plugin="hybrid", grad_accum_steps=2, plugin_options=dict(pp_size=2, num_microbatches=2))
    with pytest.raises(ConfigError, match="grad_accum_steps=2.*loss_fn"):
        from phalanx.train import fit
        fit(cfg, th.tiny_llama(), th.ArithmeticSequences(), loss_fn=lambda model, batch: model(**batch).loss,
            eval_fn=causal_lm_eval(th.ArithmeticSequences(n=8)))
    assert not any(tmp_path.iterdir())
