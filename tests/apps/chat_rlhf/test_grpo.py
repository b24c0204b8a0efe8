"""The GRPO trainer end to end on a tiny model: learning signal flows, resume replays exactly,
bad inputs stop before work, and the stale-weight guard fires."""
import json
import math

import pytest
import torch

from apps.chat_rlhf.grpo import build_run, load_grpo_config, overlong_shaping, sample_seed
from apps.chat_rlhf.stats import wilson_interval
from apps.chat_rlhf.rollout import PromptTooLongError, StaleWeightsError, completion_batch


def short_reward(*, completions, **_):
    """A reward with spread between samples: short replies (that GRPO and PPO raise such a reward,
    and lower it with the advantage's sign flipped, is asserted in test_learning.py)."""
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


def test_engine_mismatch_is_corrected_by_truncated_importance_weights(tiny_chat_model, tmp_path):
    """The old policy is the trainer's forward (ratio 1); an engine whose log-probs are off by a
    constant d gets every token weighted by exp(d), capped at tis_cap: the first step's gradient
    (norm before clipping) scales by exactly that, and the mismatch and the capped share are logged."""
    import dataclasses
    losses = {}
    for shift in (0.0, 0.1, 1.0):
        run = build_run(_cfg(tiny_chat_model, tmp_path / str(shift), "train.max_steps=1", "grpo.tis_cap=2.0",
                             "grpo.max_logprob_gap=5"))
        sample = run.loss.rollout_fn

        def shifted(indices, step, sample=sample, shift=shift):
            r = sample(indices, step)
            return dataclasses.replace(r, engine_logprobs=[[x - shift for x in lp] for lp in r.engine_logprobs])
        run.loss.rollout_fn = shifted
        run.train()
        losses[shift] = json.loads((tmp_path / str(shift) / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"]
        record = run.hook.history[0]
        assert record["logprob_gap"] == pytest.approx(shift, abs=1e-4)
        assert record["tis_weight"] == pytest.approx(min(math.exp(shift), 2.0), rel=1e-4)
        assert record["tis_capped_frac"] == (1.0 if shift == 1.0 else 0.0)
        assert record["clip_frac_low"] == record["clip_frac_high"] == 0.0  # ratio 1: nothing to clip
    assert losses[0.0] > 1e-3
    assert losses[0.1] == pytest.approx(math.exp(0.1) * losses[0.0], rel=1e-4)
    assert losses[1.0] == pytest.approx(2.0 * losses[0.0], rel=1e-4)


def spread_on_subtraction(*, prompts, completions, **_):
    """No spread on addition prompts (every sample scores 1), length-dependent on subtraction ones."""
    return [1.0 if "+" in p[-1]["content"] else float(len(c) % 3) for p, c in zip(prompts, completions)]


def test_dynamic_sampling_refills_the_batch(tiny_chat_model, tmp_path, monkeypatch):
    """Groups without reward spread are replaced by newly drawn prompts until the batch is full: the
    loss sees only groups with spread, the batch keeps its size, the refills are logged; without
    dynamic sampling the zero-spread groups stay in the batch."""
    from apps.chat_rlhf import rl_losses as L
    from apps.chat_rlhf.grpo import refill_prompts
    shapes = []
    original_advantages = L.group_advantages

    def advantages(rewards, **kw):
        shapes.append(tuple(rewards.shape))
        return original_advantages(rewards, **kw)
    monkeypatch.setattr(L, "group_advantages", advantages)
    seen = {}
    for dynamic in (False, True):
        run = build_run(_cfg(tiny_chat_model, tmp_path / str(dynamic), "train.max_steps=3",
                             "grpo.rewards=[test_grpo:spread_on_subtraction]", f"grpo.dynamic_sampling={dynamic}",
                             "train.micro_batch_size=4"))
        sizes = []
        original = run.loss.score

        def score(indices, rollout, original=original):
            sizes.append(len(indices))
            return original(indices, rollout)
        run.loss.score = score
        run.train()
        seen[dynamic] = (run.hook.history, sizes)
    plain, dynamic = seen[False][0], seen[True][0]
    assert sum(r["zero_spread_frac"] for r in plain) > 0  # addition prompts: no spread, kept
    assert all(r["zero_spread_frac"] == 0.0 for r in dynamic)  # replaced by prompts with spread
    assert sum(r["refilled_groups"] for r in dynamic) > 0 and all(r["refilled_groups"] == 0 for r in plain)
    assert shapes == [(4, 4)] * 6  # every step's loss saw a full batch of 4 groups x 4 samples
    assert seen[True][1][0] == 4 and len(seen[True][1]) > 3  # the batch's draw, then refill draws
    drawn = refill_prompts(0, 1, 0, 0, 16, {1, 2, 3}, 5)
    assert drawn == refill_prompts(0, 1, 0, 0, 16, {1, 2, 3}, 5) and len(drawn) == 5 and not {1, 2, 3} & set(drawn)
