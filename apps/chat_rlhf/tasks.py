"""The demo's verifiable task: small-number arithmetic, generated from a seed.

Why this task: GSM8K is out of reach for a 135M model within minutes, but SmolLM2-135M-Instruct
knows sums and differences of numbers up to 20; what it does not do is *answer*: asked
"What is 7 + 12?" it mostly echoes the question or rambles ("To add 7 and 12, we …") and runs out
of tokens before the result (measured: 3% correct within 8 tokens greedy). The reward (first
number of the reply equals the result) is exact, so accuracy cannot be gamed, and GRPO can move
it within a few dozen steps. Train and held-out problems come from different seeds and are
disjoint. Records are the "prompt" kind of `apps.chat_rlhf.data`: {"prompt": messages,
"ground_truth": str}.
"""
from __future__ import annotations

import random

INSTRUCTION = "Reply with the number only."


def arithmetic_problem(rng: random.Random, max_operand: int = 20) -> tuple[str, int]:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def arithmetic_records(n: int, seed: int, *, max_operand: int = 20, exclude: set[str] | None = None) -> list[dict]:
    """n distinct problems (no question of `exclude`), as prompt records with a ground truth."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    records: list[dict] = []
    limit = 50 * n + 1000
    while len(records) < n:
        limit -= 1
        if limit < 0:
            raise ValueError(f"cannot draw {n} distinct problems with operands up to {max_operand}; lower n")
        question, answer = arithmetic_problem(rng, max_operand)
        if question in seen:
            continue
        seen.add(question)
        records.append({"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                        "ground_truth": str(answer)})
    return records


def train_and_heldout(n_train: int, n_heldout: int, seed: int = 0, max_operand: int = 20
                      ) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets (held-out drawn first, so its problems never change with n_train)."""
    heldout = arithmetic_records(n_heldout, seed + 1_000_003, max_operand=max_operand)
    train = arithmetic_records(n_train, seed, max_operand=max_operand,
                               exclude={r["prompt"][0]["content"].removesuffix(" " + INSTRUCTION) for r in heldout})
    return train, heldout
