"""Online RL that can fail: GRPO and PPO raise a reward on a tiny task within a few steps, and the
same run with the advantage's sign flipped (the policy pushed *away* from what the reward prefers)
lowers it. A bug that loses the learning signal (advantages zeroed, a wrong sign, a detached
log-prob, stale engine weights) fails one of the two cases.

The task: the tiny random model's replies (always the full `max_new_tokens` tokens) score
1 - characters / 40, so the policy gains by choosing short tokens; measured on the rollouts'
mean reward, first steps against last steps. Marked slow: 40-120 s each on 2 busy cores (measured
changes: GRPO +0.09 / -0.31, PPO +0.07 / -0.09 against the +-0.04 asserted)."""
from __future__ import annotations

import pytest

from apps.chat_rlhf import rl_losses as L


def short_reward(*, completions, **_):
    return [1.0 - min(len(c), 40) / 40 for c in completions]


def _change(rewards: list[float], k: int = 3) -> float:
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k


COMMON = ["data.num_train=32", "data.num_heldout=0", "train.micro_batch_size=4", "train.min_lr_ratio=1.0",
          "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false",
          "train.save_every=0", "train.keep_last=1"]


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["advantage", "flipped_advantage"])
def test_grpo_raises_the_reward_and_a_flipped_sign_lowers_it(tiny_chat_model, tmp_path, monkeypatch, sign):
    from apps.chat_rlhf.grpo import build_run, load_grpo_config
    original = L.group_advantages
    monkeypatch.setattr(L, "group_advantages", lambda *a, **k: sign * original(*a, **k))
    cfg = load_grpo_config(None, [f"model={tiny_chat_model}", f"train.output_dir={tmp_path}", "grpo.num_generations=8",
                                  "grpo.max_new_tokens=8", "grpo.rewards=[test_learning:short_reward]",
                                  "train.lr=3e-2", "train.max_steps=10", *COMMON])
    run = build_run(cfg)
    run.train()
    rewards = [r["reward_mean"] for r in run.hook.history]
    change = _change(rewards)
    if sign > 0:
        assert change > 0.04, rewards
    else:
        assert change < -0.04, rewards


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["advantage", "flipped_advantage"])
def test_ppo_raises_the_reward_and_a_flipped_sign_lowers_it(tiny_chat_model, tmp_path, monkeypatch, sign):
    from apps.chat_rlhf.ppo import load_ppo_config, train_ppo
    original = L.gae

    def gae(*a, **k):
        adv, returns = original(*a, **k)
        return sign * adv, returns  # the critic still learns the true returns
    monkeypatch.setattr(L, "gae", gae)
    cfg = load_ppo_config(None, [f"model={tiny_chat_model}", f"train.output_dir={tmp_path}", "ppo.num_generations=8",
                                 "ppo.max_new_tokens=8", "ppo.rewards=[test_learning:short_reward]",
                                 "ppo.score_baseline=prompt", "ppo.kl_coef=0", "ppo.kl_target=null",
                                 "ppo.ppo_epochs=1", "ppo.num_mini_batches=1", "train.lr=3e-2",
                                 "train.max_steps=10", *COMMON])
    _, hook = train_ppo(cfg)
    rewards = [r["reward_mean"] for r in hook.history if "reward_mean" in r]
    change = _change(rewards)
    if sign > 0:
        assert change > 0.04, rewards
    else:
        assert change < -0.04, rewards
