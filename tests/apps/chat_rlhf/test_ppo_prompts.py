"""PPO's prompts: the prompt-length filter (data.max_prompt_tokens), the rollout prompt schedule
(every prompt once per pass, not 1/K of them), score standardisation, and the held-out paired
comparison the command reports."""
from __future__ import annotations

import logging

import pytest
import torch

from apps.chat_rlhf.data import drop_long_prompts
from apps.chat_rlhf.ppo import (PPODataSettings, heldout_report, load_ppo_config, load_ppo_prompts, paired_comparison,
                                plot_ppo, rollout_prompts, standardize_over_ranks, train_ppo)
from conftest import HH
from phalanx.config import ConfigError


def test_drop_long_prompts_keeps_order_and_counts():
    records = [{"prompt": i} for i in range(5)]
    ids = [[1] * n for n in (3, 9, 4, 10, 4)]
    kept, kept_ids, dropped = drop_long_prompts(records, ids, 4)
    assert [r["prompt"] for r in kept] == [0, 2, 4] and [len(x) for x in kept_ids] == [3, 4, 4] and dropped == 2
    with pytest.raises(ConfigError, match="max_prompt_tokens=0"):
        drop_long_prompts(records, ids, 0)


def test_max_prompt_tokens_filters_before_the_split(tiny_chat_model, caplog):
    from apps.chat_rlhf.models import load_tokenizer
    tokenizer = load_tokenizer(str(tiny_chat_model))
    base = dict(source=str(HH), kind="preference", num_train=40, num_heldout=10)
    train0, held0, train_ids0, held_ids0 = load_ppo_prompts(PPODataSettings(**base), tokenizer)
    assert (len(train0), len(held0)) == (40, 10) and max(map(len, train_ids0 + held_ids0)) > 100
    with caplog.at_level(logging.INFO):
        train, held, train_ids, held_ids = load_ppo_prompts(PPODataSettings(**base, max_prompt_tokens=100), tokenizer,
                                                            logging.getLogger("test"))
    # the counts hold after dropping, every prompt fits, and held-out prompts are not trained on
    assert (len(train), len(held)) == (40, 10) and max(map(len, train_ids + held_ids)) <= 100
    assert not {str(r["prompt"]) for r in train} & {str(r["prompt"]) for r in held}
    kept = [r for r, ids in zip(train0 + held0, train_ids0 + held_ids0, strict=True) if len(ids) <= 100]
    assert train[:len(kept)] == kept[:40]  # the same prompts in file order, the long ones skipped
    assert "dropped" in caplog.text
    # a bound above the longest prompt changes nothing
    assert load_ppo_prompts(PPODataSettings(**base, max_prompt_tokens=100000), tokenizer)[:2] == (train0, held0)
    with pytest.raises(ConfigError, match="max_prompt_tokens=5 leaves 0 prompts"):
        load_ppo_prompts(PPODataSettings(**base, max_prompt_tokens=5), tokenizer)


def test_rollout_prompts_use_every_prompt_once_per_pass():
    n, per_rank = 10, 2
    one = [rollout_prompts(3, r, n, per_rank) for r in range(5)]   # a pass = 10 // 2 = 5 rollouts
    assert sorted(sum(one, [])) == list(range(10))
    assert rollout_prompts(3, 5, n, per_rank) != one[0] or rollout_prompts(3, 6, n, per_rank) != one[1]  # new pass
    assert rollout_prompts(3, 2, n, per_rank) == one[2]  # a function of (seed, rollout): resumes replay it
    # 2 ranks: disjoint shares, together the one-process rollout of twice the size, strided as fit shards
    for r in range(2):
        a, b = rollout_prompts(3, r, n, per_rank, 0, 2), rollout_prompts(3, r, n, per_rank, 1, 2)
        both = rollout_prompts(3, r, n, 2 * per_rank)
        assert a == both[0::2] and b == both[1::2]
    with pytest.raises(ConfigError, match="cannot fill one rollout"):
        rollout_prompts(0, 0, 3, 2, 0, 2)


def test_ppo_run_uses_every_prompt_and_reports_heldout(tiny_chat_model, tmp_path):
    """4 training prompts, 2 per rollout, a rollout every 4 steps: 8 steps use all 4 prompts (fit's
    batch of the rollout step alone would have used 2 of fit's 8 batches). The held-out evaluations
    keep each prompt's score, and the paired report and plot come out of them."""
    out = tmp_path / "run"
    cfg = load_ppo_config(None, [f"model={tiny_chat_model}", "data.num_train=4", "data.num_heldout=3",
                                 "ppo.num_generations=2", "ppo.max_new_tokens=4", "ppo.rewards=[test_ppo:length_reward]",
                                 "ppo.normalize_scores=true", "train.micro_batch_size=2", "train.max_steps=8",
                                 f"train.output_dir={out}", "train.lr=1e-3", "engine.max_model_len=96",
                                 "train.progress_bar=false", "train.plot=false", "eval_before=true"])
    result, hook = train_ppo(cfg)
    used = hook.loss.rollout_indices
    assert len(used) == 2 and sorted(used[0] + used[1]) == [0, 1, 2, 3]
    report = heldout_report(out)
    assert report is not None and (report["from_step"], report["to_step"]) == (0, 8)
    assert report["score"]["n"] == 3 and report["score"]["mean_after"] == pytest.approx(result.last_eval["heldout_reward"])
    assert (out / "heldout_comparison.json").is_file() and plot_ppo(out).is_file()


def test_standardize_over_ranks():
    x = torch.tensor([1.0, 3.0, -2.0, 6.0])
    y = standardize_over_ranks(x)
    assert float(y.mean()) == pytest.approx(0.0, abs=1e-6) and float(y.std()) == pytest.approx(1.0, abs=1e-6)


def test_paired_comparison():
    r = paired_comparison([0.0] * 10, [1.0] * 9 + [0.0])
    assert (r["wins"], r["losses"], r["ties"]) == (9, 0, 1) and r["sign_test_p"] == pytest.approx(2 / 512)
    assert r["mean_diff"] == pytest.approx(0.9) and r["ci95"][0] <= 0.9 <= r["ci95"][1] and r["ci95"][0] > 0.5
    even = paired_comparison([0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0])
    assert even["sign_test_p"] == pytest.approx(1.0) and even["mean_diff"] == 0.0
    with pytest.raises(ValueError, match="equal"):
        paired_comparison([1.0], [])
