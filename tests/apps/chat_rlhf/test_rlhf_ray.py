"""GRPO with decoupled rollouts on Ray (`rollout.mode=ray`, `ray_rollouts.py`) on a local Ray
instance of 2 CPUs: with max_staleness 0 it is the colocated run (same samples, losses and updated
weights); with max_staleness 1 the rollouts lag one update, the lag is logged, and the loss weights
every token by the truncated importance ratio trainer / stale engine (checked by hand); the same for
PPO (its lag and importance weights). Without
Ray installed, ray mode stops with the pip command and the colocated mode never imports Ray."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from apps.chat_rlhf import rl_losses as L
from apps.chat_rlhf.grpo import build_run, load_grpo_config
from apps.chat_rlhf.rl_logprobs import completion_logprobs
from apps.chat_rlhf.rollout import completion_batch, padded
from phalanx.config import ConfigError
from phalanx.testing import check, rel_diff, update_diff


def length_reward(*, completions, **_):
    """Characters of the reply: spread within every group (6 tokens decode to different lengths)."""
    return [float(len(c)) for c in completions]


def _cfg(model, out, *extra):
    return load_grpo_config(None, [f"model={model}", "data.num_train=16", "data.num_heldout=0",
                                   "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                   "grpo.rewards=[test_rlhf_ray:length_reward]", "train.micro_batch_size=2",
                                   f"train.output_dir={out}", "train.lr=1e-3", "train.min_lr_ratio=1.0",
                                   "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false",
                                   "train.resume=false", "train.save_every=0", *extra])


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture(scope="module")
def ray_local():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _train(cfg):
    run = build_run(cfg)
    start = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    try:
        run.train()
    finally:
        run.close()
    return run, start


@pytest.mark.slow
def test_ray_staleness_0_equals_colocated_first_two_updates(tiny_chat_model, tmp_path, ray_local):
    colocated, start = _train(_cfg(tiny_chat_model, tmp_path / "colocated", "train.max_steps=2"))
    ray_run, ray_start = _train(_cfg(tiny_chat_model, tmp_path / "ray", "train.max_steps=2", "rollout.mode=ray"))
    assert [r["reward_mean"] for r in ray_run.hook.history] == [r["reward_mean"] for r in colocated.hook.history]
    assert [r["rollout_lag"] for r in ray_run.hook.history] == [0, 0]
    assert all(r["zero_spread_frac"] == 0 for r in colocated.hook.history)  # both steps update the weights
    got, want = _losses(tmp_path / "ray"), _losses(tmp_path / "colocated")
    assert len(want) == 2
    # as one tensor, at the scale of the run's losses: the first on-policy GRPO loss is rounding-level
    # (its advantages sum to zero; 6e-9 here, 0 vs -2e-8 with AVX2 kernels), no scale of its own
    check(rel_diff(torch.tensor(got), torch.tensor(want)), 1e-5, "ray (staleness 0) vs colocated GRPO losses")
    for k in start:
        assert torch.equal(start[k], ray_start[k])
    check(update_diff(ray_run.model.state_dict(), colocated.model.state_dict(), start), 1e-5,
          "ray (staleness 0) vs colocated GRPO weights after 2 updates")


class Recording:
    """The run's rollout_fn, recording each rollout with the trainer's weights when it was used."""

    def __init__(self, inner, model):
        self.inner, self.model, self.calls = inner, model, []

    def prompts_for(self, step, per_rank):
        return self.inner.prompts_for(step, per_rank)

    def __call__(self, indices, step):
        rollout = self.inner(indices, step)
        self.calls.append((step, rollout, copy.deepcopy(self.model)))
        return rollout


@pytest.mark.slow
def test_ray_staleness_1_lags_one_update_and_is_importance_corrected(tiny_chat_model, tmp_path, ray_local):
    cap = 2.0
    cfg = _cfg(tiny_chat_model, tmp_path, "train.max_steps=3", "train.lr=3e-2", "rollout.mode=ray",
               "rollout.max_staleness=1", f"grpo.tis_cap={cap}", "grpo.max_logprob_gap=5",
               "grpo.shared_prompt_forward=false")
    run = build_run(cfg)
    recording = Recording(run.loss.rollout_fn, run.model)
    run.loss.rollout_fn = recording
    try:
        run.train()
    finally:
        run.close()
    history = run.hook.history
    assert [r["rollout_lag"] for r in history] == [0, 1, 1]  # the first rollout is on-policy, then one behind
    assert [s for s, _, _ in recording.calls] == [1, 2, 3]
    assert history[0]["zero_spread_frac"] == 0  # step 1 moves the weights
    # Rounding-level gap on-policy; the lagged rollouts differ by one update of the policy.
    assert history[0]["logprob_gap"] < 1e-4 and history[1]["logprob_gap"] > 100 * history[0]["logprob_gap"]
    assert abs(history[1]["tis_weight"] - 1) > 1e-3
    # Step 2's loss by hand: the old policy is the trainer's forward (ratio 1), each token weighted by
    # min(pi_trainer / pi_engine, cap) where the engine sampled with the weights before update 1.
    _, rollout, trainer = recording.calls[1]
    batch = completion_batch(rollout.prompt_ids, rollout.completion_ids, run.loss.pad_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(trainer, batch)
    mask = batch["completion_mask"].float()
    engine_lp = padded(rollout.engine_logprobs, logp.shape[1])
    scores = torch.tensor(length_reward(completions=rollout.texts))
    adv = L.group_advantages(scores.view(-1, rollout.n), baseline="grpo", scale="group").reshape(-1, 1).float()
    tis = torch.exp(logp - engine_lp).clamp(max=cap)
    want = float(-(adv * tis * mask).sum() / mask.sum())
    uncorrected = float(-(adv * mask).sum() / mask.sum())
    got = _losses(tmp_path)[1]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert abs(uncorrected - want) > 100 * max(1e-4 * abs(want), 1e-6)  # the correction is visible at this lag


def test_missing_ray_is_one_clear_error_and_colocated_never_imports_it(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the package
    with pytest.raises(ConfigError, match=r'rollout.mode=ray needs Ray.*pip install "ray==2.58.0"'):
        load_grpo_config(None, ["rollout.mode=ray"])
    run = build_run(_cfg(tiny_chat_model, tmp_path, "train.max_steps=1"))
    run.train()
    assert run.hook.history[0]["rollout_lag"] == 0


def test_bad_rollout_settings_are_named():
    with pytest.raises(ConfigError, match="choose colocated or ray"):
        load_grpo_config(None, ["rollout.mode=remote"])
    with pytest.raises(ConfigError, match="max_staleness=1 needs rollout.mode=ray"):
        load_grpo_config(None, ["rollout.max_staleness=1"])


def _ppo_cfg(model, out, *extra):
    from apps.chat_rlhf.ppo import load_ppo_config

    return load_ppo_config(None, [f"model={model}", "data.num_train=12", "data.num_heldout=0",
                                  "ppo.num_generations=2", "ppo.max_new_tokens=6",
                                  "ppo.rewards=[test_rlhf_ray:length_reward]", "ppo.ppo_epochs=1",
                                  "ppo.num_mini_batches=1", "train.micro_batch_size=2", f"train.output_dir={out}",
                                  "train.lr=1e-2", "train.min_lr_ratio=1.0", "engine.max_model_len=96",
                                  "train.progress_bar=false", "train.plot=false", "train.max_steps=2",
                                  "train.save_every=0", *extra])


@pytest.mark.slow
def test_ppo_ray_staleness_0_equals_colocated(tiny_chat_model, tmp_path, ray_local):
    """PPO in ray mode (the actor's weights broadcast when its buffer is used up): the colocated run's
    rollouts, losses and weights after 2 updates."""
    from apps.chat_rlhf.ppo import actor_weights, train_ppo
    from transformers import AutoModelForCausalLM

    def cfg(out, *extra):
        return _ppo_cfg(tiny_chat_model, out, *extra)
    _, colocated = train_ppo(cfg(tmp_path / "colocated"))
    _, ray_hook = train_ppo(cfg(tmp_path / "ray", "rollout.mode=ray"))
    assert [r["reward_mean"] for r in ray_hook.history] == [r["reward_mean"] for r in colocated.history]
    assert [r["rollout_lag"] for r in ray_hook.history] == [0, 0]  # staleness 0: every rollout on-policy
    check(rel_diff(_losses(tmp_path / "ray"), _losses(tmp_path / "colocated")), 1e-5, "ray vs colocated PPO losses")
    start = AutoModelForCausalLM.from_pretrained(str(tiny_chat_model)).state_dict()
    got, want = actor_weights(ray_hook.model), actor_weights(colocated.model)
    assert want.keys() == start.keys()
    check(update_diff(got, want, start), 1e-5, "ray vs colocated PPO actor after 2 updates")


@pytest.mark.slow
def test_grpo_ray_command_under_the_emulated_gpu(tiny_chat_model, tmp_path):
    """`python -m apps.chat_rlhf.grpo --config grpo_ray.yaml` under PHALANX_EMULATE_GPU=1: the trainer's
    policy on the device, its weights copied to the host for the broadcast, rollouts one update behind
    (the command starts and stops its own local Ray instance), and the held-out evaluation on the workers."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "emulated"))
    from emulated_run import run_module_emulated
    out = tmp_path / "grpo_ray"
    log = run_module_emulated("apps.chat_rlhf.grpo", "--config", "apps/chat_rlhf/configs/grpo_ray.yaml",
                              f"model={tiny_chat_model}", f"train.output_dir={out}", "data.num_train=8",
                              "data.num_heldout=4", "grpo.num_generations=2", "grpo.max_new_tokens=4",
                              "grpo.rewards=[tests.apps.chat_rlhf.test_rlhf_ray:length_reward]",
                              "train.micro_batch_size=2", "train.max_steps=3", "train.eval_every=3", "train.lr=1e-3",
                              "engine.max_model_len=64", "engine.max_num_seqs=4", "engine.kv_cache_memory_gib=0.01",
                              "train.progress_bar=false", "train.plot=false", "train.warmup_steps=0")
    assert "device cuda:0 (emulated)" in log
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["rollout_lag"] for r in records] == [0, 1, 1]
    assert records[0]["logprob_gap"] < 1e-2  # the workers got the device policy's weights (bf16 engine: auto)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval/heldout" in line]
    assert [r["step"] for r in evals] == [3] and evals[0]["eval/heldout_n"] == 4  # greedy answers from the workers


@pytest.mark.slow
def test_ppo_ray_staleness_1_lags_one_update_and_is_importance_corrected(tiny_chat_model, tmp_path, ray_local):
    """PPO with max_staleness 1: the first rollout is on-policy and equals the colocated run's, the
    next ones were sampled one update behind (rollout_lag 1), and their tokens carry importance
    weights trainer / stale engine away from 1 (a colocated run's stay at 1 up to rounding)."""
    from apps.chat_rlhf.ppo import train_ppo

    extra = ("train.max_steps=3", "ppo.tis_cap=2.0")
    _, colocated = train_ppo(_ppo_cfg(tiny_chat_model, tmp_path / "colocated", *extra))
    _, lagged = train_ppo(_ppo_cfg(tiny_chat_model, tmp_path / "ray", *extra, "rollout.mode=ray",
                                   "rollout.max_staleness=1"))
    assert [r["rollout_lag"] for r in colocated.history] == [0, 0, 0]
    assert [r["rollout_lag"] for r in lagged.history] == [0, 1, 1]
    assert lagged.history[0]["reward_mean"] == colocated.history[0]["reward_mean"]  # same weights sampled it
    check(rel_diff(_losses(tmp_path / "ray")[:1], _losses(tmp_path / "colocated")[:1]), 1e-5,
          "first (on-policy) PPO loss, ray staleness 1 vs colocated")
    on_policy = max(abs(r["tis_weight"] - 1) for r in colocated.history)
    assert on_policy < 1e-4
    assert min(abs(r["tis_weight"] - 1) for r in lagged.history[1:]) > 10 * max(on_policy, 1e-5)
