"""The GRPO trainer end to end on a tiny model: learning signal flows, resume replays exactly,
bad inputs stop before work, and the stale-weight guard fires."""
import json

import pytest
import torch

from apps.chat_rlhf.grpo import build_run, load_grpo_config, overlong_shaping, sample_seed
from apps.chat_rlhf.stats import wilson_interval
from apps.chat_rlhf.rollout import PromptTooLongError, StaleWeightsError, completion_batch


def short_reward(*, completions, **_):
    """A reward a random tiny model can improve on: short replies."""
    return [1.0 if len(c) < 12 else 0.0 for c in completions]


def _cfg(model, out, *extra):
    return load_grpo_config(None, [f"model={model}", "data.num_train=16", "data.num_heldout=4",
                                   "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                   "grpo.rewards=[test_grpo:short_reward]", "train.micro_batch_size=2",
                                   f"train.output_dir={out}", "train.lr=1e-3", "train.min_lr_ratio=1.0",
                                   "engine.max_model_len=96", "train.progress_bar=false", "train.plot=false",
                                   *extra])


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _rewards(out):
    return [json.loads(line)["reward_mean"] for line in (out / "rollouts.jsonl").read_text().splitlines()]


def test_resume_continues_identically(tiny_chat_model, tmp_path):
    full = build_run(_cfg(tiny_chat_model, tmp_path / "a", "train.max_steps=4", "grpo.kl_coef=0.05",
                          "grpo.kl_target=0.01", "grpo.kl_horizon=10"))
    full.train()
    first = build_run(_cfg(tiny_chat_model, tmp_path / "b", "train.max_steps=2", "grpo.kl_coef=0.05",
                           "grpo.kl_target=0.01", "grpo.kl_horizon=10"))
    first.train()
    second = build_run(_cfg(tiny_chat_model, tmp_path / "b", "train.max_steps=4", "grpo.kl_coef=0.05",
                            "grpo.kl_target=0.01", "grpo.kl_horizon=10"))
    second.train()
    assert _rewards(tmp_path / "a") == _rewards(tmp_path / "b")
    assert second.loss.kl.value == full.loss.kl.value != 0.05  # the adaptive controller resumed, and moved
    assert torch.equal(_weights(full.model), _weights(second.model))
    history = full.hook.history
    assert all(r["logprob_gap"] < 1e-4 for r in history)  # the engine held the trained weights every step
    assert {"reward_mean", "zero_spread_frac", "entropy", "kl", "clip_frac_high", "time_sync_s",
            "rollout_tokens_per_s"} <= history[0].keys()


def test_prompt_longer_than_engine_limit_fails_before_training(tiny_chat_model, tmp_path):
    with pytest.raises(PromptTooLongError, match="max_model_len=24"):
        build_run(_cfg(tiny_chat_model, tmp_path, "engine.max_model_len=24"))
    assert not (tmp_path / "checkpoints").exists()


def test_stale_weights_stop_the_run(tiny_chat_model, tmp_path):
    run = build_run(_cfg(tiny_chat_model, tmp_path, "train.max_steps=3", "train.lr=3e-2",
                         "grpo.gap_jump=5"))
    run.engine.sync = lambda model: 0.0  # a broken weight sync: the engine keeps the initial weights
    run.hook.engine.sync = run.engine.sync
    with pytest.raises(StaleWeightsError, match="other weights"):
        run.train()


def test_bad_settings_are_named():
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="baseline"):
        load_grpo_config(None, ["grpo.baseline=ppo"])
    with pytest.raises(ConfigError, match="rloo needs"):
        load_grpo_config(None, ["grpo.baseline=rloo", "grpo.num_generations=1"])


def test_helpers():
    b = completion_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    shaped = overlong_shaping(torch.tensor([2, 7, 8, 8]), torch.tensor([False, False, False, True]), 8, 1.0, 2)
    assert shaped.tolist() == [0.0, -0.5, -1.0, -1.0]
    assert sample_seed(0, 3, 5, 1) == sample_seed(0, 3, 5, 1) != sample_seed(0, 3, 5, 2)
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
