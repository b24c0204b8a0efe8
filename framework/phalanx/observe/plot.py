"""The loss curve as a PNG, drawn from the metrics JSONL (so it covers resumed runs too).

matplotlib is imported here, lazily, with the non-interactive Agg backend: nothing opens a
window and nothing needs a display.
"""
from __future__ import annotations

from pathlib import Path

from phalanx.observe.metrics import read_metrics


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str | None = None) -> Path | None:
    """Plot training loss (and any `eval/*loss*` series) against step; None if nothing to plot."""
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    evals: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("eval/") and "loss" in key and isinstance(value, (int, float)):
                evals.setdefault(key, []).append((r["step"], value))
    if not train and not evals:
        return None

    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    for key, points in sorted(evals.items()):
        ax.plot(*zip(*points), marker="o", linestyle="--", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
