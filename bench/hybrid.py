"""Hybrid parallelism on CPU ranks: tokens/s and peak memory per rank against DDP, same model,
same global batch, measured in one run.

Two gloo ranks (one CPU thread each): DDPPlugin (each rank half the batch), tp2, sp2 split-gather
(tp2 with the sequence split between the layers), sp2 Ulysses, sp2 ring (each rank the whole
batch, half the sequence for sp). Four ranks: DDPPlugin against dp2+tp2 with ZeRO-1. Every
variant trains the same Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 8192) with AdamW
and clipping at 1.0 through the Booster.

Timing runs every variant of a world size in one set of processes, round-robin, and reports each
variant's best step (wall clock, barrier to barrier) and its CPU time per step; on a shared
machine compare CPU time. Peak memory is measured first, one variant at a time: the growth of the
resident set's high-water mark over the RSS before the variant was built (model, optimizer state,
activations, communication buffers).

    python bench/hybrid.py                      # ~5 min on 2 cores
    python bench/hybrid.py --steps 3 --rounds 2 --seq 256

Prints a table per world size and one `BENCH_JSON {...}` line. On CPU, tensor and sequence
parallelism pay for their activation collectives with no compute to hide them behind: the point
of the numbers is the memory per rank and the relative cost, which the GPU run (NCCL, overlap)
changes.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from timing import boost_variant, time_round_robin  # bench/timing.py

VARIANTS = {
    2: {"ddp": None, "tp2": dict(tp_size=2), "sp2-split_gather": dict(tp_size=2, sequence_parallelism="split_gather"),
        "sp2-ulysses": dict(sp_size=2, sequence_parallelism="ulysses"),
        "sp2-ring": dict(sp_size=2, sequence_parallelism="ring")},
    4: {"ddp": None, "dp2+tp2-zero1": dict(tp_size=2, zero_stage=1)},
}


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def build(name: str, layout: dict | None, batch: int, seq: int):
    """A `step()` for one variant on this rank's share of the global batch."""
    booster, model, optimizer, x = boost_variant(config(), layout, batch, seq)

    def step():
        booster.backward(model(input_ids=x, labels=x).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return step


def rank_bench(variants: dict, batch: int, seq: int, steps: int, rounds: int) -> dict:

    from phalanx.observe import current_memory_bytes, peak_memory_bytes, release_free_memory, reset_peak_memory

    memory = {}
    for name in [next(iter(variants)), *variants]:  # a throwaway first run pays one-time costs
        release_free_memory()
        reset_peak_memory("cpu")
        before = current_memory_bytes("cpu")
        step = build(name, variants[name], batch, seq)
        for _ in range(2):
            step()
        memory[name] = peak_memory_bytes("cpu") - before
        del step
    release_free_memory()
    steps_of = {name: build(name, layout, batch, seq) for name, layout in variants.items()}
    for step in steps_of.values():
        step()
    wall, cpu = time_round_robin(steps_of, rounds, steps)
    return {"memory": memory, "wall": wall, "cpu": cpu}


def run(world: int, args) -> dict:
    from phalanx.testing import spawn

    variants = VARIANTS[world]
    print(f"\n== {world} gloo ranks x 1 thread: Llama 256x4, global batch {args.batch} x seq {args.seq} "
          f"({args.batch * args.seq} tokens/step), {args.rounds} rounds x {args.steps} steps ==", flush=True)
    per_rank = spawn(rank_bench, world, variants, args.batch, args.seq, args.steps, args.rounds,
                     timeout=3600, threads=1)
    tokens = args.batch * args.seq
    rows = {}
    for name in variants:
        wall = min(max(r["wall"][name][i] for r in per_rank) for i in range(len(per_rank[0]["wall"][name])))
        cpu = min(sum(r["cpu"][name][i] for r in per_rank) / world for i in range(len(per_rank[0]["cpu"][name])))
        rows[name] = {"tokens_per_s": tokens / wall, "step_s": wall, "cpu_s_per_rank": cpu,
                      "peak_mib_per_rank": max(r["memory"][name] for r in per_rank) / 2**20}
    base = rows["ddp"]
    print(f"{'variant':<18}{'tokens/s':>10}{'vs DDP':>8}{'cpu s/step':>12}{'vs DDP':>8}{'peak MiB/rank':>15}"
          f"{'vs DDP':>8}")
    for name, r in rows.items():
        r["speed_vs_ddp"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["cpu_vs_ddp"] = r["cpu_s_per_rank"] / base["cpu_s_per_rank"]
        r["memory_vs_ddp"] = r["peak_mib_per_rank"] / base["peak_mib_per_rank"]
        print(f"{name:<18}{r['tokens_per_s']:>10.0f}{r['speed_vs_ddp']:>7.2f}x{r['cpu_s_per_rank']:>12.3f}"
              f"{r['cpu_vs_ddp']:>7.2f}x{r['peak_mib_per_rank']:>15.1f}{r['memory_vs_ddp']:>7.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result = {"machine": {"cores": os.cpu_count(), "load_avg_1min": load, "torch": torch.__version__},
              "batch": args.batch, "seq": args.seq}
    for world in (int(w) for w in args.worlds.split(",")):
        result[f"world{world}"] = run(world, args)
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
