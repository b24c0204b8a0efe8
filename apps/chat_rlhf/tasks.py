"""The demo's verifiable tasks, generated from a seed: number comparison (the demo's) and small arithmetic.

Why comparison for the demo (measured greedy through our engine on SmolLM2-135M-Instruct, the
default system prompt, `numeric_first` reward = the first number of the reply must be the answer;
the numbers are in apps/chat_rlhf/README.md): asked "Which number is larger, 63 or 22? Reply with
the number only." the model mostly does not *answer*: it opens with
"To determine which number is larger, …" and runs out of tokens, so it starts at 10-17% correct
within 6 tokens (greedy), and ~45% of sampled groups of 8 hold both a right and a wrong reply,
which is the spread GRPO needs. What it has to learn is a format (answer first, briefly), which
GRPO teaches within a dozen small steps. A reply that is one of the two numbers but the wrong one
scores 0, yet a format-only policy that picks blindly sits near 50%: the measured run ends at 52%
with every reply opening with a number, i.e. the format was learned, skill above chance is not
shown (README: "What it learned"). Three numbers per question would lower chance to 33%.

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
from typing import Callable

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


# task name -> problem generator (rng, max_operand) -> (question, answer)
TASKS: dict[str, Callable[[random.Random, int], tuple[str, int]]] = {"compare": comparison_problem,
                                                                     "arithmetic": arithmetic_problem}


def task_records(n: int, seed: int, *, task: str = "arithmetic", max_operand: int = 20,
                 exclude: set[str] | None = None) -> list[dict]:
    """n distinct problems (no question of `exclude`), as prompt records with a ground truth."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not generated here: choose one of {', '.join(TASKS)}")
    make = TASKS[task]
    if task == "compare" and max_operand < 2:
        raise ValueError(f"max_operand={max_operand}: comparison needs two distinct numbers, so at least 2")
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


def train_and_heldout(n_train: int, n_heldout: int, seed: int = 0, max_operand: int = 20, task: str = "arithmetic"
                      ) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets (held-out drawn first, so its problems never change with n_train)."""
    heldout = task_records(n_heldout, seed + 1_000_003, task=task, max_operand=max_operand)
    train = task_records(n_train, seed, task=task, max_operand=max_operand,
                         exclude={question_of(r) for r in heldout})
    return train, heldout
