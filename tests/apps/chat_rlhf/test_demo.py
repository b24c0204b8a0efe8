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
    from apps.chat_rlhf.tasks import train_and_heldout
    summary = main([f"model={tiny_chat_model}", "train.max_steps=2", "data.num_train=8", "data.num_heldout=6",
                    "grpo.num_generations=2", "grpo.max_new_tokens=4", "train.micro_batch_size=2", "train_layers=1",
                    f"train.output_dir={tmp_path}", "train.progress_bar=false"])
    saved = json.loads((tmp_path / "demo_result.json").read_text())
    assert saved["n"] == 6 and saved["steps"] == 2 and saved["task"] == "largest"
    for when in ("before", "after"):  # k of 6 answers right, and the textbook Wilson interval of k / 6
        k = saved[when] * 6
        assert k == pytest.approx(round(k))
        p, z = round(k) / 6, 1.96
        centre, half = p + z * z / 12, z * math.sqrt(p * (1 - p) / 6 + z * z / 144)
        assert saved[f"{when}_ci95"] == pytest.approx([max(0.0, (centre - half) / (1 + z * z / 6)),
                                                     min(1.0, (centre + half) / (1 + z * z / 6))], abs=1e-9)
        # correct = in format x correct among those (a correct answer is always in format)
        assert saved[when] == pytest.approx(saved[f"{when}_in_format"] * saved[f"{when}_correct_in_format"])
    # four numbers per question: the format-only chance is 1/4, and the fixed-position policies split
    # the problems between them (each answer sits at exactly one position) -- counted here by hand
    _, heldout = train_and_heldout(8, 6, seed=0, max_operand=99, task="largest")
    by_hand = [sum(re.findall(r"\d+", r["prompt"][0]["content"])[i] == r["ground_truth"] for r in heldout) / 6
               for i in range(4)]
    assert saved["chance"] == 0.25 and saved["positional"] == pytest.approx(by_hand)
    assert sum(by_hand) == pytest.approx(1)
    assert saved["target_met"] is (saved["after"] >= 0.5 and saved["after_ci95"][0] > 0.25)
    assert (tmp_path / "rl_curves.png").exists() and summary["before"] == saved["before"]


def test_demo_refuses_a_task_without_choices_before_loading_anything(tmp_path):
    from apps.chat_rlhf.demo import main
    with pytest.raises(ValueError, match="data.source='arithmetic'.*multiple-choice.*apps.chat_rlhf.grpo"):
        main(["model=/nonexistent", "data.source=arithmetic", f"train.output_dir={tmp_path}"])


LARGEST_Q = "Which number is the largest: 63, 22, 87 or 41? Reply with the number only."


def test_largest_task_is_seeded_disjoint_and_checked_by_hand():
    train, heldout = train_and_heldout(300, 200, seed=0, max_operand=99, task="largest")
    assert (train, heldout) == train_and_heldout(300, 200, seed=0, max_operand=99, task="largest")
    questions = [r["prompt"][0]["content"] for r in train + heldout]
    assert len(set(questions)) == 500  # distinct, and none shared between train and held-out
    position = [0] * 4
    for r in train + heldout:
        xs = [int(x) for x in re.fullmatch(r"Which number is the largest: (\d+), (\d+), (\d+) or (\d+)\? "
                                           r"Reply with the number only\.", r["prompt"][0]["content"]).groups()]
        assert len(set(xs)) == 4 and 10 <= min(xs) and max(xs) <= 99  # two digits each: length tells nothing
        assert r["ground_truth"] == str(max(xs))
        position[xs.index(max(xs))] += 1
    assert all(90 < c < 160 for c in position), position  # the largest is at each place ~1/4 of the time (125)
    with pytest.raises(ValueError, match="max_operand >= 13"):
        train_and_heldout(10, 10, max_operand=12, task="largest")


def test_largest_task_scorer_right_wrong_and_off_format():
    from apps.chat_rlhf.tasks import grade_choice
    record = {"prompt": [{"role": "user", "content": LARGEST_Q}], "ground_truth": "87"}
    replies = ["87", " 87 is the largest.", "63", "41, because", "The largest is 87", "To determine which", "100",
               "8", ""]
    want = [(True, True), (True, True), (True, False), (True, False), (True, True), (False, False), (False, False),
            (False, False), (False, False)]
    assert [grade_choice(record, t) for t in replies] == want
    # "correct" is exactly the reward the demo trains on
    assert numeric_first(completions=replies, ground_truth=["87"] * len(replies)) == [float(c) for _, c in want]


def test_format_only_chance_by_hand_and_by_simulation():
    import random

    from apps.chat_rlhf.tasks import choices_of, format_only_chance, positional_accuracy

    def rec(question, truth):
        return {"prompt": [{"role": "user", "content": f"{question} Reply with the number only."}],
                "ground_truth": truth}
    two = rec("Which number is larger, 5 or 9?", "9")
    four = rec("Which number is the largest: 63, 22, 87 or 41?", "87")
    assert choices_of(four) == [63, 22, 87, 41]
    assert format_only_chance([two, four]) == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert positional_accuracy([two, four]) == [0.0, 0.5]  # 9 is 2nd of two; 87 is 3rd of four (not counted: k=2)
    # a policy that answers in format, picking one of the numbers blindly, scores the chance level
    _, heldout = train_and_heldout(10, 200, seed=0, max_operand=99, task="largest")
    rng, hits, trials = random.Random(1), 0, 0
    for _ in range(100):
        for r in heldout:
            hits += grade_choice_correct(r, str(rng.choice(choices_of(r))))
            trials += 1
    assert format_only_chance(heldout) == 0.25
    assert abs(hits / trials - 0.25) < 0.01  # 20,000 draws: standard error 0.003


def grade_choice_correct(record, reply):
    from apps.chat_rlhf.tasks import grade_choice
    in_format, correct = grade_choice(record, reply)
    assert in_format
    return correct


def test_demo_score_and_target_verdict():
    from apps.chat_rlhf.demo import score_replies, verdict
    record = {"prompt": [{"role": "user", "content": LARGEST_Q}], "ground_truth": "87"}
    ev = score_replies([record] * 4, ["87", "63", "sure", "87!"])
    assert ev["n"] == 4 and ev["accuracy"] == 0.5 and ev["in_format"] == 0.75
    assert ev["correct_in_format"] == pytest.approx(2 / 3)
    assert verdict({"accuracy": 0.51, "ci95": (0.44, 0.58)}, 0.25)
    assert not verdict({"accuracy": 0.49, "ci95": (0.42, 0.56)}, 0.25)  # under chance + 25 points
    assert not verdict({"accuracy": 0.51, "ci95": (0.24, 0.78)}, 0.25)  # interval reaches the chance level
    with pytest.raises(ValueError, match="one reply per record"):
        score_replies([record], [])


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
