"""The chat_rlhf demo: GRPO teaches SmolLM2-135M-Instruct to answer "Which number is larger, a or b?".

    python -m apps.chat_rlhf.demo                       # minutes on 2 quiet CPU cores (README: measured)
    python -m apps.chat_rlhf.demo train.max_steps=10    # any key=value override of configs/demo.yaml

Prints held-out accuracy (greedy, 200 problems never trained on) before and after, each with its
95% Wilson interval, and the share of replies that open with a number (the format it learns; a
reply that names the wrong one of the two numbers scores 0), and writes `demo_result.json` and
`rl_curves.png` into the output directory.
Why this task, and what the model does before training: see `apps/chat_rlhf/tasks.py`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def main(argv: list[str] | None = None) -> dict:
    import torch.distributed as dist

    from .grpo import build_run, load_grpo_config, plot_rl_curves
    from .stats import wilson_interval

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_grpo_config(str(CONFIG), argv)
    t0 = time.perf_counter()
    run = build_run(cfg)
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    before = run.evaluate()
    if main_rank:
        print(f"before: held-out accuracy {_fmt(before)}", flush=True)
    result = run.train()
    after = result.last_eval or run.evaluate()
    summary = {"before": before["heldout_reward"], "after": after["heldout_reward"], "n": after["heldout_n"],
               "before_ci95": wilson_interval(before["heldout_reward"] * before["heldout_n"], before["heldout_n"]),
               "after_ci95": wilson_interval(after["heldout_reward"] * after["heldout_n"], after["heldout_n"]),
               "before_number_first": before.get("heldout_number_first"),
               "after_number_first": after.get("heldout_number_first"),
               "steps": result.final_step, "wall_s": time.perf_counter() - t0}
    if main_rank:
        png = plot_rl_curves(cfg.train.output_dir)
        out = Path(cfg.train.output_dir)
        (out / "demo_result.json").write_text(json.dumps(summary, indent=1))
        print(f"before: held-out accuracy {_fmt(before)}")
        print(f"after:  held-out accuracy {_fmt(after)}")
        change = 100 * (summary["after"] - summary["before"])
        print(f"change: {change:+.1f} points in {summary['wall_s'] / 60:.1f} min; "
              f"curves {png}")
    return summary


def _fmt(ev: dict) -> str:
    from .stats import wilson_interval
    lo, hi = wilson_interval(ev["heldout_reward"] * ev["heldout_n"], ev["heldout_n"])
    text = f"{100 * ev['heldout_reward']:.1f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}%, n={int(ev['heldout_n'])})"
    if ev.get("heldout_number_first") is not None:
        text += f"; replies that open with a number: {100 * ev['heldout_number_first']:.1f}%"
    return text


if __name__ == "__main__":
    main()
