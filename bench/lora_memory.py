"""LoRA through the Booster against full fine-tuning: optimizer state and peak memory per rank.

Both runs train the same causal LM with ZeroPlugin(stage=2) on `--world` gloo ranks, AdamW, fp32,
`--steps` steps of `--batch` x `--seq` random tokens per rank: once full fine-tuning (the peer),
once with `booster.enable_lora(model, LoraConfig(r, alpha, q/k/v/o))`. Per rank it reports the
AdamW state bytes (exp_avg + exp_avg_sq), the trainable parameters and the peak resident memory
above a warmed-up baseline (one untimed step first, then freed), and the ratios LoRA / full.

    python bench/lora_memory.py                                   # SmolLM2-135M from phalanx.pretrained
    python bench/lora_memory.py --model tiny --seq 32 --steps 1   # a tiny random LLaMA (smoke)

Memory figures do not depend on load, but run it alone anyway: the peak is the process's resident
memory. It prints the CPU model and the load average with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import cpu_kind, load_average  # bench/timing.py

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def load_model(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    if name == "tiny":
        from phalanx.testing import tiny_llama
        return tiny_llama(seed=0)
    if name == "smollm2":
        from phalanx.pretrained import ensure_smollm2
        name = str(ensure_smollm2())
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)


def train_once(args, lora: bool, steps: int) -> dict:
    import peft
    import torch
    import torch.distributed as dist

    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    booster = Booster(plugin=make_plugin("zero2"))
    model = load_model(args.model)
    vocab = model.config.vocab_size
    if lora:
        model = booster.enable_lora(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                           target_modules=TARGETS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, *_ = booster.boost(model, optimizer)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        batch = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(booster.plugin.device)
        booster.backward(model(input_ids=batch, labels=batch).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    inner = optimizer.optim
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    trainable = sum(p.numel() for p in booster.unwrap(model).parameters() if p.requires_grad)
    return {"adam_state_bytes": state, "trainable": trainable}


def rank_main(args, lora: bool) -> dict:
    import gc

    import torch

    from phalanx.malloc import follow_live_memory
    from phalanx.observe.memory import PeakResident, release_free_memory, resident_bytes

    torch.set_num_threads(1)
    follow_live_memory()
    train_once(args, lora, steps=1)  # warm-up: imports, allocator pools, the first step's buffers
    gc.collect()
    release_free_memory()
    base = resident_bytes()
    with PeakResident() as peak:
        out = train_once(args, lora, steps=args.steps)
    out["peak_above_baseline_bytes"] = peak.max["total"] - base["total"]
    return out


def main() -> None:
    from phalanx.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a Hugging Face directory")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    args = parser.parse_args()
    load0 = load_average()
    full = spawn(rank_main, args.world, args, False, timeout=1800)
    lora = spawn(rank_main, args.world, args, True, timeout=1800)
    load1 = load_average()
    print(f"CPU: {cpu_kind()}, {os.cpu_count()} cores; load average {load0} -> {load1}")
    print(f"{args.model}, ZeRO-2, fp32, {args.world} gloo ranks, {args.steps} steps of {args.batch} x {args.seq} "
          f"tokens per rank; LoRA r={args.rank} on {'/'.join(TARGETS)}")
    rows = []
    for rank, (f, l) in enumerate(zip(full, lora, strict=True)):
        rows.append({"rank": rank, "full": f, "lora": l})
        print(f"  rank {rank}: AdamW state full {f['adam_state_bytes'] / 1e6:.1f} MB, LoRA "
              f"{l['adam_state_bytes'] / 1e6:.2f} MB ({l['trainable']:,} of {f['trainable']:,} parameters trainable); "
              f"peak above baseline full {f['peak_above_baseline_bytes'] / 2**30:.2f} GiB, LoRA "
              f"{l['peak_above_baseline_bytes'] / 2**30:.2f} GiB")
    f, l = full[0], lora[0]
    print(f"LoRA / full fine-tuning: optimizer state {l['adam_state_bytes'] / f['adam_state_bytes']:.4f}x, "
          f"peak memory {l['peak_above_baseline_bytes'] / f['peak_above_baseline_bytes']:.2f}x")
    print("BENCH_JSON " + json.dumps({"bench": "lora_memory", "model": args.model, "world": args.world,
                                      "cpu_model": cpu_kind(), "loadavg": [load0, load1], "rows": rows}))


if __name__ == "__main__":
    main()
