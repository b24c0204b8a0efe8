"""Activation memory per rank of the video model under Ulysses sequence parallelism, sp = 1, 2 (4).

    python bench/video_sp_memory.py                          # 17 frames of 32x32, patch 1x2x2, sp 1 2
    python bench/video_sp_memory.py --sp 1 2 4 --frames 33   # longer clips, sp up to 4

One SP group of sp ranks (CPU/gloo, or one GPU a rank) shares one clip; each rank computes 1/sp of
its tokens (`apps.video_gen` data x sequence layout, `VideoFlowModel.shard_loss`). Per rank, for one
training forward (the activations are what the backward then reads):

- saved: bytes of the distinct storages autograd keeps for backward (`saved_tensors_hooks`), the
  activation memory itself, exact on any device;
- peak: the rise of the framework's memory probe (`phalanx.observe.memory`: a GPU's
  max_memory_allocated, on CPU the resident high-water mark with glibc following live memory)
  over the level before the forward, through forward and backward (activations, their gradients,
  the parameter gradients and the all-to-all buffers).

Each sp runs in fresh processes. The ratio column is sp=1's value over this sp's (ideal: sp). The
last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from video import bench_video_model  # noqa: E402  (bench/video.py: the same tiny model)


def _rank(frames: int, size: int, layers: int, heads: int, checkpointing: bool) -> dict:
    import torch.distributed as dist

    from phalanx.malloc import follow_live_memory
    from phalanx.observe.memory import current_memory_bytes, peak_memory_bytes, release_free_memory, reset_peak_memory

    from apps.video_gen.text import tokenize

    follow_live_memory()
    model, tok = bench_video_model(layers, heads)
    device = next(model.parameters()).device
    if checkpointing:
        model.transformer.enable_gradient_checkpointing()
    sp = dist.get_world_size()
    if sp > 1:
        model.sp_group = dist.group.WORLD
    video = torch.randn(1, 3, frames, size, size, device=device)  # the same clip on every rank of the group
    ids = tokenize(tok, ["a red square moving left"]).to(device)
    model(video, ids).backward()  # warm-up: allocator pools, lazily built buffers
    model.zero_grad(set_to_none=True)

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    release_free_memory()
    base = current_memory_bytes(device)
    reset_peak_memory(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(video, ids)
    loss.backward()
    peak = peak_memory_bytes(device) - base
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)  # weights are not activations
    return {"sp": sp, "tokens_per_rank": model.tokens(tuple(video.shape)) // sp, "saved_bytes": saved,
            "peak_bytes": max(peak, 0)}


def main(argv: list[str] | None = None) -> None:
    from phalanx.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    args = p.parse_args(argv)
    rows = []
    for sp in args.sp:
        ranks = spawn(_rank, sp, args.frames, args.size, args.layers, args.heads, args.checkpointing, timeout=1200)
        row = max(ranks, key=lambda r: r["peak_bytes"])  # the fullest rank
        row["saved_bytes"] = max(r["saved_bytes"] for r in ranks)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    where = f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else \
        f"CPU {torch.backends.cpu.get_cpu_capability()}"
    print(f"# {where}, load average {' '.join(load)}; one clip of {args.frames}x{args.size}x{args.size}, patch 1x2x2, "
          f"{args.layers} layers x {args.heads} heads of 32{', checkpointed' if args.checkpointing else ''}")
    first = rows[0]
    print(f"{'sp':>3} {'tokens/rank':>11} | {'saved MB':>9} {'ratio':>6} | {'peak MB':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['sp']:>3} {r['tokens_per_rank']:>11} | {r['saved_bytes'] / 2**20:>9.2f} "
              f"{first['saved_bytes'] / max(r['saved_bytes'], 1):>6.2f} | {r['peak_bytes'] / 2**20:>8.2f} "
              f"{first['peak_bytes'] / max(r['peak_bytes'], 1):>6.2f}")
    print(json.dumps({"bench": "video_sp_memory", "load": load, "device": where, "frames": args.frames,
                      "size": args.size, "rows": rows}))


if __name__ == "__main__":
    main()
