"""Expert parallelism on CPU ranks: tokens/s of a tiny Mixtral with its experts split over 2 gloo
ranks (HybridParallelPlugin(ep_size=2)) against data parallelism (every rank all experts), same
model, same global batch, measured in one run; and the all-to-all share of the ep2 step.

Both variants run HybridParallelPlugin with ZeRO-1 and AdamW (clip 1.0), fp32, one thread per rank,
each rank half of the global batch; ep2 adds only the expert split. The all-to-alls (dispatch,
combine and their backward; `phalanx.shard.expert_parallel.EXCHANGE_TIMER`) are timed to their
return: on gloo they block, so their time includes waiting for the slower rank.

    python bench/moe_ep.py                      # ~2 min on 2 cores
    python bench/moe_ep.py --steps 2 --rounds 1 --seq 64

Prints a table, the ratio ep2 / dp2 tokens/s, the all-to-all share of the ep2 step and one
`BENCH_JSON {...}` line. On a CPU the expert compute per rank halves with ep2 while the dense part
stays: the ratio says what the split buys at this size, not what NCCL on GPUs would.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from timing import cpu_kind, load_average, time_round_robin  # bench/timing.py

VARIANTS = {"dp2": dict(zero_stage=1), "ep2": dict(zero_stage=1, ep_size=2)}


def config(args):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_width,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, attn_implementation="sdpa", output_router_logits=True)


def build(layout: dict, args):
    """A `step()` for one variant on this rank's half of the global batch."""
    from transformers import MixtralForCausalLM

    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    torch.manual_seed(0)
    model = MixtralForCausalLM(config(args))
    plugin = HybridParallelPlugin(max_norm=1.0, **layout)
    booster = Booster(plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, optimizer, *_ = booster.boost(model, optimizer)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    x = x.chunk(plugin.dp_size)[plugin.dp_rank]

    def step():
        booster.backward(model(input_ids=x, labels=x).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return step


def rank_bench(args) -> dict:
    from phalanx.shard.expert_parallel import EXCHANGE_TIMER

    steps_of = {name: build(layout, args) for name, layout in VARIANTS.items()}
    for step in steps_of.values():
        step()  # one-time costs
    wall, cpu = time_round_robin(steps_of, args.rounds, args.steps)
    EXCHANGE_TIMER.enabled, EXCHANGE_TIMER.seconds, EXCHANGE_TIMER.calls = True, 0.0, 0
    ep_wall = time_round_robin({"ep2": steps_of["ep2"]}, 1, args.steps)[0]["ep2"]
    EXCHANGE_TIMER.enabled = False
    return {"wall": wall, "cpu": cpu, "a2a_s": EXCHANGE_TIMER.seconds, "a2a_calls": EXCHANGE_TIMER.calls,
            "ep_wall": sum(ep_wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from phalanx.testing import spawn

    load_before = load_average()
    per_rank = spawn(rank_bench, 2, args, timeout=3600, threads=1)
    tokens = args.batch * args.seq
    rows = {}
    for name in VARIANTS:
        n = len(per_rank[0]["wall"][name])
        wall = min(max(r["wall"][name][i] for r in per_rank) for i in range(n))
        cpu = min(sum(r["cpu"][name][i] for r in per_rank) / 2 for i in range(n))
        rows[name] = {"tokens_per_s": tokens / wall, "step_s": wall, "cpu_s_per_rank": cpu}
    a2a_share = max(r["a2a_s"] / r["ep_wall"] for r in per_rank)
    ratio = rows["ep2"]["tokens_per_s"] / rows["dp2"]["tokens_per_s"]
    print(f"== 2 gloo ranks x 1 thread: Mixtral hidden {args.hidden} x {args.layers} layers, {args.experts} experts of "
          f"width {args.expert_width}, top-2; global batch {args.batch} x seq {args.seq} ({tokens} tokens/step) ==")
    print(f"{'variant':<10}{'tokens/s':>10}{'step s':>9}{'cpu s/step/rank':>17}")
    for name, r in rows.items():
        print(f"{name:<10}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.3f}{r['cpu_s_per_rank']:>17.3f}")
    print(f"ratio ep2 / dp2 tokens/s: {ratio:.2f}x")
    print(f"all-to-all share of the ep2 step: {100 * a2a_share:.1f}% "
          f"({per_rank[0]['a2a_calls'] // args.steps} exchanges per step on rank 0)")
    result = {"machine": {"cpu": cpu_kind(), "cores": os.cpu_count(), "load_avg_1min": load_before,
                          "load_avg_after": load_average(), "torch": torch.__version__},
              "args": vars(args), "rows": rows, "ratio_ep2_dp2": ratio, "a2a_share": a2a_share}
    print("BENCH_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
