"""Pipeline parallelism on CPU ranks: tokens/s per schedule against DDP on the same global batch,
and each schedule's measured bubble against theory, in one run.

Every variant trains the same Llama (hidden 256, 8 layers, 8 heads / 4 KV heads, vocab 8192) with
AdamW and clipping at 1.0 through the Booster: DDPPlugin (each rank 1/world of the batch) and
HybridParallelPlugin(pp_size=world) under GPipe, 1F1B, interleaved 1F1B (2 stages per rank) and
ZB-V zero bubble, `--microbatches` microbatches per step; 1F1B with fewer layers on the last
stage (which also runs the LM head and the loss); at 4 ranks also pp2 × dp2 (1F1B).

Throughput: every variant of a world size runs in one set of processes, round-robin
(bench/timing.py), best step per variant, wall clock barrier to barrier; CPU time per step and
rank is the steadier figure on a shared machine. Bubble: inside `execute_pipeline` each rank
times its stage computations (forward, backward, weight-gradient chunks); the rest of the
schedule's wall time is idle or communication: measured bubble = 1 − compute / schedule time,
averaged over ranks and steps, against (p−1)/(m+p−1) (GPipe, 1F1B), (p−1)/(v·m+p−1)
(interleaved) and 0 (ZB-V with m ≥ 2p, the paper's ideal). More ranks than cores oversubscribe
the CPU: then waiting for a core counts as compute and the figures are only ratios.

    python bench/pipeline.py                 # 2 and 4 ranks, ~4 min on 2 cores
    python bench/pipeline.py --worlds 2 --steps 2 --rounds 2

Prints a table per world size and one `BENCH_JSON {...}` line.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from timing import boost_variant, time_round_robin  # bench/timing.py
from phalanx.booster.state import boosted_state  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
BALANCED = {2: [5, 3], 4: [3, 2, 2, 1]}


def variants(world: int, microbatches: int) -> dict:
    out: dict = {"ddp": None}
    for schedule in SCHEDULES:
        out[f"pp{world}-{schedule}"] = dict(pp_size=world, pp_schedule=schedule, num_microbatches=microbatches)
    # the last stage's LM head and loss (vocab 8192 × hidden 256) cost about three decoder layers:
    # give that stage fewer layers
    out[f"pp{world}-1f1b-balanced"] = dict(pp_size=world, pp_schedule="1f1b", num_microbatches=microbatches,
                                           layers_per_stage=BALANCED[world])
    if world == 4:
        out["pp2+dp2-1f1b"] = dict(pp_size=2, pp_schedule="1f1b", num_microbatches=microbatches // 2)
    return out


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def build(layout: dict | None, batch: int, seq: int, stats: dict):
    """A `step()` for one variant on this rank's share of the global batch; pipelined steps add
    (compute seconds, schedule seconds) to `stats`."""
    booster, model, optimizer, x = boost_variant(config(), layout, batch, seq)
    runner = boosted_state(model).pipeline

    def step():
        if runner is None:
            booster.backward(model(input_ids=x, labels=x).loss, optimizer)
        else:
            busy, t0 = runner.busy.seconds, time.perf_counter()
            booster.execute_pipeline(iter([x]), model, None, optimizer)
            stats["schedule_s"] += time.perf_counter() - t0
            stats["compute_s"] += runner.busy.seconds - busy
        optimizer.step()
        optimizer.zero_grad()
    return step


def rank_bench(variants_: dict, batch: int, seq: int, steps: int, rounds: int) -> dict:
    stats = {name: {"compute_s": 0.0, "schedule_s": 0.0} for name in variants_}
    steps_of = {name: build(layout, batch, seq, stats[name]) for name, layout in variants_.items()}
    for step in steps_of.values():  # warm-up: one-time costs, the schedules' shape exchange
        step()
    for s in stats.values():
        s["compute_s"] = s["schedule_s"] = 0.0
    wall, cpu = time_round_robin(steps_of, rounds, steps)
    return {"wall": wall, "cpu": cpu, "stats": stats}


def run(world: int, args) -> dict:
    from phalanx.pipeline import bubble_fraction
    from phalanx.testing import spawn

    layouts = variants(world, args.microbatches)
    print(f"\n== {world} gloo ranks x 1 thread: Llama 256x8, global batch {args.batch} x seq {args.seq} "
          f"({args.batch * args.seq} tokens/step), {args.microbatches} microbatches, "
          f"{args.rounds} rounds x {args.steps} steps ==", flush=True)
    per_rank = spawn(rank_bench, world, layouts, args.batch, args.seq, args.steps, args.rounds,
                     timeout=3600, threads=1)
    tokens = args.batch * args.seq
    rows = {}
    for name, layout in layouts.items():
        n = len(per_rank[0]["wall"][name])
        wall = min(max(r["wall"][name][i] for r in per_rank) for i in range(n))
        cpu = min(sum(r["cpu"][name][i] for r in per_rank) / world for i in range(n))
        row = {"tokens_per_s": tokens / wall, "step_s": wall, "cpu_s_per_rank": cpu}
        if layout is not None:
            s = [r["stats"][name] for r in per_rank]
            row["bubble_measured"] = sum(1 - x["compute_s"] / x["schedule_s"] for x in s) / len(s)
            virtual = 2 if layout["pp_schedule"] in ("interleaved", "zero_bubble") else 1
            row["bubble_theory"] = bubble_fraction(layout["pp_schedule"], layout["pp_size"],
                                                   layout["num_microbatches"], virtual)
        rows[name] = row
    base = rows["ddp"]
    print(f"{'variant':<20}{'tokens/s':>10}{'vs DDP':>8}{'cpu s/step':>12}{'vs DDP':>8}{'bubble':>9}{'theory':>9}")
    for name, r in rows.items():
        r["speed_vs_ddp"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["cpu_vs_ddp"] = r["cpu_s_per_rank"] / base["cpu_s_per_rank"]
        bubble = f"{r['bubble_measured']:>9.2f}{r['bubble_theory']:>9.2f}" if "bubble_theory" in r else f"{'':>18}"
        print(f"{name:<20}{r['tokens_per_s']:>10.0f}{r['speed_vs_ddp']:>8.2f}{r['cpu_s_per_rank']:>12.3f}"
              f"{r['cpu_vs_ddp']:>8.2f}{bubble}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    result = {f"{w}_ranks": run(w, args) for w in args.worlds}
    print("BENCH_JSON " + json.dumps({"bench": "pipeline", "batch": args.batch, "seq": args.seq,
                                      "microbatches": args.microbatches, "results": result}))


if __name__ == "__main__":
    main()
