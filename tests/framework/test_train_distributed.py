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
from phalanx.testing import ADAMW_UPDATE_RTOL, check, rel_diff, rounding_rtol, spawn, tiny_llama, update_diff

STEPS = 10
# fp32 runs of the same data in another reduction order: losses, gradient norms and evals within
# rounding_rtol of the batch's tokens (8 × 16 = 128: 8·eps·√128 = 1.1e-5), weights after the
# AdamW steps within ADAMW_UPDATE_RTOL of the update (Δ from the initial tiny Llama); measured
# values in docs/training.md.
TOL = rounding_rtol(torch.float32, 8 * th.SEQ)
# Every data-parallel plugin must train the same through fit ("hybrid" adds tensor/sequence
# parallelism, which needs its own options and a vocabulary-parallel head loss).
PLUGINS = tuple(name for name in PLUGIN_NAMES if name != "hybrid")


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(checkpoint) / "model" / "model.safetensors"))


def _initial() -> dict[str, torch.Tensor]:
    return tiny_llama(seed=0).state_dict()


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
    check(rel_diff(straight, single.losses), rounding_rtol(torch.float32, 4 * th.SEQ), "2 ranks vs 1 process: losses")

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
    assert set(results) == set(PLUGINS)
    ddp = results["ddp"]
    reference = _weights(ddp["ckpt"])
    for name in PLUGINS:
        got = results[name]
        check(rel_diff(got["losses"], ddp["losses"]), TOL, f"{name} vs ddp: losses")
        check(rel_diff(got["eval"], ddp["eval"]), TOL, f"{name} vs ddp: eval loss")
        check(update_diff(_weights(got["ckpt"]), reference, _initial()), ADAMW_UPDATE_RTOL, f"{name} vs ddp: weights")


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
        check(rel_diff(got["losses"], ddp["losses"]), TOL, f"{name} vs ddp: losses")
        # The gradient norm of every step checks the scale of the gradients (AdamW's update would
        # hide a uniform scale error, e.g. data counted once per tensor-parallel rank).
        assert len(got["grad_norms"]) == len(ddp["grad_norms"]) == len(ddp["losses"])
        check(rel_diff(got["grad_norms"], ddp["grad_norms"]), TOL, f"{name} vs ddp: gradient norms")
        # AdamW turns rounding noise in near-zero gradients into weight differences of a fraction
        # of lr (the largest single weight differs by ~1e-5): the update measure
        check(update_diff(_weights(got["ckpt"]), _weights(ddp["ckpt"]), _initial()), ADAMW_UPDATE_RTOL,
              f"{name} vs ddp: weights")
        # the held-out eval (tensor-parallel loss, forward-only pipeline, replicas scoring the same
        # batches) equals DDP's at both evaluations
        assert len(got["evals"]) == len(ddp["evals"]) == 2, (name, got["evals"], ddp["evals"])
        check(rel_diff(got["evals"], ddp["evals"]), TOL, f"{name} vs ddp: eval losses")


def test_fit_refuses_what_a_pipeline_cannot_do(tmp_path):
    from phalanx.config import ConfigError
    from phalanx.train import causal_lm_eval

    cfg = th.config(tmp_path, plugin="hybrid", grad_accum_steps=2, plugin_options=dict(pp_size=2, num_microbatches=2))
    with pytest.raises(ConfigError, match="grad_accum_steps=2.*loss_fn"):
        from phalanx.train import fit
        fit(cfg, th.tiny_llama(), th.ArithmeticSequences(), loss_fn=lambda model, batch: model(**batch).loss,
            eval_fn=causal_lm_eval(th.ArithmeticSequences(n=8)))
    assert not any(tmp_path.iterdir())
