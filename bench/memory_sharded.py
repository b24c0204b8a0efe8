"""Peak resident memory per rank while a lazily built Llama is loaded, trained and saved, per plugin.

Each plugin runs on `--world` gloo ranks of this machine: build the model on the meta device from
a checkpoint (`phalanx.lazy.from_pretrained`), boost it (load), train `--steps` AdamW steps in
fp32 with the model's own loss (steps), save it streamed in Hugging Face layout (save). For each
phase it prints the worst rank's peak resident memory above its baseline (taken after a warm-up
of the same three phases on a tiny model) against the unsharded training state divided by the
world size, 16 B/param / N (fp32 weights, gradients and Adam's two moments), and the plan's
estimate of what training adds beyond that state (activations, logits, gathered blocks,
communication buffers: `phalanx.plan`, "+other"). The target for a plugin that shards everything (FSDP,
Gemini) is peak <= 16P/N + activations, plus 15%; ZeRO-1/2 and DDP keep the whole model on every
rank by design (their row shows by how much they exceed it).

    python bench/memory_sharded.py                                   # 4 ranks, 7.1M params (~3 min, 2 cores)
    python bench/memory_sharded.py --plugins fsdp,gemini --hidden 1024 --layers 16 --vocab 32000
    python bench/memory_sharded.py --world 2 --quick                 # a smaller model

"save" adds the writer's file (`--shard-mb`, default 1/32 of the fp32 model) and one tensor (the
largest, fp32) to the target: rank 0 holds one file's tensors while it writes
(phalanx.checkpoint.hf), and the tensor being gathered besides (a tensor larger than the file
size is a file of its own: at 158M parameters the 125 MiB embedding against 19 MiB files). "start" is the resident memory
above the baseline when the phase begins (what the previous phases left). Memory is what the
process owns (RssAnon + RssShmem); "file" is the peak of clean file pages that the memory-mapped
safetensors reads leave resident (page cache, shared between ranks and reclaimable), shown apart.

The checkpoint is written tensor by tensor from a lazy random init (it never exists whole in the
parent either). On a CPU machine resident memory is the kernel's RSS (anon + the host pool);
glibc is told to give freed memory back (`phalanx.plan.measure.follow_live_memory`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20
PLUGINS = {
    "fsdp": dict(name="fsdp"),
    "gemini": dict(name="gemini", placement_policy="static", chunk_size_mb=4),
    "zero2": dict(name="zero2", reduce_bucket_mb=4),
    "ddp": dict(name="ddp"),
}


def model_config(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 16 * 16,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                       max_position_embeddings=1024, tie_word_embeddings=False, attn_implementation="sdpa")


def write_checkpoint(config, directory: Path, seed: int = 0) -> tuple[int, int]:
    """A random fp32 checkpoint, one tensor at a time (lazy init + the streamed writer); returns
    (parameters, elements of the largest tensor)."""
    import torch

    from phalanx import lazy
    from phalanx.checkpoint.hf import ShardedSafetensorsWriter, parse_shard_size

    model = lazy.from_config(config)
    source = lazy.source_for(model, seed=seed)
    writer = ShardedSafetensorsWriter(directory, parse_shard_size("256MB"))
    n = largest = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = source.full(name, p)
            writer.add(name, value)
            n += value.numel()
            largest = max(largest, value.numel())
    writer.finish()
    config.save_pretrained(directory)
    return n, largest


def owned(resident: dict) -> int:
    """What the process owns: anonymous memory plus the host pool (shmem), without the clean
    file pages a memory-mapped safetensors read leaves resident (page cache, shared, reclaimable)."""
    if "anon" in resident:
        return resident["anon"] + resident.get("shmem", 0)
    return resident["total"]


def _phases(plugin_kwargs: dict, checkpoint: str, out_dir: str, seq: int, micro_batch: int, steps: int,
            shard_bytes: int, base=None) -> dict:
    """Load (lazy + boost), train, save; with `base`, each phase's resident memory above it at the
    phase's start and at its peak."""
    import torch
    import torch.distributed as dist

    from phalanx import lazy
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.observe.memory import PeakResident, resident_bytes

    kwargs = dict(plugin_kwargs)
    name = kwargs.pop("name")
    peak_of, start_of, file_of, times = {}, {}, {}, {}
    ctx = {}

    def phase(label, fn):
        start = time.perf_counter()
        if base is None:
            fn()
        else:
            now = resident_bytes()
            start_of[label] = owned(now) - owned(base)
            with PeakResident(interval=0.01) as peak:
                fn()
            peak_of[label] = max(owned(peak.max) - owned(base), 0)
            file_of[label] = peak.max.get("file", 0) - base.get("file", 0)
        times[label] = time.perf_counter() - start

    def load():
        model = lazy.from_pretrained(checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        booster = Booster(plugin=make_plugin(name, precision="fp32", **kwargs))
        ctx["model"], ctx["opt"], *_ = booster.boost(model, opt)
        ctx["booster"] = booster

    def train():
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        model, opt, booster = ctx["model"], ctx["opt"], ctx["booster"]
        vocab = model.unwrapped.config.vocab_size
        for _ in range(steps):
            batch = torch.randint(0, vocab, (micro_batch, seq), generator=g)
            loss = model(input_ids=batch, labels=batch).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()

    def save():
        ctx["booster"].save_model(ctx["model"], out_dir, max_shard_size=shard_bytes)

    phase("load", load)
    phase("steps", train)
    phase("save", save)
    ctx.clear()
    return {"peak": peak_of, "start": start_of, "file": file_of, "seconds": times}


def rank_main(plugins: dict, tiny: str, checkpoint: str, out_dir: str, seq: int, micro_batch: int,
              steps: int, shard_bytes: int) -> dict:
    """Every plugin in turn on this rank (one spawn: starting 4 ranks is the slow part), each
    measured from its own baseline, taken after a warm-up of the same plugin on a tiny model."""
    import torch.distributed as dist

    from phalanx.observe.memory import release_free_memory, resident_bytes
    from phalanx.plan.measure import follow_live_memory

    if not follow_live_memory():
        return {"skip": "resident memory follows live memory only with glibc's mallopt"}
    out = {}
    for name, kwargs in plugins.items():
        _phases(kwargs, tiny, f"{out_dir}/{name}-warmup", 16, 1, 1, shard_bytes)  # first-use memory
        release_free_memory()
        dist.barrier()
        base = resident_bytes()
        out[name] = _phases(kwargs, checkpoint, f"{out_dir}/{name}", seq, micro_batch, steps, shard_bytes, base=base)
        release_free_memory()
        dist.barrier()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--plugins", default="fsdp,gemini,zero2,ddp", help="comma-separated: " + ", ".join(PLUGINS))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--shard-mb", type=float, default=None, help="save's max_shard_size (default: 1/32 of the model)")
    ap.add_argument("--quick", action="store_true", help="hidden 256, 2 layers, vocab 4096")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.quick:
        args.hidden, args.layers, args.vocab = 256, 2, 4096
    plugins = args.plugins.split(",")
    unknown = [p for p in plugins if p not in PLUGINS]
    if unknown:
        raise SystemExit(f"unknown plugin(s) {unknown}: choose from {', '.join(PLUGINS)}")

    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run
    from phalanx.testing import spawn, tiny_llama_config

    config = model_config(args.hidden, args.layers, args.vocab)
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory_sharded-") as tmp:
        tmp = Path(tmp)
        n, largest = write_checkpoint(config, tmp / "ckpt")
        write_checkpoint(tiny_llama_config(), tmp / "tiny")
        state = 16 * n
        print(f"Llama {n / 1e6:.1f}M parameters: unsharded fp32 training state {state / MiB:.0f} MiB "
              f"(16 B/param); {args.world} gloo ranks, seq {args.seq} x micro-batch {args.micro_batch}, "
              f"{args.steps} AdamW steps; peak RSS per rank above baseline, worst rank", flush=True)
        shard_bytes = int(args.shard_mb * MiB) if args.shard_mb else max(MiB, 4 * n // 32)
        print(f"save: max_shard_size {shard_bytes / MiB:.1f} MiB (1/32 of the fp32 model, as 2GB is of a 16B model); "
              f"largest tensor {4 * largest / MiB:.1f} MiB")
        print(f"{'plugin':<8} {'phase':<6} {'start':>7} {'peak MiB':>9} {'16P/N':>8} {'+other':>7} {'target':>8} "
              f"{'ratio':>6} {'file':>6} {'s':>6}  per-rank peak MiB")
        t0 = time.perf_counter()
        ranks = spawn(rank_main, args.world, {p: PLUGINS[p] for p in plugins}, str(tmp / "tiny"), str(tmp / "ckpt"),
                      str(tmp / "out"), args.seq, args.micro_batch, args.steps, shard_bytes, timeout=3600)
        if "skip" in ranks[0]:
            raise SystemExit(ranks[0]["skip"])
        for plugin in plugins:
            kwargs = dict(PLUGINS[plugin])
            est = estimate_for_run(config, make_plugin(kwargs.pop("name"), precision="fp32", **kwargs),
                                   args.seq, args.micro_batch, args.world, loss="hf")
            # what the plan expects beyond the training state: activations, the loss' logits,
            # gathered blocks and communication buffers
            act = sum(v for k, v in est.memory.device.items() if k not in ("parameters", "gradients", "optimizer"))
            for phase in ("load", "steps", "save"):
                per_rank = [r[plugin]["peak"][phase] for r in ranks]
                peak = max(per_rank)
                start = max(r[plugin]["start"][phase] for r in ranks)
                extra = act if phase == "steps" else (shard_bytes + 4 * largest if phase == "save" else 0.0)
                target = state / args.world + extra
                secs = max(r[plugin]["seconds"][phase] for r in ranks)
                file = max(r[plugin]["file"][phase] for r in ranks)
                print(f"{plugin:<8} {phase:<6} {start / MiB:>7.1f} {peak / MiB:>9.1f} {state / args.world / MiB:>8.1f} "
                      f"{extra / MiB:>7.1f} {target / MiB:>8.1f} {peak / target:>6.2f} {file / MiB:>6.1f} {secs:>6.1f}  "
                      f"{[round(p / MiB) for p in per_rank]}", flush=True)
                rows.append({"plugin": plugin, "phase": phase, "start": start, "peak": peak, "per_rank": per_rank,
                             "target": target, "ratio": peak / target, "seconds": secs})
        print(f"(measured in {time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    print(json.dumps({"bench": "memory_sharded", "world": args.world, "params": n, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
