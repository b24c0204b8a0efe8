"""Built-in verifiers, reward-model scoring, and the errors of a broken user reward."""
import sys
import types

import pytest
import torch

from apps.chat_rlhf.rewards import (RewardError, RewardModelScorer, RewardSet, extract_answer, format_tags, numeric,
                                    numeric_first, resolve_reward)


def test_numeric_extraction_gsm8k_style():
    assert extract_answer("She pays 3 * 4 = 12 dollars.\n#### 1,200") == 1200
    assert extract_answer("so the answer is \\boxed{42}.") == 42
    assert extract_answer("<answer> -7 </answer>") == -7
    assert extract_answer("first 3 then 4.5") == 4.5
    assert extract_answer("no digits") is None
    truths = ["Natalia sold 48/2 = 24 clips.\n#### 72", "72", "5"]
    assert numeric(completions=["#### 72", "It is 72.", "5 apples, 6 pears"], ground_truth=truths) == [1.0, 1.0, 0.0]
    assert numeric_first(completions=["27", "13 + 14 = 27", "The sum is 27."], ground_truth=["27"] * 3) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="ground truth"):
        numeric(completions=["1"], ground_truth=[None])


def test_exact_and_format():
    assert resolve_reward("exact")(completions=[" Paris ", "paris!"], ground_truth=["paris", "Paris"]) == [1.0, 0.0]
    assert format_tags(completions=["<think>a</think><answer>1</answer>", "<answer>1</answer>"]) == [1.0, 0.0]


@pytest.fixture
def user_rewards(monkeypatch):
    mod = types.ModuleType("user_rewards_mod")
    mod.length = lambda *, completions, **_: [float(len(c)) for c in completions]
    mod.boom = lambda **_: 1 / 0
    mod.short = lambda *, completions, **_: [1.0] * (len(completions) - 1)
    mod.nan = lambda *, completions, **_: [float("nan")] * len(completions)
    mod.text = lambda *, completions, **_: ["a"] * len(completions)
    monkeypatch.setitem(sys.modules, "user_rewards_mod", mod)
    return mod


def test_user_function_and_weights(user_rewards):
    rs = RewardSet.from_specs(["user_rewards_mod:length", "exact"], [0.5, 2.0])
    total, parts = rs([[{"role": "user", "content": "q"}]] * 2, ["ab", "x"], ["x", "x"])
    assert torch.allclose(total, torch.tensor([1.0, 0.5 + 2.0]))
    assert set(parts) == {"user_rewards_mod:length", "exact"}


@pytest.mark.parametrize("name,match", [("boom", "raised ZeroDivisionError"), ("short", "shape"),
                                        ("nan", "non-finite"), ("text", "not a list of numbers")])
def test_broken_user_reward_is_named(user_rewards, name, match):
    rs = RewardSet.from_specs([f"user_rewards_mod:{name}"])
    with pytest.raises(RewardError, match=match) as info:
        rs([[]] * 3, ["a", "b", "c"], [None] * 3)
    assert f"user_rewards_mod:{name}" in str(info.value)


def test_unknown_rewards_fail_before_training(user_rewards):
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nonsense")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no function"):
        resolve_reward("user_rewards_mod:missing")
    with pytest.raises(ValueError, match="reward_weights"):
        RewardSet.from_specs(["exact"], [1.0, 2.0])
    with pytest.raises(FileNotFoundError, match="reward model"):
        resolve_reward("rm:/nonexistent/dir")


def test_reward_model_scores_chat(tiny_chat_model, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    config = AutoConfig.from_pretrained(str(tiny_chat_model), num_labels=1)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(config)
    rm.save_pretrained(str(tmp_path / "rm"))
    AutoTokenizer.from_pretrained(str(tiny_chat_model)).save_pretrained(str(tmp_path / "rm"))
    scorer = resolve_reward(f"rm:{tmp_path / 'rm'}")
    assert isinstance(scorer, RewardModelScorer)
    prompts = [[{"role": "user", "content": "hello"}]] * 3
    scores = scorer(prompts=prompts, completions=["hi there", "go away", "hi there"])
    assert len(scores) == 3 and scores[0] == pytest.approx(scores[2], abs=1e-5) and scores[0] != scores[1]
