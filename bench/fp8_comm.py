"""FP8-compressed gradient communication against fp32 communication: bytes moved, final loss,
time per step.

For each plugin (DDP, ZeRO-2) it trains the same small LLaMA on the same learnable token stream
(each token follows from the previous one by a fixed rule, so the loss falls) for `--steps`
AdamW steps on `--world` gloo ranks, once with the plugin's ordinary communication (for DDP that is
torch DDP's fp32 all-reduce, the peer) and once with `fp8_communication=<fmt>`
(`phalanx.amp.fp8_comm`), and prints per plugin the gradient bytes each rank sent per step,
their ratio, the final losses and their difference, and the median step time of both.

    python bench/fp8_comm.py                          # 2 ranks, 50 steps, e4m3
    python bench/fp8_comm.py --world 4 --fmt e5m2

The fp32 bytes are counted as what the same exchange sends at the gradients' own dtype (the
ring all-reduce and the all-to-all move (world-1)/world of the buffer per phase); gloo's own
framing is not counted on either side. Run it on a quiet machine: it prints the CPU model and the
load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import cpu_kind, load_average  # bench/timing.py


def token_stream(steps: int, batch: int, seq: int, vocab: int):
    """Batches where token t+1 = (5 * token t + 3) mod vocab after a random first token."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            x[:, t] = (5 * x[:, t - 1] + 3) % vocab
        out.append(x)
    return out


def train(plugin_name: str, fmt: str | None, args) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    plugin = make_plugin(plugin_name, fp8_communication=fmt or False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    booster = Booster(plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    grad_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    losses, times = [], []
    for batch in token_stream(args.steps, args.batch, args.seq, args.vocab):
        local = batch.chunk(world)[rank].to(plugin.device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=local, labels=local).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    traffic = plugin.fp8_traffic
    if fmt:
        sent = traffic.sent / args.steps
    else:  # what the plugin's fp32 exchange sends per step: DDP's ring all-reduce moves 2(W-1)/W of
        # the buffer, ZeRO's all-to-all (W-1)/W of it
        phases = 2 if plugin_name == "ddp" else 1
        sent = phases * grad_numel * 4 * (world - 1) / world
    return {"losses": losses, "step_s": statistics.median(times[1:]), "sent_per_step": sent}


def main() -> None:
    from phalanx.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--plugins", default="ddp,zero2")
    parser.add_argument("--fmt", default="e4m3", choices=["e4m3", "e5m2"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    load0 = load_average()
    results = {}
    for name in args.plugins.split(","):
        for fmt in (None, args.fmt):
            results[(name, fmt)] = spawn(train, args.world, name, fmt, args, timeout=1200)[0]
    load1 = load_average()
    print(f"CPU: {cpu_kind()}, {os.cpu_count()} cores; load average {load0} -> {load1}")
    print(f"gloo, {args.world} ranks x 1 thread, LLaMA hidden {args.hidden} x {args.layers} layers, "
          f"{args.steps} AdamW steps, fp8 format {args.fmt}")
    rows = []
    for name in args.plugins.split(","):
        base, fp8 = results[(name, None)], results[(name, args.fmt)]
        row = {"plugin": name, "fp32_bytes_per_step": base["sent_per_step"], "fp8_bytes_per_step": fp8["sent_per_step"],
               "bytes_ratio": fp8["sent_per_step"] / base["sent_per_step"],
               "final_loss_fp32": base["losses"][-1], "final_loss_fp8": fp8["losses"][-1],
               "first_loss": base["losses"][0], "step_ms_fp32": base["step_s"] * 1e3, "step_ms_fp8": fp8["step_s"] * 1e3}
        row["final_loss_diff"] = row["final_loss_fp8"] - row["final_loss_fp32"]
        rows.append(row)
        print(f"  {name:6s} gradient bytes/step/rank: fp32 {row['fp32_bytes_per_step'] / 1e6:.3f} MB, "
              f"fp8 {row['fp8_bytes_per_step'] / 1e6:.3f} MB -> ratio fp8/fp32: {row['bytes_ratio']:.3f}x")
        print(f"  {name:6s} loss {row['first_loss']:.4f} -> fp32 {row['final_loss_fp32']:.4f}, "
              f"fp8 {row['final_loss_fp8']:.4f} (diff {row['final_loss_diff']:+.4f})")
        print(f"  {name:6s} step time fp8 / fp32 communication: {row['step_ms_fp8'] / row['step_ms_fp32']:.2f}x "
              f"({row['step_ms_fp8']:.1f} vs {row['step_ms_fp32']:.1f} ms)")
    print("BENCH_JSON " + json.dumps({"bench": "fp8_comm", "world": args.world, "fmt": args.fmt, "steps": args.steps,
                                      "cpu_model": cpu_kind(), "loadavg": [load0, load1], "rows": rows}))


if __name__ == "__main__":
    main()
