"""GRPO with `ppo_epochs` x `mini_batches` > 1: one rollout serves several optimizer steps, the
ratio against the rollout-time log-probs leaves 1 after the first mini-batch and the clip acts."""
import pytest

from apps.chat_rlhf.grpo import build_run, load_grpo_config


def length_reward(*, completions, **_):
    return [float(len(c)) for c in completions]


def _cfg(model, out, *extra):
    return load_grpo_config(None, [f"model={model}", "data.num_train=16", "data.num_heldout=0",
                                   "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                   "grpo.rewards=[test_grpo_epochs:length_reward]", "train.micro_batch_size=2",
                                   f"train.output_dir={out}", "train.min_lr_ratio=1.0", "engine.max_model_len=96",
                                   "train.progress_bar=false", "train.plot=false", "train.resume=false", *extra])


def test_one_rollout_serves_every_mini_batch_step_and_the_clip_acts(tiny_chat_model, tmp_path):
    run = build_run(_cfg(tiny_chat_model, tmp_path, "train.max_steps=4", "grpo.ppo_epochs=2", "grpo.mini_batches=2",
                         "train.lr=0.05", "grpo.kl_coef=0.1", "grpo.clip_low=0.05", "grpo.clip_high=0.05"))
    sample, calls = run.loss.rollout_fn, []

    def counting(indices, step):
        calls.append((list(indices), step))
        return sample(indices, step)

    run.loss.rollout_fn = counting
    run.train()
    history = run.hook.history
    assert [c[1] for c in calls] == [1]  # one rollout (at step 1) for the 2 x 2 steps
    assert [r["new_rollout"] for r in history] == [True, False, False, False]
    assert "reward_mean" in history[0] and "reward_mean" not in history[1]
    # The first mini-batch is scored by the weights that sampled: ratio 1, nothing clipped.
    assert history[0]["clip_frac_low"] == 0 and history[0]["clip_frac_high"] == 0
    # After updates the ratio has moved past the +-0.05 bounds on some tokens.
    assert sum(r["clip_frac_low"] + r["clip_frac_high"] for r in history[1:]) > 0
    assert len(run.loss.buffer["rows"]["adv"]) == 2 * 4  # 2 prompts x 4 samples, split into 2 mini-batches


def test_bad_split_is_named():
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="does not divide"):
        load_grpo_config(None, ["grpo.num_generations=3", "train.micro_batch_size=1", "grpo.mini_batches=2"])
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        load_grpo_config(None, ["grpo.ppo_epochs=2", "train.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match="mini_batches"):
        load_grpo_config(None, ["grpo.mini_batches=0"])
