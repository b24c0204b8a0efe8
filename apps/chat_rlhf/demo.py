"""The chat_rlhf demo: GRPO teaches SmolLM2-135M-Instruct to pick the largest of four numbers.

    python -m apps.chat_rlhf.demo                       # minutes on 2 quiet CPU cores (README: measured)
    python -m apps.chat_rlhf.demo train.max_steps=10    # any key=value override of configs/demo.yaml

"Which number is the largest: 63, 22, 87 or 41? Reply with the number only." A policy that has
learned only the answer format (reply with one of the four numbers, picked blindly) is right 1 time
in 4: that chance level is printed next to the result, with the accuracy of the best fixed-position
shortcut ("always the first number") on the same problems. Prints, before and after training,
greedy held-out accuracy (problems never trained on) with its 95% Wilson interval, the share of
answers in format (the first number of the reply is one of the question's) and the accuracy among
those; writes `demo_result.json` and `rl_curves.png` into the output directory. The target (issue
37): accuracy at least 25 points above the chance level, the interval's lower end above it.
Why this task, and what the model does before training: see `apps/chat_rlhf/tasks.py`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "demo.yaml"
TARGET_MARGIN = 0.25  # accuracy above the format-only chance level the demo must reach


def score_replies(records: list[dict], replies: list[str]) -> dict:
    """Accuracy (with its 95% Wilson interval), answers in format, and correct among those, of one
    reply per multiple-choice record (`tasks.grade_choice`)."""
    from .stats import wilson_interval
    from .tasks import grade_choice
    if len(records) != len(replies) or not records:
        raise ValueError(f"{len(replies)} replies for {len(records)} records: one reply per record, at least one")
    grades = [grade_choice(r, t) for r, t in zip(records, replies)]
    n, in_format, correct = len(grades), sum(f for f, _ in grades), sum(c for _, c in grades)
    return {"n": n, "accuracy": correct / n, "ci95": wilson_interval(correct, n), "in_format": in_format / n,
            "correct_in_format": correct / in_format if in_format else 0.0}


def verdict(after: dict, chance: float, margin: float = TARGET_MARGIN) -> bool:
    """The target: accuracy >= chance + margin and the interval's lower end above the chance level."""
    return after["accuracy"] >= chance + margin and after["ci95"][0] > chance


def main(argv: list[str] | None = None) -> dict:
    import torch.distributed as dist

    from .grpo import build_run, load_grpo_config, plot_rl_curves
    from .tasks import CHOICE_TASKS, format_only_chance, positional_accuracy

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_grpo_config(str(CONFIG), argv)
    if cfg.data.source not in CHOICE_TASKS:
        raise ValueError(f"data.source={cfg.data.source!r}: the demo scores multiple-choice tasks, whose answer is one "
                         f"of the question's numbers ({', '.join(CHOICE_TASKS)}); train other tasks with "
                         "`python -m apps.chat_rlhf.grpo`")
    t0 = time.perf_counter()
    run = build_run(cfg)
    records = run.heldout_records
    chance, positional = format_only_chance(records), positional_accuracy(records)
    main_rank = not dist.is_initialized() or dist.get_rank() == 0

    def evaluate() -> dict:  # greedy, every held-out problem (each rank the same requests)
        return score_replies(records, run.engine.generate(run.heldout_ids, 1, greedy=True).texts)

    before = evaluate()
    if main_rank:
        print(f"before: {_fmt(before)}", flush=True)
    result = run.train()
    after = evaluate()
    summary = {"task": cfg.data.source, "n": after["n"], "chance": chance, "positional": positional,
               "before": before["accuracy"], "after": after["accuracy"],
               "before_ci95": before["ci95"], "after_ci95": after["ci95"],
               "before_in_format": before["in_format"], "after_in_format": after["in_format"],
               "before_correct_in_format": before["correct_in_format"],
               "after_correct_in_format": after["correct_in_format"],
               "target_met": verdict(after, chance), "steps": result.final_step,
               "wall_s": time.perf_counter() - t0}
    if main_rank:
        png = plot_rl_curves(cfg.train.output_dir)
        out = Path(cfg.train.output_dir)
        (out / "demo_result.json").write_text(json.dumps(summary, indent=1))
        print(f"chance level (format only: one of the question's numbers, picked blindly): {100 * chance:.1f}%; "
              f"always the i-th number: {', '.join(f'{100 * p:.1f}%' for p in positional)}")
        print(f"before: {_fmt(before)}")
        print(f"after:  {_fmt(after)}")
        lo = after["ci95"][0]
        print(f"result: {100 * (after['accuracy'] - chance):+.1f} points above chance (target "
              f"+{100 * TARGET_MARGIN:.0f}, interval's lower end {100 * lo:.1f}% vs chance {100 * chance:.1f}%): "
              f"target {'met' if summary['target_met'] else 'NOT met'}; "
              f"{100 * (after['accuracy'] - before['accuracy']):+.1f} points in training, "
              f"{summary['wall_s'] / 60:.1f} min in all; curves {png}")
    return summary


def _fmt(ev: dict) -> str:
    lo, hi = ev["ci95"]
    return (f"held-out accuracy {100 * ev['accuracy']:.1f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}%, n={ev['n']}); "
            f"answers in format {100 * ev['in_format']:.1f}%; correct among answers in format "
            f"{100 * ev['correct_in_format']:.1f}%")


if __name__ == "__main__":
    main()
