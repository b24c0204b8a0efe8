"""How large a LLaMA each plugin trains under one device budget, and how fast, measured in one run.

For a fixed per-rank device budget, walk a ladder of LLaMA sizes (layers x hidden) and report
the largest that trains with DDPPlugin, FSDPPlugin, ZeroPlugin(stage 2, cpu_offload) and
GeminiPlugin static (everything offloadable offloaded) and auto; then tokens/s of each at one
common size that all of them fit. Ratios are against DDP, measured in the same run.

What "fits" means:
- Gemini, on CPU: it trains `--steps` steps without `NotEnoughDeviceMemory`, so its own byte
  accounting (chunks + traced non-model memory) stayed under the budget; on GPU: the same, and
  `torch.cuda.max_memory_allocated()` stayed under the budget.
- DDP / FSDP / ZeRO, on CPU (no accounting of their own, device = host): the fp32 device bytes per
  rank of their memory model, with the activations measured for that size (the bytes autograd
  saves, as Gemini's tracer counts them): DDP 16P + A; FSDP 16P/N + 8 L + A (one unsharded
  layer's weights and gradients, L its parameters); ZeRO-2 with offload 4P + min(4P, 2 buckets) + A.
  On GPU: a real training step and `torch.cuda.max_memory_allocated()`.

    python bench/gemini.py                      # 2 ranks, 64 MiB budget (~5-10 min on 2 CPU cores)
    python bench/gemini.py --budget 20GiB --world 8   # on a GPU node

`--disk`: the disk tier instead (`disk_bench`, ~1-2 min on 1 CPU core): one LLaMA (default 6 x 512,
20M parameters) with every shard and optimizer chunk at rest on the host (static placement,
everything offloaded), trained all in memory, then with a `host_memory_budget` its optimizer
state does not fit (the optimizer chunks that do not fit go to disk), then the same with the disk
tier's page cache dropped. Reports step and optimizer-step time, the disk tier's achieved read /
write bandwidth against the disk's own (a `dd`-style sequential write of a file the size of the
disk tier's data, fsync'd, its pages dropped from the cache with posix_fadvise(DONTNEED), read
back), and the host pool's resident peak (RssShmem) against the budget.

    python bench/gemini.py --disk                         # 1 rank, disk_dir: the temp dir
    python bench/gemini.py --disk --disk-dir /nvme/x --disk-layers 8 --disk-hidden 768

Prints a table and one `BENCH_JSON {...}` line.
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

PLUGINS = ("ddp", "fsdp", "zero2_offload", "gemini_static", "gemini_auto")
LABELS = {"ddp": "DDPPlugin", "fsdp": "FSDPPlugin", "zero2_offload": "ZeroPlugin(2, cpu_offload)",
          "gemini_static": "GeminiPlugin static (offload 1.0/1.0)", "gemini_auto": "GeminiPlugin auto"}
LADDER = [(2, 128), (4, 128), (4, 256), (8, 256), (8, 384), (8, 512), (8, 768), (12, 768), (16, 1024)]  # 16x1024: ~3 GB host RAM per rank
VOCAB = 2048
BUCKET_MB = 25.0


def llama_config(layers: int, hidden: int):
    from phalanx.testing import tiny_llama_config
    heads = max(2, hidden // 64)
    return tiny_llama_config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=(hidden * 8 // 3 + 31) // 32 * 32,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                             max_position_embeddings=1024)


def make_plugin(name: str, budget: int, chunk_mb: float):
    from phalanx.booster.plugins import DDPPlugin, FSDPPlugin, GeminiPlugin, ZeroPlugin
    if name == "ddp":
        return DDPPlugin(precision="fp32")
    if name == "fsdp":
        return FSDPPlugin(precision="fp32")
    if name == "zero2_offload":
        return ZeroPlugin(stage=2, precision="fp32", cpu_offload=True, reduce_bucket_mb=BUCKET_MB)
    policy = name.split("_")[1]
    extra = dict(offload_param_frac=1.0, offload_optim_frac=1.0) if policy == "static" else {}
    return GeminiPlugin(placement_policy=policy, device_memory_budget=budget, precision="fp32",
                        chunk_size_mb=chunk_mb, **extra)


def activation_bytes(model, batch: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded)."""
    seen, total = set(), [0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key[0] not in params and key not in seen:
                seen.add(key)
                total[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=batch, labels=batch).loss
    return total[0]


def modelled_bytes(name: str, model, acts: int, world: int) -> int:
    p = sum(x.numel() for x in model.parameters())
    layer = max(sum(x.numel() for x in blk.parameters()) for blk in model.model.layers)
    if name == "ddp":
        return 16 * p + acts
    if name == "fsdp":
        return 16 * p // world + 8 * layer + acts
    if name == "zero2_offload":
        return 4 * p + min(4 * p, 2 * int(BUCKET_MB * 2**20)) + acts
    raise ValueError(name)


def _steps(booster, model, opt, batch, steps: int) -> float:
    start = None
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - start


def try_train(name: str, layers: int, hidden: int, args, budget: int) -> tuple[bool, float, int]:
    """(fits, seconds for args.steps timed steps, peak device bytes) for one plugin and size."""
    import torch.distributed as dist

    from phalanx.booster import Booster
    from phalanx.gemini import NotEnoughDeviceMemory
    from phalanx.launch import context

    device = context().device
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(llama_config(layers, hidden))
    batch = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
    need = None
    if device.type == "cpu" and not name.startswith("gemini"):
        need = modelled_bytes(name, model, activation_bytes(model, batch), dist.get_world_size())
        if need > budget:
            return False, float("nan"), need
        if not args.time:
            return True, float("nan"), need
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plugin = make_plugin(name, budget, args.chunk_mb)
    booster = Booster(plugin=plugin)
    try:
        model, opt, *_ = booster.boost(model, opt)
        seconds = _steps(booster, model, opt, batch, args.steps)
    except NotEnoughDeviceMemory:
        return False, float("nan"), budget + 1
    except torch.OutOfMemoryError:
        return False, float("nan"), budget + 1
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    elif name.startswith("gemini"):
        peak = plugin.manager.tiers.peak_device_with_reserve
    else:
        peak = need
    return peak <= budget, seconds, peak


def rank_main(args_dict: dict) -> dict:
    import torch.distributed as dist

    from phalanx.gemini.tiers import parse_bytes

    args = argparse.Namespace(**args_dict)
    budget = parse_bytes(args.budget, 0)
    largest: dict[str, dict] = {}
    for name in args.plugins:
        args.time = False
        for layers, hidden in LADDER[:args.ladder]:
            ok, _, peak = try_train(name, layers, hidden, args, budget)
            dist.barrier()
            if not ok:
                break
            params = sum(p.numel() for p in LlamaForCausalLM_params(layers, hidden))
            largest[name] = {"layers": layers, "hidden": hidden, "params": params, "peak_bytes": peak}
    if args.common is None:  # the largest size every plugin fits
        fitted = [LADDER.index((largest[n]["layers"], largest[n]["hidden"])) if n in largest else 0
                  for n in args.plugins]
        args.common = min(fitted)
    layers, hidden = LADDER[args.common]
    speed = {}
    args.time = True
    for name in args.plugins:
        ok, seconds, peak = try_train(name, layers, hidden, args, budget)
        tokens = args.steps * args.batch * args.seq * dist.get_world_size()
        speed[name] = {"fits": ok, "tokens_per_s": tokens / seconds if seconds == seconds else None, "peak_bytes": peak}
        dist.barrier()
    return {"largest": largest, "speed": speed, "common": {"layers": layers, "hidden": hidden}, "budget": budget}


def LlamaForCausalLM_params(layers: int, hidden: int):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return list(LlamaForCausalLM(llama_config(layers, hidden)).parameters())


# ---------------------------------------------------------------------------- disk tier
def disk_reference_bandwidth(directory: str, nbytes: int, block: int = 4 << 20) -> dict:
    """The disk's own sequential bandwidth, `dd`-style: write `nbytes` in `block`-byte writes and
    fsync, drop the file's pages from the page cache (posix_fadvise DONTNEED; no root needed),
    read it back cold, then again warm (from the cache). Bytes per second."""
    path = os.path.join(directory, "dd-reference.bin")
    data = os.urandom(block)
    out = {}
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            left = nbytes
            while left > 0:
                left -= f.write(data[:min(block, left)])
            os.fsync(f.fileno())
        out["write"] = nbytes / (time.perf_counter() - start)
        for kind in ("read_cold", "read_warm"):
            with open(path, "rb", buffering=0) as f:
                if kind == "read_cold":
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                buf = bytearray(block)
                start = time.perf_counter()
                while f.readinto(buf):
                    pass
                out[kind] = nbytes / (time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return out


def _disk_model(args):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(args.disk_layers, args.disk_hidden))


def _disk_run(args, batch, **options) -> dict:
    """Train the disk bench's model with Gemini static, everything offloaded; times and the host
    pool's resident peak over boost and training."""
    import gc

    from phalanx.booster import Booster
    from phalanx.booster.plugins import GeminiPlugin
    from phalanx.observe.memory import PeakResident, resident_bytes

    gc.collect()
    base = resident_bytes()
    steps, opt_times, losses = [], [], []
    with PeakResident(interval=2e-3) as peak:
        model = _disk_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        plugin = GeminiPlugin(placement_policy="static", offload_param_frac=1.0, offload_optim_frac=1.0,
                              precision="fp32", chunk_size_mb=args.chunk_mb, **options)
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, opt)
        disk = plugin.manager.disk
        for i in range(args.steps + 1):
            if i == 1 and disk is not None:  # the untimed first step's I/O is not counted
                disk.store.stats.update({k: 0 for k in disk.store.stats})
                disk.stats.update(stall_s=0.0, write_wait_s=0.0)
            t0 = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            booster.backward(loss, opt)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            losses.append(loss.item())
            if i:
                steps.append(t2 - t0)
                opt_times.append(t2 - t1)
    m = plugin.manager
    from phalanx.gemini.placement import host_need

    n = len(m.chunks)
    out = {"losses": losses, "step_s": sorted(steps)[len(steps) // 2], "optim_step_s": sorted(opt_times)[len(opt_times) // 2],
           "host_resident": peak.max["shmem"] - base["shmem"], "host_accounted": m.tiers.peak_host,
           "disk_bytes": m.tiers.bytes["disk"], "params": sum(p.numel() for p in model.unwrapped.parameters()),
           "host_need_all_in_memory": sum(host_need(m.chunks, ["host"] * n, ["host"] * n, 0).values()),
           "host_need_all_on_disk": sum(host_need(m.chunks, ["host"] * n, ["disk"] * n, plugin.disk_prefetch).values()),
           "optim_chunks_on_disk": sum(c.optim_tier == "disk" for c in m.chunks), "chunks": n}
    if m.disk is not None:
        st = m.disk.store.stats
        out.update(directory=m.disk.store.directory, disk_io=dict(st), stall_s=m.disk.stats["stall_s"] / args.steps,
                   write_wait_s=m.disk.stats["write_wait_s"] / args.steps,
                   read_bw=st["bytes_read"] / st["read_s"] if st["read_s"] else None,
                   write_bw=st["bytes_written"] / st["write_s"] if st["write_s"] else None)
    del booster, plugin, model, opt
    gc.collect()
    return out


def disk_rank_main(args_dict: dict) -> dict:
    import tempfile

    from phalanx.gemini.tiers import parse_bytes

    args = argparse.Namespace(**args_dict)
    batch = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    memory = _disk_run(args, batch)
    disk_dir = args.disk_dir or tempfile.gettempdir()
    if args.host_budget == "auto":  # room for a quarter of the optimizer state besides the floor
        floor = memory["host_need_all_on_disk"]
        budget = floor + (memory["host_need_all_in_memory"] - floor) // 4
    else:
        budget = parse_bytes(args.host_budget, None, "--host-budget")
    options = dict(host_memory_budget=budget, offload_to_disk="auto", disk_dir=disk_dir)
    disk = _disk_run(args, batch, **options)
    cold = _disk_run(args, batch, disk_drop_cache=True, **options)
    reference = disk_reference_bandwidth(disk_dir, max(disk["disk_bytes"], 64 << 20))
    return {"memory": memory, "disk": disk, "disk_cold": cold, "dd": reference, "host_budget": budget,
            "disk_dir": disk_dir}


def print_disk(out: dict, args) -> None:
    MB = 1e6
    mem, budget = out["memory"], out["host_budget"]
    print(f"LLaMA {args.disk_layers} x {args.disk_hidden} ({mem['params'] / 1e6:.1f}M parameters), batch "
          f"{args.batch}x{args.seq}, fp32, chunks of {args.chunk_mb} MiB, static placement with everything offloaded; "
          f"host budget {budget / 2**20:.1f} MiB; disk dir {out['disk_dir']}")
    print(f"{'run':34s} {'step s':>8s} {'vs mem':>7s} {'optim s':>8s} {'wait r/w s':>11s} {'host peak MiB':>14s} "
          f"{'on disk MB':>11s} {'read MB/s':>10s} {'write MB/s':>11s}")
    for key, label in (("memory", "all in memory"), ("disk", "disk tier (page cache)"),
                       ("disk_cold", "disk tier (cache dropped, fsync)")):
        r = out[key]
        rb = f"{r['read_bw'] / MB:10.0f}" if r.get("read_bw") else f"{'-':>10s}"
        wb = f"{r['write_bw'] / MB:11.0f}" if r.get("write_bw") else f"{'-':>11s}"
        stall = f"{r['stall_s']:5.2f}/{r['write_wait_s']:5.2f}" if "stall_s" in r else f"{'-':>11s}"
        print(f"{label:34s} {r['step_s']:8.3f} {r['step_s'] / mem['step_s']:7.2f} {r['optim_step_s']:8.3f} {stall} "
              f"{r['host_resident'] / 2**20:14.1f} {r['disk_bytes'] / MB:11.1f} {rb} {wb}")
    print("(optim s: the optimizer step; wait r/w: of it, waiting for a chunk's read / for a write to free a buffer; "
          "read/write MB/s: bytes over the I/O threads' busy time, checksums included)")
    dd = out["dd"]
    print(f"disk's own (dd-style, {out['disk']['disk_bytes'] / MB:.0f} MB, 4 MiB blocks): write+fsync "
          f"{dd['write'] / MB:.0f} MB/s, read cold {dd['read_cold'] / MB:.0f} MB/s, read warm {dd['read_warm'] / MB:.0f} MB/s")
    same = max(abs(a - b) / abs(b) for a, b in zip(out["disk"]["losses"], mem["losses"], strict=True))
    print(f"losses disk vs memory: max relative difference {same:.1e}; host peak vs budget: "
          f"{out['disk']['host_resident'] / budget:.2f} (in memory it would be {mem['host_resident'] / budget:.2f})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="64MiB", help="device memory per rank")
    parser.add_argument("--world", type=int, default=None, help="ranks (default 2; --disk: 1)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one untimed)")
    parser.add_argument("--chunk-mb", type=float, default=None, help="Gemini chunk size (MiB; default 1, --disk: 4)")
    parser.add_argument("--ladder", type=int, default=len(LADDER), help="how many ladder sizes to try")
    parser.add_argument("--common", type=int, default=None,
                        help="ladder index of the common size for tokens/s (default: the largest all fit)")
    parser.add_argument("--plugins", nargs="+", default=list(PLUGINS), choices=PLUGINS)
    parser.add_argument("--disk", action="store_true", help="benchmark the disk tier instead (see the docstring)")
    parser.add_argument("--disk-layers", type=int, default=6)
    parser.add_argument("--disk-hidden", type=int, default=512)
    parser.add_argument("--disk-dir", default=None, help="directory of the disk tier (default: the temp dir)")
    parser.add_argument("--host-budget", default="auto",
                        help="host_memory_budget of the disk runs; auto: the host need with all optimizer state "
                             "on disk plus a quarter of the rest")
    args = parser.parse_args(argv)

    from phalanx.testing import spawn
    args.world = args.world or (1 if args.disk else 2)
    args.chunk_mb = args.chunk_mb or (4.0 if args.disk else 1.0)
    if args.disk:
        out = spawn(disk_rank_main, args.world, vars(args), timeout=3600)[0]
        print_disk(out, args)
        print("BENCH_JSON " + json.dumps({"bench": "gemini_disk", "world": args.world, "batch": args.batch,
                                          "seq": args.seq, **{k: v for k, v in out.items()}}, default=str), flush=True)
        return 0
    out = spawn(rank_main, args.world, vars(args), timeout=3600)[0]
    ddp = out["largest"].get("ddp", {}).get("params")
    ddp_speed = out["speed"].get("ddp", {}).get("tokens_per_s")
    print(f"budget {out['budget'] / 2**20:.0f} MiB per rank, {args.world} ranks, batch {args.batch}x{args.seq} per rank")
    print(f"{'plugin':40s} {'largest (layers x hidden)':>26s} {'params':>12s} {'vs DDP':>7s}   "
          f"tokens/s @ {out['common']['layers']}x{out['common']['hidden']}  vs DDP")
    for name in args.plugins:
        big = out["largest"].get(name)
        sp = out["speed"][name]
        size = f"{big['layers']} x {big['hidden']}" if big else "none"
        params = f"{big['params'] / 1e6:.2f}M" if big else "-"
        ratio = f"{big['params'] / ddp:.1f}x" if big and ddp else "-"
        tps = sp["tokens_per_s"]
        tps_s = f"{tps:9.0f}" if tps else "      n/a"
        tr = f"{tps / ddp_speed:.2f}" if tps and ddp_speed else "-"
        print(f"{LABELS[name]:40s} {size:>26s} {params:>12s} {ratio:>7s}   {tps_s}{'' if sp['fits'] else ' (over budget)'}  {tr}")
    print("BENCH_JSON " + json.dumps({"bench": "gemini", "world": args.world, "batch": args.batch, "seq": args.seq,
                                      **out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
