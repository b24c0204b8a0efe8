"""The demo's verifiable tasks, generated from a seed: the largest of four numbers (the demo's),
two-number comparison, and small arithmetic.

Why "largest" for the demo: "Which number is the largest: 63, 22, 87 or 41? Reply with the number
only." (four distinct two-digit numbers, random order) has a chance level a format-only policy
cannot beat: naming one of the four blindly is right 1 time in 4 (`format_only_chance`), and each
fixed-position shortcut scores 22.5-28% on the held-out set (`positional_accuracy`). Greedy
through our engine (bf16, the default system prompt) SmolLM2-135M-Instruct already answers in
format ("The largest number is 98", 7 tokens: digits are one token each) 98% of the time and is
right 42% of the time: it half-solves the task, so what GRPO can add is the skill (which number),
not the format. Sampled at temperature 1 its replies ramble (3% right within 8 tokens, 3 groups
in 4 without spread); at 0.7 they stay near the greedy policy (README: the measured run).

Why not two-number comparison any more ("Which number is larger, 63 or 22?", `compare`): the model
mostly does not *answer* ("To determine which number is larger, …"), so GRPO teaches the format,
and a policy that opens with one of the two numbers at random scores 50%: the old demo went 16.5%
-> 51% with every reply opening with a number, i.e. the format was learned, not skill above chance.

Why not arithmetic for the demo: single-digit sums are right 85% of the time when the model may
echo "5 + 6 = 11" first, but 0-5% as a first number and ~1% when sampled (only 10% of groups
have any spread): answering directly is a skill it lacks, not a format. Sums and differences up
to 20 are worse (19% within 8 tokens even counting the last number). The arithmetic set stays
available (`data.source: arithmetic`, configs/grpo_arithmetic.yaml) for larger policies.

Train and held-out problems come from different seeds and are disjoint. Records are the "prompt"
kind of `apps.chat_rlhf.data`: {"prompt": messages, "ground_truth": str}.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Sequence

INSTRUCTION = "Reply with the number only."


def arithmetic_problem(rng: random.Random, max_operand: int = 20) -> tuple[str, int]:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def comparison_problem(rng: random.Random, max_operand: int = 99) -> tuple[str, int]:
    """Two distinct numbers in 1..max_operand, in random order; the answer is the larger."""
    a = rng.randint(1, max_operand)
    b = rng.randint(1, max_operand - 1)
    b = b + 1 if b >= a else b  # uniform over the others: never equal to a
    return f"Which number is larger, {a} or {b}?", max(a, b)


LARGEST_OF = 4      # numbers per "largest" question: a policy that names one of them blindly is right 1 in 4
LARGEST_FLOOR = 10  # all two-digit: the digit count gives nothing away, the tens and units decide


def largest_problem(rng: random.Random, max_operand: int = 99) -> tuple[str, int]:
    """LARGEST_OF distinct numbers in LARGEST_FLOOR..max_operand, in random order; the answer is the largest."""
    if max_operand - LARGEST_FLOOR + 1 < LARGEST_OF:
        raise ValueError(f"max_operand={max_operand}: the largest task needs {LARGEST_OF} distinct numbers from "
                         f"{LARGEST_FLOOR}, so max_operand >= {LARGEST_FLOOR + LARGEST_OF - 1}")
    xs = rng.sample(range(LARGEST_FLOOR, max_operand + 1), LARGEST_OF)
    return f"Which number is the largest: {', '.join(map(str, xs[:-1]))} or {xs[-1]}?", max(xs)


# task name -> problem generator (rng, max_operand) -> (question, answer)
TASKS: dict[str, Callable[[random.Random, int], tuple[str, int]]] = {"compare": comparison_problem,
                                                                     "arithmetic": arithmetic_problem,
                                                                     "largest": largest_problem}
# tasks whose answer is one of the numbers of the question (multiple choice): they have a format-only chance level
CHOICE_TASKS = ("compare", "largest")


def task_records(n: int, seed: int, *, task: str = "arithmetic", max_operand: int = 20,
                 exclude: set[str] | None = None) -> list[dict]:
    """n distinct problems (no question of `exclude`), as prompt records with a ground truth."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not generated here: choose one of {', '.join(TASKS)}")
    make = TASKS[task]
    if task == "compare" and max_operand < 2:
        raise ValueError(f"max_operand={max_operand}: comparison needs two distinct numbers, so at least 2")
    make(random.Random(0), max_operand)  # a bad max_operand fails here, with its reason, before any loop
    rng = random.Random(seed)
    seen = set(exclude or ())
    records: list[dict] = []
    limit = 50 * n + 1000
    while len(records) < n:
        limit -= 1
        if limit < 0:
            raise ValueError(f"cannot draw {n} distinct {task} problems with operands up to {max_operand}; "
                             "lower n or raise max_operand")
        question, answer = make(rng, max_operand)
        if question in seen:
            continue
        seen.add(question)
        records.append({"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                        "ground_truth": str(answer)})
    return records


def arithmetic_records(n: int, seed: int, *, max_operand: int = 20, exclude: set[str] | None = None) -> list[dict]:
    return task_records(n, seed, task="arithmetic", max_operand=max_operand, exclude=exclude)


def question_of(record: dict) -> str:
    return record["prompt"][-1]["content"].removesuffix(" " + INSTRUCTION)


_INT = re.compile(r"-?\d+")


def choices_of(record: dict) -> list[int]:
    """The candidate answers of a multiple-choice record: the distinct numbers of its question, in order."""
    return list(dict.fromkeys(int(x) for x in _INT.findall(question_of(record))))


def grade_choice(record: dict, reply: str) -> tuple[bool, bool]:
    """(in format, correct) of a reply to a multiple-choice record: in format when the reply's first
    number is one of the question's numbers, correct when it is the answer (`numeric_first`'s reward)."""
    from .rewards import first_number
    picked = first_number(reply)
    if picked is None:
        return False, False
    return picked in choices_of(record), picked == float(record["ground_truth"])


def format_only_chance(records: Sequence[dict]) -> float:
    """Expected accuracy of a policy that always answers in format but picks one of the question's numbers
    uniformly at random: the mean over problems of 1 / (number of choices)."""
    if not records:
        raise ValueError("format_only_chance of no records")
    return sum(1 / len(choices_of(r)) for r in records) / len(records)


def positional_accuracy(records: Sequence[dict]) -> list[float]:
    """Accuracy of each fixed-position policy ("always name the i-th number of the question") on these
    records: a format-only shortcut the random order of the numbers must keep near the chance level."""
    k = min(len(choices_of(r)) for r in records)
    return [sum(str(choices_of(r)[i]) == r["ground_truth"] for r in records) / len(records) for i in range(k)]


def train_and_heldout(n_train: int, n_heldout: int, seed: int = 0, max_operand: int = 20, task: str = "arithmetic"
                      ) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets (held-out drawn first, so its problems never change with n_train)."""
    heldout = task_records(n_heldout, seed + 1_000_003, task=task, max_operand=max_operand)
    train = task_records(n_train, seed, task=task, max_operand=max_operand,
                         exclude={question_of(r) for r in heldout})
    return train, heldout
