"""Evaluation and reports of online RL (GRPO and PPO alike): the held-out evaluator, the paired
comparison of the first and last evaluation, and the curves."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .rewards import RewardSet
from .rl_rollouts import DataReplicas
from .rl_step import ROLLOUT_METRICS

HELDOUT_DIR = "heldout"
TRAINED_DIR = "trained"
_NUMBER_FIRST = re.compile(r"\s*-?\d")


def heldout_scores(engine, records: Sequence[dict], prompt_ids: Sequence[list[int]], rewards: RewardSet,
                   output_dir=None, subdir: str = HELDOUT_DIR, prefix: str = "heldout") -> Callable[[Any, int], dict]:
    """eval_fn of GRPO and PPO: greedy answers from the engine (which holds the latest weights)
    scored by the rewards, each data replica (a rank, or a tensor-parallel group) its share. Returns
    the means `{prefix}_reward`, `{prefix}_n`, `{prefix}_len` (completion tokens) and
    `{prefix}_number_first` (the share of replies that open with a number, whatever the number: the
    answer format the demo teaches). With `output_dir`, rank 0 also writes every prompt's score,
    length and text to `<output_dir>/<subdir>/step_N.jsonl` (for `heldout_report`'s paired comparison)."""
    replicas = DataReplicas(engine.tp_size)

    def run(model=None, step: int = 0) -> dict:
        mine = list(range(replicas.rank, len(records), replicas.count))
        rows = []
        if mine:
            out = engine.generate([prompt_ids[i] for i in mine], 1, greedy=True)
            scores, _ = rewards([records[i]["prompt"] for i in mine], out.texts,
                                [records[i].get("ground_truth") for i in mine])
            rows = [{"index": i, "score": float(sc), "length": len(c), "text": t}
                    for i, sc, c, t in zip(mine, scores.tolist(), out.completion_ids, out.texts)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rows)
            rows = {r["index"]: r for part in gathered for r in part}.values()  # tp groups repeat theirs
        rows = sorted(rows, key=lambda r: r["index"])
        if output_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            directory = Path(output_dir) / subdir
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        n = max(len(rows), 1)
        return {f"{prefix}_reward": sum(r["score"] for r in rows) / n, f"{prefix}_n": float(len(rows)),
                f"{prefix}_len": sum(r["length"] for r in rows) / n,
                f"{prefix}_number_first": sum(bool(_NUMBER_FIRST.match(r["text"])) for r in rows) / n}
    return run


def both_evals(heldout, trained):
    """eval_fn scoring the held-out prompts, then (if given) the trained ones; one dict of metrics."""
    def run(model=None, step: int = 0) -> dict:
        out = heldout(model, step) if heldout is not None else {}
        return {**out, **trained(model, step)} if trained is not None else out
    return run


def read_heldout(output_dir, subdir: str = HELDOUT_DIR) -> dict[int, list[dict]]:
    """{step: rows} of every held-out evaluation that `heldout_scores` wrote."""
    directory = Path(output_dir) / subdir
    out = {}
    for path in directory.glob("step_*.jsonl") if directory.is_dir() else []:
        out[int(path.stem.removeprefix("step_"))] = [json.loads(x) for x in path.read_text().splitlines()]
    return dict(sorted(out.items()))


def paired_comparison(before: list[float], after: list[float], resamples: int = 10000, seed: int = 0) -> dict:
    """Mean change of paired scores (after - before, prompt by prompt) with a 95% percentile
    bootstrap interval over prompts, and a two-sided exact sign test (ties dropped)."""
    import math
    if len(before) != len(after) or not before:
        raise ValueError(f"paired comparison needs equal, non-empty lists (got {len(before)} and {len(after)})")
    d = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(len(d), (resamples, len(d)), generator=g)].mean(1)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    k, n = min(wins, losses), wins + losses
    p_sign = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"n": len(d), "mean_before": sum(before) / len(d), "mean_after": sum(after) / len(d),
            "mean_diff": float(d.mean()), "ci95": [float(means.quantile(0.025)), float(means.quantile(0.975))],
            "wins": wins, "losses": losses, "ties": len(d) - n, "sign_test_p": p_sign}


def heldout_report(output_dir, subdir: str = HELDOUT_DIR) -> dict | None:
    """The paired comparison (score and completion length) of the first and the last held-out
    evaluation of a run, written to `heldout_comparison.json` (`trained_comparison.json` for the
    trained prompts' evaluations); None with fewer than two."""
    evals = read_heldout(output_dir, subdir)
    if len(evals) < 2:
        return None
    (first, a), (last, b) = next(iter(evals.items())), list(evals.items())[-1]
    if [r["index"] for r in a] != [r["index"] for r in b]:
        return None
    report = {"from_step": first, "to_step": last,
              "score": paired_comparison([r["score"] for r in a], [r["score"] for r in b]),
              "length": paired_comparison([float(r["length"]) for r in a], [float(r["length"]) for r in b])}
    (Path(output_dir) / f"{subdir}_comparison.json").write_text(json.dumps(report, indent=1))
    return report



def describe(report: dict) -> str:
    """One line for a paired comparison of `heldout_report`."""
    sc, ln = report["score"], report["length"]
    return (f"{sc['n']} prompts, paired: score {sc['mean_before']:.4f} -> {sc['mean_after']:.4f}, change "
            f"{sc['mean_diff']:+.4f} (95% bootstrap {sc['ci95'][0]:+.4f} .. {sc['ci95'][1]:+.4f}), up {sc['wins']} / "
            f"down {sc['losses']} / same {sc['ties']}, sign test p={sc['sign_test_p']:.3g}; length "
            f"{ln['mean_before']:.1f} -> {ln['mean_after']:.1f} tokens")



def plot_rl_curves(output_dir: str | Path, keys: Sequence[str] = ("reward_mean", "kl", "logprob_gap")) -> Path | None:
    """loss (from fit's metrics.jsonl) and the rollout metrics against step, one panel each."""
    from phalanx.observe import read_metrics
    output_dir = Path(output_dir)
    rl = read_metrics(output_dir / ROLLOUT_METRICS) if (output_dir / ROLLOUT_METRICS).exists() else []
    fit_m = read_metrics(output_dir / "metrics.jsonl") if (output_dir / "metrics.jsonl").exists() else []
    series = {"loss": [(r["step"], r["loss"]) for r in fit_m if isinstance(r.get("loss"), (int, float))]}
    for key in keys:
        series[key] = [(r["step"], r[key]) for r in rl if isinstance(r.get(key), (int, float))]
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), dpi=110)
    for ax, (key, pts) in zip(axes if len(series) > 1 else [axes], series.items()):
        ax.plot(*zip(*pts), linewidth=1.2)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = output_dir / "rl_curves.png"
    fig.savefig(path)
    plt.close(fig)
    return path



def plot_ppo(output_dir) -> Path | None:
    """`ppo_curves.png`: reward-model score (rollout samples; greedy answers to the held-out and,
    with eval_trained_prompts, the trained-on prompts), KL to the reference per token, and
    completion length, against the step."""
    from phalanx.observe import read_metrics

    output_dir = Path(output_dir)
    rl = read_metrics(output_dir / ROLLOUT_METRICS) if (output_dir / ROLLOUT_METRICS).exists() else []
    rl = [r for r in rl if "reward_mean" in r]
    evals = read_heldout(output_dir)
    if not rl and not evals:
        return None
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4), dpi=110)
    trained = read_heldout(output_dir, TRAINED_DIR)
    for ax, key, held_key, title in ((axes[0], "reward_mean", "score", "reward-model score"),
                                     (axes[1], "kl", None, "KL to reference (per token)"),
                                     (axes[2], "completion_len", "length", "completion length (tokens)")):
        if rl:
            ax.plot([r["step"] for r in rl], [r[key] for r in rl], linewidth=1, alpha=0.6, label="rollout samples")
        for runs, label in ((evals, "held-out, greedy"), (trained, "trained-on prompts, greedy")):
            if held_key and runs:
                ax.plot(list(runs), [sum(r[held_key] for r in rows) / max(len(rows), 1) for rows in runs.values()],
                        "o-", linewidth=1.5, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = output_dir / "ppo_curves.png"
    fig.savefig(path)
    plt.close(fig)
    return path


