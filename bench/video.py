"""Video diffusion training throughput: Ulysses sequence parallelism on 2 ranks vs plain data
parallelism on 2 ranks, for clip lengths 1 / 9 / 17 / 33 frames, measured in one run.

    python bench/video.py                       # 32x32 frames, 4x128 Wan transformer, 2 ranks on CPU/gloo
    python bench/video.py --frames 1 9 --size 16 --steps 2   # quick

Per clip length and mode, on 2 ranks, each rank with its own micro-batch (`--batch` clips): the
training step of `apps.video_gen.model.VideoFlowModel` (forward, backward, gradient all-reduce).
Without SP each rank computes its own clips; with SP the 2 ranks are one SP group sharing one
micro-batch, each computing half of its tokens (Ulysses all-to-all around each self-attention), so
the SP step trains half the clips of the DP step. Reported: tokens/s (video tokens trained
per second of step time), peak memory per rank (CUDA: max allocated; CPU: the rise of
the peak resident set over the process's level before the first step), and the share of step time
spent inside the all-to-alls. Each configuration runs in fresh processes. The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_video_model(layers: int, heads: int):
    """(the benches' tiny text-to-video model on this rank's device in train mode, its tokenizer)."""
    from apps.video_gen.config import FlowConfig, ModelConfig
    from apps.video_gen.model import VideoFlowModel, build_transformer
    from apps.video_gen.text import build_text_encoder, build_tokenizer, tokenize

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    tok = build_tokenizer(["a red square moving left"], 8)
    mcfg = ModelConfig(num_layers=layers, num_heads=heads, head_dim=32, ffn_dim=4 * heads * 32, text_hidden_size=64)
    model = VideoFlowModel(build_transformer(mcfg, 3, 64), build_text_encoder(tok, 64, 1, 2),
                           tokenize(tok, [""])[0], tok.pad_token_id, FlowConfig()).to(device).train()
    return model, tok


def _rank(frames: int, size: int, batch: int, steps: int, sp: bool, layers: int, heads: int) -> dict:
    import torch.distributed as dist

    from apps.video_gen.text import tokenize

    # Every all-to-all (forward and backward) goes through comm._all_to_all: time it there.
    import phalanx.sequence.comm as comm

    timer = {"a2a": 0.0}
    raw = comm._all_to_all

    def timed_all_to_all(*args, **kwargs):
        t0 = time.perf_counter()
        out = raw(*args, **kwargs)
        timer["a2a"] += time.perf_counter() - t0
        return out

    comm._all_to_all = timed_all_to_all
    model, tok = bench_video_model(layers, heads)
    device = next(model.parameters()).device
    if sp:
        model.sp_group = dist.group.WORLD
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    video = torch.randn(batch, 3, frames, size, size, device=device)
    ids = tokenize(tok, ["a red square moving left"] * batch).to(device)
    tokens_per_rank_batch = batch * model.tokens(tuple(video.shape))
    base = _rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, a2a = [], []
    for step in range(steps + 1):  # the first step warms up
        timer["a2a"] = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(video, ids)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
            a2a.append(timer["a2a"])
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else _peak_rss_mb() - base
    step_s = sum(times) / len(times)
    world = dist.get_world_size()
    trained = tokens_per_rank_batch * (1 if sp else world)  # SP: the group's one micro-batch
    return {"frames": frames, "sp": sp, "step_s": step_s, "tokens_per_s": trained / step_s,
            "peak_mb": peak, "a2a_share": sum(a2a) / sum(times), "tokens_per_clip": model.tokens(tuple(video.shape))}


def main(argv: list[str] | None = None) -> None:
    from phalanx.testing import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, nargs="+", default=[1, 9, 17, 33])
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args(argv)
    rows = []
    for frames in args.frames:
        for sp in (False, True):
            r = max(spawn(_rank, 2, frames, args.size, args.batch, args.steps, sp, args.layers, args.heads,
                          timeout=1200), key=lambda x: x["step_s"])  # the slower rank sets the pace
            rows.append(r)
            print(json.dumps(r), flush=True)  # partial results survive an interrupted run
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"# {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU ' + cpu}, "
          f"2 ranks, load average {' '.join(load)}; frames {args.size}x{args.size}, patch 1x2x2")
    print(f"{'frames':>6} {'tokens':>6} | {'DP tok/s':>9} {'DP MB':>7} | {'SP tok/s':>9} {'SP MB':>7} {'a2a':>6} | "
          f"{'SP/DP speed':>11} {'SP/DP mem':>9}")
    for frames in args.frames:
        dp, sp = [r for r in rows if r["frames"] == frames]
        print(f"{frames:>6} {dp['tokens_per_clip']:>6} | {dp['tokens_per_s']:>9.0f} {dp['peak_mb']:>7.0f} | "
              f"{sp['tokens_per_s']:>9.0f} {sp['peak_mb']:>7.0f} {sp['a2a_share']:>6.1%} | "
              f"{sp['tokens_per_s'] / dp['tokens_per_s']:>11.2f} {sp['peak_mb'] / max(dp['peak_mb'], 1e-9):>9.2f}")
    print(json.dumps({"bench": "video", "load": load, "cpu": cpu, "size": args.size, "rows": rows}))


if __name__ == "__main__":
    main()
