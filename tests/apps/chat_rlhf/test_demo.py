"""The demo's task and its command, on a tiny model (the real run is documented in apps/chat_rlhf/README.md)."""
import json
import math
import re

import pytest

from apps.chat_rlhf.rewards import numeric_first
from apps.chat_rlhf.tasks import train_and_heldout


def test_task_is_seeded_disjoint_and_verifiable():
    train, heldout = train_and_heldout(300, 200, seed=0)
    assert (train, heldout) == train_and_heldout(300, 200, seed=0)
    assert len(heldout) == 200 and len({r["prompt"][0]["content"] for r in heldout}) == 200
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in heldout}
    q = heldout[0]["prompt"][0]["content"]
    a, op, b = q.split("?")[0].removeprefix("What is ").split()
    want = int(a) + int(b) if op == "+" else int(a) - int(b)
    assert heldout[0]["ground_truth"] == str(want)
    assert op == "+" or int(a) >= int(b)  # differences are never negative
    assert numeric_first(completions=[str(want), f"{a} {op} {b} = {want}"], ground_truth=[str(want)] * 2)[0] == 1.0


def test_demo_command_runs_and_reports_intervals(tiny_chat_model, tmp_path):
    from apps.chat_rlhf.demo import main
    summary = main([f"model={tiny_chat_model}", "train.max_steps=2", "data.num_train=8", "data.num_heldout=6",
                    "grpo.num_generations=2", "grpo.max_new_tokens=4", "train.micro_batch_size=2", "train_layers=1",
                    f"train.output_dir={tmp_path}", "train.progress_bar=false"])
    saved = json.loads((tmp_path / "demo_result.json").read_text())
    assert saved["n"] == 6 and saved["steps"] == 2
    for when in ("before", "after"):  # k of 6 answers right, and the textbook Wilson interval of k / 6
        k = saved[when] * 6
        assert k == pytest.approx(round(k))
        p, z = round(k) / 6, 1.96
        centre, half = p + z * z / 12, z * math.sqrt(p * (1 - p) / 6 + z * z / 144)
        assert saved[f"{when}_ci95"] == pytest.approx([max(0.0, (centre - half) / (1 + z * z / 6)),
                                                     min(1.0, (centre + half) / (1 + z * z / 6))], abs=1e-9)
    assert (tmp_path / "rl_curves.png").exists() and summary["before"] == saved["before"]
    assert 0.0 <= saved["before_number_first"] <= 1.0 and 0.0 <= saved["after_number_first"] <= 1.0


def test_comparison_task_is_seeded_disjoint_and_checked_by_hand():
    train, heldout = train_and_heldout(300, 200, seed=0, max_operand=99, task="compare")
    assert (train, heldout) == train_and_heldout(300, 200, seed=0, max_operand=99, task="compare")
    questions = [r["prompt"][0]["content"] for r in train + heldout]
    assert len(set(questions)) == 500  # distinct, and none shared between train and held-out
    first_larger = 0
    for r in train + heldout:
        a, b = (int(x) for x in re.fullmatch(r"Which number is larger, (\d+) or (\d+)\? Reply with the number only\.",
                                                r["prompt"][0]["content"]).groups())
        assert a != b and 1 <= min(a, b) and max(a, b) <= 99
        assert r["ground_truth"] == str(max(a, b))
        first_larger += a > b
    assert 200 < first_larger < 300  # the larger number comes first about half the time (no positional shortcut)
    assert numeric_first(completions=["63 is larger", "22", "The larger is 63"], ground_truth=["63"] * 3) == [1.0, 0.0, 1.0]


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="compare, arithmetic"):
        train_and_heldout(10, 10, task="countdown")
