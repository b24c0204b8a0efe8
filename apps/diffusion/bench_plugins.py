"""Images/s and peak memory of the default recipe's training on 2 CPU ranks, DDP vs ZeRO-2.

    python -m apps.diffusion.bench_plugins [--steps 15] [--rounds 2] [--plugins ddp zero2]

Each (plugin, round) is a fresh 2-rank group (phalanx.testing.spawn, one thread per rank) that
runs `train_text_to_image.train` on tiny_emoji.yaml for `--steps` steps (no validation images;
rank 0 saves the pipeline after the timed steps), reusing the latent cache of the default run when it exists. Plugins alternate over
the rounds so load changes on a shared machine hit both. Reported: the best round's images/s
(fit's throughput meter, the first step excluded by its window) and each rank's peak resident
memory growth during training. Prints a table and a `BENCH_JSON {...}` line.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from .config import REPO

CONFIG = REPO / "apps" / "diffusion" / "configs" / "tiny_emoji.yaml"
DEFAULT_CACHE = REPO / "runs" / "diffusion" / "tiny_emoji" / "cache"


def _run(plugin: str, steps: int, out_dir: str, cache: str) -> dict:
    """One rank of one measurement (runs inside phalanx.testing.spawn)."""
    import time

    from phalanx.observe import peak_memory_bytes, reset_peak_memory

    from .config import load_recipe
    from .train_text_to_image import train

    cfg = load_recipe(CONFIG, [f"train.output_dir={out_dir}", f"train.plugin={plugin}", f"train.max_steps={steps}",
                               f"data.cache_dir={cache}", "validation.prompts=[]", "train.save_every=0",
                               "train.plot=false", "train.progress_bar=false", f"train.log_every={steps}"])
    cfg.final_dir = str(Path(out_dir) / "pipeline")
    base = peak_memory_bytes()
    reset_peak_memory()
    t0 = time.perf_counter()
    result, _ = train(cfg)
    return {"images_per_s": result.tokens_per_s, "peak_mib": peak_memory_bytes() / 2**20,
            "growth_mib": (peak_memory_bytes() - base) / 2**20, "wall_s": time.perf_counter() - t0,
            "losses": result.losses}


def main(argv: list[str] | None = None) -> None:
    from phalanx.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plugins", nargs="+", default=["ddp", "zero2"])
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="latent cache folder (encoded once if empty)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    results: dict[str, list[list[dict]]] = {p: [] for p in args.plugins}
    with tempfile.TemporaryDirectory(prefix="diffusion-bench-") as tmp:
        for r in range(args.rounds):
            for plugin in args.plugins:
                ranks = spawn(_run, 2, plugin, args.steps, f"{tmp}/{plugin}-{r}", args.cache, timeout=1200)
                results[plugin].append(ranks)
                print(f"round {r} {plugin}: {ranks[0]['images_per_s']:.1f} images/s, "
                      f"peak {max(x['peak_mib'] for x in ranks):.0f} MiB/rank")
    rows = {}
    for plugin, rounds in results.items():
        best = max(rounds, key=lambda ranks: ranks[0]["images_per_s"] or 0)
        rows[plugin] = {"images_per_s": best[0]["images_per_s"], "peak_mib_per_rank": max(x["peak_mib"] for x in best),
                        "growth_mib_per_rank": max(x["growth_mib"] for x in best),
                        "final_loss": best[0]["losses"][-1]}
    ref = rows[args.plugins[0]]["images_per_s"]
    print(f"\n| plugin (2 ranks) | images/s | vs {args.plugins[0]} | peak MiB/rank | growth during training MiB/rank |")
    print("|---|---|---|---|---|")
    for plugin, row in rows.items():
        print(f"| {plugin} | {row['images_per_s']:.1f} | {row['images_per_s'] / ref:.2f}x | {row['peak_mib_per_rank']:.0f} | "
              f"{row['growth_mib_per_rank']:.0f} |")
    print("BENCH_JSON " + json.dumps({"bench": "diffusion_plugins", "steps": args.steps, "rounds": args.rounds,
                                      "load_start": load, "load_end": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
