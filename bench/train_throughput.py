"""Training throughput of Phalanx against the plain-torch code it replaces, measured in one run.

Part 1 -- plugins, 2 gloo ranks (one CPU thread each), the same tiny Llama everywhere:
  tokens/s and peak memory per rank for raw torch DDP, raw FSDP2 (`fully_shard`), and our
  DDPPlugin, FSDPPlugin, ZeroPlugin stage 1 and 2, each through the Booster with the same forward,
  loss, AdamW and clipping. Ratios are against the raw baseline each plugin replaces (raw DDP for
  DDP and ZeRO, raw FSDP2 for FSDP) and against raw DDP. Target: no plugin more than 5% slower
  than its baseline. Timing runs all variants in one set of processes, round-robin, and reports
  each variant's best step (wall clock) and its CPU time per step: on a machine shared with other
  processes the CPU time is the figure to compare, and the target column uses it when the load
  average exceeds the cores; peak memory comes from a fresh
  phase before it, one variant at a time (on CPU the growth of the resident set's high-water mark
  over the RSS before the variant was built, with freed memory returned to the OS in between; on
  GPU the allocator's high-water mark).

Part 2 -- one process: `phalanx.train.fit` on a Llama of hidden 512, 8 layers, seq 512, batch 4
  (vocab 32000) in fp32 and bf16, against a plain Hugging Face training loop (`model(...).loss`,
  AdamW, clipping; `torch.autocast` for bf16), with achieved model FLOP/s against this machine's
  GEMM peak, measured in the same run with a large matmul in each dtype. Each loop runs one
  untimed step, then `--single-steps` timed ones; the best step is reported.

    python bench/train_throughput.py            # both parts (~5-10 min on 2 CPU cores)
    python bench/train_throughput.py --part plugins --steps 5 --rounds 3
    python bench/train_throughput.py --smoke    # every part at its smallest, tiny Llama: does it run (~20 s)

Part 3 (`--model medium|large`, or both: `--model medium,large`) -- the plugins on a real-sized
  Llama, 2 gloo ranks x 1 thread, 4 x 64 tokens per rank, AdamW, clipping at 1.0, fp32 (or
  `--precision-sized bf16`: the plugins' precision="bf16", i.e. bf16 compute with fp32 masters; raw
  DDP under `torch.autocast`, raw FSDP2 with `MixedPrecisionPolicy(bf16, reduce fp32)`):
  medium = hidden 512, 4 layers, vocab 8192 (~21M parameters); large = hidden 1024, 8 layers
  (~118M). Our DDPPlugin, ZeroPlugin stage 1/2 and FSDPPlugin against raw torch DDP and raw
  `fully_shard` (and DDPPlugin with the user's AdamW(fused=True), the kernel ZeRO and FSDPPlugin
  pick by default, to separate the kernel's share of their gain), plus DeepSpeed ZeRO-1/2 when `deepspeed` is importable (never required). Each
  variant is built alone (one at a time, so the large model fits), runs `--steps` steps (default
  20), and reports the median of steps 2..N; `--launches` repeats the whole measurement in fresh
  processes and takes the median of the launches' medians. The table splits the step into
  forward, backward, reduce (gradient reduction still in flight after backward), norm/clip,
  optimizer and gather (ZeRO's parameter all-gather), gives ratios against our DDPPlugin, the
  optimizer state per rank, the CPU kind and the load average.

    python bench/train_throughput.py --model medium --launches 3
    python bench/train_throughput.py --model medium,large --steps-sized 8
    python bench/train_throughput.py --model medium --variants ddp,fsdp --interleave --steps-sized 25

`--interleave` builds every variant in the same two ranks and steps them in turn (step i of each,
the order reversed every other round), so a machine whose speed drifts during the run (shared
hosts: up to 1.5x within a session) slows all variants alike; every variant stays resident, so
keep it to the medium model or a few variants of the large one.

Prints the tables and one `BENCH_JSON {...}` line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from timing import cpu_kind, time_round_robin  # bench/timing.py

PLUGIN_VARIANTS = ("raw_ddp", "raw_fsdp2", "ddp", "fsdp", "zero1", "zero2")
BASELINE_OF = {"ddp": "raw_ddp", "fsdp": "raw_fsdp2", "zero1": "raw_ddp", "zero2": "raw_ddp"}
LABELS = {"raw_ddp": "torch DDP (raw)", "raw_fsdp2": "torch FSDP2 (raw)", "ddp": "DDPPlugin",
          "fsdp": "FSDPPlugin", "zero1": "ZeroPlugin stage 1", "zero2": "ZeroPlugin stage 2"}
TOLERANCE = 0.05  # the target: at most 5% slower than the baseline


# =============================================================================================
# Part 1: plugins on 2 ranks

def tiny_config():
    """The plugin benchmark's model: the test suite's tiny Llama family, sized so one step is
    mostly compute (~1.2M parameters) while 2 ranks x 1 thread still fit on a 2-core laptop."""
    from phalanx.testing import tiny_llama_config
    return tiny_llama_config(vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _batch(rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _raw_step(module, x):
    """One plain-torch training step of a wrapped model (the baselines' AdamW + clipping)."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01)

    def step():
        module(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def build_variant(name: str, batch: int, seq: int):
    """A ready-to-call `step()` for one variant: forward, loss, backward, clip to 1.0, AdamW."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from phalanx.launch import context

    config = tiny_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    rank = dist.get_rank()
    x = _batch(rank, batch, seq, config.vocab_size).to(context().device)

    if name == "raw_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        with warnings.catch_warnings():  # the same settings as DDPPlugin; the argument is being renamed
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
        return _raw_step(ddp, x)

    if name == "raw_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(context().device.type, (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _raw_step(model, x)

    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    booster = Booster(make_plugin(name, precision="fp32", max_norm=1.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    boosted, opt, *_ = booster.boost(model, opt)

    def step():
        booster.backward(boosted(input_ids=x, labels=x).loss, opt)
        opt.step()
        opt.zero_grad()
    return step


def available(name: str) -> bool:
    """Whether the plugin's module is in the tree (plugins land at different times)."""
    if name.startswith("raw_"):
        return True
    import importlib
    module = {"ddp": "ddp", "fsdp": "fsdp", "zero1": "zero", "zero2": "zero"}[name]
    try:
        importlib.import_module(f"phalanx.booster.plugins.{module}")
        return True
    except ImportError:
        return False


def rank_memory(variants: list[str], batch: int, seq: int, steps: int) -> dict[str, int]:
    """Per rank: peak memory growth while building and training each variant, one at a time, with
    freed memory handed back to the OS in between (a throwaway first run pays the one-time
    costs: lazy imports, thread pools, communication buffers)."""
    from phalanx.launch import context
    from phalanx.observe import current_memory_bytes, peak_memory_bytes, release_free_memory, reset_peak_memory

    device = context().device
    out = {}
    for name in [variants[0], *variants]:
        release_free_memory()
        reset_peak_memory(device)
        before = current_memory_bytes(device)
        step = build_variant(name, batch, seq)
        for _ in range(steps):
            step()
        out[name] = peak_memory_bytes(device) - before
        del step
    return out


def rank_timing(variants: list[str], batch: int, seq: int, steps: int, rounds: int, warmup: int):
    """Per rank: build every variant, then time each step of each variant, round-robin.

    Wall time runs from a barrier to the barrier after the step (the slower rank sets the pace);
    CPU time is this process's (all threads) for the step alone, which other processes on the
    machine inflate much less than they inflate wall time."""

    steps_of = {name: build_variant(name, batch, seq) for name in variants}
    for step in steps_of.values():
        for _ in range(warmup):
            step()
    wall, cpu = time_round_robin(steps_of, rounds, steps)
    return {"wall": wall, "cpu": cpu}


def rank_bench(variants: list[str], batch: int, seq: int, steps: int, rounds: int, warmup: int):
    memory = rank_memory(variants, batch, seq, steps=3)
    return {"memory": memory, "times": rank_timing(variants, batch, seq, steps, rounds, warmup)}


def run_plugins(args) -> dict:
    from phalanx.testing import spawn

    variants = [v for v in PLUGIN_VARIANTS if available(v)]
    missing = [v for v in PLUGIN_VARIANTS if v not in variants]
    print(f"\n== plugins: 2 gloo ranks x 1 thread, tiny Llama, batch {args.batch}/rank x seq {args.seq}, "
          f"{args.rounds} rounds x {args.steps} steps ==", flush=True)
    t0 = time.perf_counter()
    per_rank = spawn(rank_bench, 2, variants, args.batch, args.seq, args.steps, args.rounds, args.warmup,
                     timeout=1800, threads=1)
    print(f"   measured in {time.perf_counter() - t0:.0f} s", flush=True)
    tokens_per_step = 2 * args.batch * args.seq
    rows = {}
    for name in variants:
        # The best step: the one other processes disturbed least. Every variant gets the same
        # number of chances, interleaved, so a noisy neighbour cannot favour one of them.
        wall = [max(ts) for ts in zip(*(r["times"]["wall"][name] for r in per_rank))]
        cpu = [sum(ts) for ts in zip(*(r["times"]["cpu"][name] for r in per_rank))]
        rows[name] = {"step_ms": min(wall) * 1e3, "tokens_per_s": tokens_per_step / min(wall),
                      "cpu_ms_per_step": min(cpu) * 1e3, "median_step_ms": statistics.median(wall) * 1e3,
                      "peak_mem_mib": max(r["memory"][name] for r in per_rank) / 2**20}
    busy = machine_busy()
    base = rows.get("raw_ddp")
    for name, row in rows.items():
        row["vs_raw_ddp"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        ref = rows.get(BASELINE_OF.get(name, ""))
        row["vs_baseline"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        row["cpu_vs_baseline"] = ref["cpu_ms_per_step"] / row["cpu_ms_per_step"] if ref else None
        decisive = row["cpu_vs_baseline"] if busy else row["vs_baseline"]
        row["meets_target"] = (decisive >= 1 - TOLERANCE) if ref else None
    print_plugin_table(rows, missing)
    if busy:
        print(f"   note: the machine was busy ({busy}); wall-clock ratios are unreliable, so the target column "
              "uses CPU time per step (lower CPU time = higher ratio)")
    return {"rows": rows, "missing": missing, "batch_per_rank": args.batch, "seq": args.seq,
            "steps": args.steps, "rounds": args.rounds, "busy": busy}


def machine_busy() -> str | None:
    """A description of the load if other processes compete for the cores, else None."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cpus = os.cpu_count() or 1
    return f"1-min load average {load:.1f} on {cpus} cores" if load > 1.25 * cpus else None


def print_plugin_table(rows: dict, missing: list[str]) -> None:
    print(f"{'variant':<22}{'step ms':>9}{'tokens/s':>10}{'vs raw DDP':>12}{'vs baseline':>13}"
          f"{'CPU ms/step':>13}{'CPU vs base':>13}{'peak MiB/rank':>15}  target")
    for name in PLUGIN_VARIANTS:
        if name in missing:
            print(f"{LABELS[name]:<22}  missing (not in the tree yet)")
            continue
        r = rows[name]
        vs_base = f"{r['vs_baseline']:.3f}x" if r["vs_baseline"] is not None else "-"
        cpu_base = f"{r['cpu_vs_baseline']:.3f}x" if r["cpu_vs_baseline"] is not None else "-"
        target = {True: "ok", False: "SLOWER >5%", None: "baseline"}[r["meets_target"]]
        print(f"{LABELS[name]:<22}{r['step_ms']:>9.1f}{r['tokens_per_s']:>10.0f}{r['vs_raw_ddp']:>11.3f}x"
              f"{vs_base:>13}{r['cpu_ms_per_step']:>13.1f}{cpu_base:>13}{r['peak_mem_mib']:>15.1f}  {target}")


# =============================================================================================
# Part 3: the plugins on a real-sized model (--model medium|large)

SIZED_VARIANTS = ("ddp", "ddp_fused", "ddp_loop", "raw_ddp", "zero1", "zero2", "zero2_allreduce", "zero2_prefetch",
                  "fsdp", "fsdp_sync", "fsdp_allreduce", "fsdp_noprefetch",
                  "raw_fsdp2", "ds_zero1", "ds_zero2")
SIZED_LABELS = {**LABELS, "ddp_fused": "DDPPlugin, fused AdamW",
                "ddp_loop": "DDPPlugin, per-tensor AdamW", "zero2_prefetch": "ZeRO-2, gather in fwd",
                "fsdp_noprefetch": "FSDPPlugin, no fwd prefetch",
                "zero2_allreduce": "ZeRO-2, all-reduce", "fsdp_allreduce": "FSDPPlugin, all-reduce",
                "fsdp_sync": "FSDPPlugin, sync reduce",
                "ds_zero1": "DeepSpeed ZeRO-1", "ds_zero2": "DeepSpeed ZeRO-2"}
PHASES = ("forward", "backward", "reduce", "norm", "optimizer", "gather")
MODEL_SIZES = {"medium": (512, 4), "large": (1024, 8)}  # hidden, layers


def sized_config(size: str):
    """Llama with vocabulary 8192; intermediate = hidden x 2.6875 (1376 at 512), 64-wide heads."""
    from transformers import LlamaConfig
    hidden, layers = MODEL_SIZES[size]
    return LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       max_position_embeddings=256, attn_implementation="sdpa", tie_word_embeddings=False)


def deepspeed_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


class _PhaseClock:
    """Times the inner torch optimizer's `step` of a wrapped optimizer (the optimizer phase)."""

    def __init__(self, optimizer):
        self.seconds = 0.0
        inner = optimizer.step

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        optimizer.step = timed


def _state_bytes(optimizer) -> int:
    """Bytes of optimizer state tensors this rank holds (the local shard of a DTensor)."""
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


# sized bench variant -> (make_plugin name, plugin options); the others are the plugin's own name
SIZED_PLUGIN_OPTIONS = {
    "ddp_fused": ("ddp", {}), "ddp_loop": ("ddp", {}),  # the optimizer differs (build_sized_variant)
    "zero2_prefetch": ("zero2", {"overlap_param_gather": True}),
    "zero2_allreduce": ("zero2", {"grad_collective": "all_reduce"}),
    "fsdp_allreduce": ("fsdp", {"grad_collective": "all_reduce"}),
    "fsdp_noprefetch": ("fsdp", {"forward_prefetch": False}),
    "fsdp_sync": ("fsdp", {"overlap_reduce": False}),
}


def build_sized_variant(name: str, size: str, batch: int, seq: int, precision: str = "fp32"):
    """(step, state_optimizer) where `step()` runs one training step and returns its phases in
    seconds (forward, backward, reduce, norm, optimizer, gather; None where the phase is not
    separate: DDP reduces inside backward, FSDP gathers inside forward and backward)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(sized_config(size))
    x = _batch(dist.get_rank(), batch, seq, 8192)
    clock = time.perf_counter
    bf16 = precision == "bf16"

    if name.startswith("raw_"):
        if name == "raw_ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                module = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.fsdp import MixedPrecisionPolicy
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, **mp)
            module = fully_shard(model, mesh=mesh, **mp)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01)

        autocast = bf16 and name == "raw_ddp"  # raw FSDP2 casts through its policy

        def raw_step():
            t0 = clock()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = module(input_ids=x, labels=x).loss
            t1 = clock()
            loss.backward()
            t2 = clock()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            t3 = clock()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = clock()
            return {"forward": t1 - t0, "backward": t2 - t1, "reduce": None, "norm": t3 - t2, "optimizer": t4 - t3,
                    "gather": None}
        return raw_step, opt

    if name.startswith("ds_"):
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": int(name[-1])}, "bf16": {"enabled": bf16}}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        engine, ds_opt, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def ds_step():
            t0 = clock()
            loss = engine(input_ids=x, labels=x).loss
            t1 = clock()
            engine.backward(loss)
            t2 = clock()
            engine.step()
            t3 = clock()
            return {"forward": t1 - t0, "backward": t2 - t1, "reduce": None, "norm": None, "optimizer": t3 - t2,
                    "gather": None}
        return ds_step, opt

    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    # ddp_fused: DDPPlugin with the user asking for AdamW(fused=True); on CPU DDPPlugin picks that
    # kernel by itself since 2026-12-03, as ZeRO and FSDPPlugin do. ddp_loop: the user asking for
    # AdamW(foreach=False), torch's per-tensor loop: DDPPlugin's CPU step before that date.
    # zero2_prefetch: ZeroPlugin(overlap_param_gather=True), the parameter publication overlapped
    # with the next forward. zero2_allreduce: ZeroPlugin(grad_collective="all_reduce"), gloo's
    # default before 2026-12-03 (now an all-to-all, the bytes of a reduce-scatter); fsdp_allreduce the
    # same for FSDPPlugin. fsdp_noprefetch: FSDPPlugin(forward_prefetch=False), each block gathered
    # only when it starts (the default before 2026-12-03, session 11). fsdp_sync:
    # FSDPPlugin(overlap_reduce=False), each block's gradient all-reduce waited for on the compute
    # thread (the default leaves it running during backward).
    plugin_name, options = SIZED_PLUGIN_OPTIONS.get(name, (name, {}))
    plugin = make_plugin(plugin_name, precision=precision, max_norm=1.0, **options)
    booster = Booster(plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=name.endswith("_fused") or None,
                            foreach=False if name.endswith("_loop") else None)
    boosted, wrapped, *_ = booster.boost(model, opt)
    inner = _PhaseClock(wrapped.optim)

    def plugin_step():
        t0 = clock()
        loss = boosted(input_ids=x, labels=x).loss
        t1 = clock()
        booster.backward(loss, wrapped)
        t2 = clock()
        inner.seconds = 0.0
        wrapped.step()
        wrapped.zero_grad()
        t3 = clock()
        phases = getattr(wrapped, "step_phases", None)  # ZeroOptimizer splits its own step
        if phases:
            return {"forward": t1 - t0, "backward": t2 - t1, **phases}
        return {"forward": t1 - t0, "backward": t2 - t1, "reduce": None, "norm": t3 - t2 - inner.seconds,
                "optimizer": inner.seconds, "gather": None}
    return plugin_step, wrapped.optim


def _build_or_error(name: str, size: str, batch: int, seq: int, precision: str):
    """(step, state_optimizer), or {"error": ...} for an optional peer (DeepSpeed) that cannot run here."""
    try:
        return build_sized_variant(name, size, batch, seq, precision)
    except Exception as err:
        if not name.startswith("ds_"):
            raise
        return {"error": f"{type(err).__name__}: {err}"[:200]}


def _timed_step(step, record: dict) -> None:
    """One step between barriers (the slower rank sets the pace): its wall and CPU time and phases."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    record["phases"].append(step())
    c1 = time.process_time()
    dist.barrier()
    record["wall"].append(time.perf_counter() - t0)
    record["cpu"].append(c1 - c0)


def rank_sized(variants: list[str], size: str, batch: int, seq: int, steps: int, precision: str = "fp32") -> dict:
    """Per rank: each variant alone (built, `steps` steps, freed); per-step wall time (barrier to
    barrier: the slower rank sets the pace) and this rank's phases."""
    import gc

    out = {}
    for name in variants:
        built = _build_or_error(name, size, batch, seq, precision)
        if isinstance(built, dict):
            out[name] = built
            continue
        step, state_opt = built
        out[name] = record = {"wall": [], "cpu": [], "phases": []}
        for _ in range(steps):
            _timed_step(step, record)
        record["state_bytes"] = _state_bytes(state_opt)
        del built, step, state_opt
        gc.collect()
    return out


def rank_sized_interleaved(variants: list[str], size: str, batch: int, seq: int, steps: int,
                           precision: str = "fp32") -> dict:
    """Per rank, as `rank_sized`, but every variant is built first and the steps go round-robin
    (step i of each variant, in reverse order every other round): a machine whose speed drifts
    during the run slows every variant alike, so their ratios hold where sequential runs differed
    by up to 1.5x (session 12). Every variant's model and optimizer state stay resident at once:
    fine for the medium model, about 2 GiB per variant and rank for the large one."""
    built = {name: _build_or_error(name, size, batch, seq, precision) for name in variants}
    runnable = [name for name in variants if not isinstance(built[name], dict)]
    out = {name: built[name] if name not in runnable else {"wall": [], "cpu": [], "phases": []} for name in variants}
    for i in range(steps):
        for name in (runnable if i % 2 == 0 else runnable[::-1]):
            _timed_step(built[name][0], out[name])
    for name in runnable:  # the optimizer state exists after the first step
        out[name]["state_bytes"] = _state_bytes(built[name][1])
    return out


def _median_after_first(values: list[float]) -> float:
    """The median of steps 2..N (step 1 pays the lazy set-up: optimizer state, buffers)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def run_sized(args, size: str) -> dict:
    from phalanx.testing import spawn

    chosen = args.variants.split(",") if args.variants else SIZED_VARIANTS
    unknown = [v for v in chosen if v not in SIZED_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants {','.join(unknown)}: choose from {','.join(SIZED_VARIANTS)}")
    variants = [v for v in SIZED_VARIANTS if v in chosen and (not v.startswith("ds_") or deepspeed_available())]
    print(f"\n== plugins on the {size} Llama (hidden {MODEL_SIZES[size][0]}, {MODEL_SIZES[size][1]} layers, vocab 8192): "
          f"2 gloo ranks x 1 thread, {args.batch_sized} x {args.seq_sized} tokens/rank, AdamW {args.precision_sized}, clip 1.0, "
          f"median of steps 2..{args.steps_sized}, {args.launches} launch(es)"
          f"{', variants interleaved step by step' if args.interleave else ''} ==", flush=True)
    if not deepspeed_available():
        print("   DeepSpeed not installed: its ZeRO-1/2 columns are left out (optional peer)", flush=True)
    launches = []
    for i in range(args.launches):
        order = variants[i % len(variants):] + variants[:i % len(variants)]  # rotate: load drift hits all alike
        load0 = _loadavg()
        t0 = time.perf_counter()
        body = rank_sized_interleaved if args.interleave else rank_sized
        per_rank = spawn(body, 2, order, size, args.batch_sized, args.seq_sized, args.steps_sized,
                         args.precision_sized, timeout=3600, threads=1)
        print(f"   launch {i + 1}: {time.perf_counter() - t0:.0f} s, load average {load0} -> {_loadavg()}", flush=True)
        launches.append(per_rank)
    rows = {}
    for name in variants:
        results = [[r[name] for r in per_rank] for per_rank in launches]
        if any("error" in r for res in results for r in res):
            rows[name] = {"error": next(r["error"] for res in results for r in res if "error" in r)}
            continue
        medians, cpu_medians, phase_medians = [], [], {p: [] for p in PHASES}
        for res in results:
            wall = [max(ts) for ts in zip(*(r["wall"] for r in res))]
            medians.append(_median_after_first(wall) * 1e3)
            cpu_medians.append(_median_after_first([max(ts) for ts in zip(*(r["cpu"] for r in res))]) * 1e3)
            for p in PHASES:
                values = [max(ph[p] for ph in step) if step[0][p] is not None else None
                          for step in zip(*(r["phases"] for r in res))]
                if values[0] is not None:
                    phase_medians[p].append(_median_after_first(values) * 1e3)
        rows[name] = {"step_ms": statistics.median(medians), "launch_ms": medians,
                      "cpu_ms": statistics.median(cpu_medians),
                      "phases_ms": {p: statistics.median(v) if v else None for p, v in phase_medians.items()},
                      "state_mib_per_rank": max(r["state_bytes"] for r in results[0]) / 2**20}
    base, cpu_base = rows.get("ddp", {}).get("step_ms"), rows.get("ddp", {}).get("cpu_ms")
    for row in rows.values():
        if "step_ms" in row and base:
            row["vs_ddp_plugin"] = row["step_ms"] / base
            row["cpu_vs_ddp_plugin"] = row["cpu_ms"] / cpu_base
    raw_fsdp = rows.get("raw_fsdp2", {})
    if "step_ms" in raw_fsdp and "step_ms" in rows.get("fsdp", {}):
        rows["fsdp"]["vs_raw_fsdp2"] = rows["fsdp"]["step_ms"] / raw_fsdp["step_ms"]
        rows["fsdp"]["cpu_vs_raw_fsdp2"] = rows["fsdp"]["cpu_ms"] / raw_fsdp["cpu_ms"]
    print_sized_table(rows, variants)
    busy = machine_busy()
    if busy:
        print(f"   measured under load ({busy}): other processes shared the cores; compare ratios, and re-measure "
              "on a quiet machine before quoting times", flush=True)
    return {"size": size, "precision": args.precision_sized, "rows": rows, "busy": busy, "steps": args.steps_sized, "launches": args.launches,
            "batch_per_rank": args.batch_sized, "seq": args.seq_sized}


def print_sized_table(rows: dict, variants: list[str]) -> None:
    head = "".join(f"{p:>10}" for p in PHASES)
    print(f"{'variant':<22}{'ms/step':>9}{'launches':>18}{'vs DDPPlugin':>14}{'CPU ms':>9}{'CPU vs DDP':>12}"
          f"{head}{'opt state MiB':>15}")
    for name in variants:
        r = rows[name]
        if "error" in r:
            print(f"{SIZED_LABELS[name]:<22}  could not run: {r['error']}")
            continue
        spread = "/".join(f"{v:.0f}" for v in r["launch_ms"])
        phases = "".join(f"{r['phases_ms'][p]:>10.0f}" if r["phases_ms"][p] is not None else f"{'-':>10}"
                         for p in PHASES)
        print(f"{SIZED_LABELS[name]:<22}{r['step_ms']:>9.0f}{spread:>18}{r.get('vs_ddp_plugin', float('nan')):>13.2f}x"
              f"{r['cpu_ms']:>9.0f}{r.get('cpu_vs_ddp_plugin', float('nan')):>11.2f}x{phases}"
              f"{r['state_mib_per_rank']:>15.1f}")
    if "vs_raw_fsdp2" in rows.get("fsdp", {}):
        print(f"   FSDPPlugin / raw fully_shard: {rows['fsdp']['vs_raw_fsdp2']:.2f}x wall, "
              f"{rows['fsdp']['cpu_vs_raw_fsdp2']:.2f}x CPU")
    print("   ms/step: wall clock, barrier to barrier; CPU ms: the busier rank's process CPU time per step (its "
          "communication threads included), what to compare when other processes share the cores. Phases: wall "
          "ms of the slower rank; '-' = not a separate phase (DDP reduces inside backward, FSDP gathers inside "
          "forward and backward); norm = gradient norm + clipping")


# =============================================================================================
# Part 2: one process, phalanx.train vs plain Hugging Face, fp32 and bf16

SINGLE_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8)
# --smoke: the smallest Llama that runs the same code, to check the bench runs (numbers meaningless)
SMOKE_SINGLE_MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4)


def llama_512_config(**sizes):
    """Part 2's Llama (SINGLE_MODEL), or the sizes given."""
    from transformers import LlamaConfig
    return LlamaConfig(**{**SINGLE_MODEL, **sizes}, max_position_embeddings=512, attn_implementation="sdpa",
                       tie_word_embeddings=False)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i]}


def hf_step_times(precision: str, batch: int, seq: int, steps: int, sizes: dict) -> list[float]:
    """The plain loop a user would write: fp32 weights; bf16 via autocast. Seconds per step."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_512_config(**sizes))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, betas=(0.9, 0.95))
    data = RandomTokens(batch * steps, seq, model.config.vocab_size).x
    times = []
    for i in range(steps):
        x = data[i * batch:(i + 1) * batch]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def phalanx_step_times(precision: str, batch: int, seq: int, steps: int, sizes: dict) -> list[float]:
    """`phalanx.train.fit` on the same model and data; seconds per step from its metrics file."""
    from transformers import LlamaForCausalLM

    from phalanx.observe import read_metrics
    from phalanx.train import TrainConfig, fit

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_512_config(**sizes))
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as out:
        cfg = TrainConfig(output_dir=out, max_steps=steps, micro_batch_size=batch, lr=1e-4, weight_decay=0.01,
                          precision=precision, plugin="ddp", progress_bar=False, plot=False, peak_tflops=0,
                          resume=False, keep_last=1, log_every=1)
        result = fit(cfg, model, RandomTokens(batch * steps, seq, model.config.vocab_size))
        return [r["step_time_s"] for r in read_metrics(result.metrics_path) if "step_time_s" in r]


def single_precisions(choice: str) -> tuple[str, ...]:
    """The dtypes part 2 measures. `auto`: fp32, plus bf16 where this CPU computes it natively (an
    emulated bf16 step of this model takes minutes, and no user would train that way)."""
    from phalanx_kernels.capability import cpu_bf16_support

    if choice != "auto":
        return tuple(choice.split(","))
    cpu = cpu_bf16_support()
    if cpu.native:
        return ("fp32", "bf16")
    print(f"   bf16 skipped: {cpu.reason} (pass --single-precisions fp32,bf16 to time it anyway)", flush=True)
    return ("fp32",)


def run_single(args) -> dict:
    from phalanx.launch import context
    from phalanx.observe import causal_lm_flops_per_token, measure_matmul_flops
    from transformers import LlamaForCausalLM

    context()  # one-rank group; uses every core
    threads = torch.get_num_threads()
    sizes = SMOKE_SINGLE_MODEL if args.smoke else SINGLE_MODEL
    print(f"\n== one process ({threads} threads): Llama hidden {sizes['hidden_size']} x {sizes['num_hidden_layers']} "
          f"layers, vocab {sizes['vocab_size']}, seq {args.single_seq}, "
          f"batch {args.single_batch} ==", flush=True)
    precisions = single_precisions(args.single_precisions)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peak = {p: measure_matmul_flops("cpu", dtypes[p], size=2048, min_seconds=1.0) for p in precisions}
    print("   GEMM peak (2048^3 matmul): " + ", ".join(f"{p} {peak[p] / 1e9:.0f} GFLOP/s" for p in precisions),
          flush=True)
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(llama_512_config(**sizes))
    flops_per_token = causal_lm_flops_per_token(meta_model, args.single_seq)
    rows = {}
    tokens_per_step = args.single_batch * args.single_seq
    for precision in precisions:
        steps = args.single_steps + 1  # the first step (lazy initialisation) is not timed
        for who, measure in (("hf", hf_step_times), ("phalanx", phalanx_step_times)):
            t0 = time.perf_counter()
            times = measure(precision, args.single_batch, args.single_seq, steps, sizes)[1:]
            # the best step: the one other processes on this machine disturbed least
            tps = tokens_per_step / min(times)
            achieved = tps * flops_per_token
            rows[f"{who}_{precision}"] = {"tokens_per_s": tps, "gflops": achieved / 1e9,
                                          "of_gemm_peak": achieved / peak[precision],
                                          "step_s": [round(t, 3) for t in times]}
            print(f"   {who:>8} {precision}: {tps:8.0f} tokens/s, steps {rows[f'{who}_{precision}']['step_s']} s "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    hf32 = rows["hf_fp32"]["tokens_per_s"] if "fp32" in precisions else None
    print(f"{'loop':<28}{'tokens/s':>10}{'vs HF fp32':>12}{'vs HF same dtype':>18}{'GFLOP/s':>10}{'of GEMM peak':>14}")
    for key, label in (("hf_fp32", "Hugging Face loop, fp32"), ("phalanx_fp32", "phalanx.train, fp32"),
                       ("hf_bf16", "Hugging Face + autocast bf16"), ("phalanx_bf16", "phalanx.train, bf16")):
        if key not in rows:
            continue
        r = rows[key]
        same = rows["hf_" + key.split("_")[1]]["tokens_per_s"]
        r["vs_hf_fp32"] = r["tokens_per_s"] / hf32 if hf32 else None
        r["vs_hf_same_dtype"] = r["tokens_per_s"] / same
        vs32 = f"{r['vs_hf_fp32']:>11.2f}x" if hf32 else f"{'-':>12}"
        print(f"{label:<28}{r['tokens_per_s']:>10.0f}{vs32}{r['vs_hf_same_dtype']:>17.2f}x"
              f"{r['gflops']:>10.1f}{r['of_gemm_peak']:>13.1%}")
    return {"rows": rows, "gemm_peak_gflops": {k: v / 1e9 for k, v in peak.items()},
            "flops_per_token": flops_per_token, "threads": threads, "batch": args.single_batch, "seq": args.single_seq}


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "plugins", "single", "models"), default=None,
                        help="default: all, or models when --model is given")
    parser.add_argument("--model", default=None,
                        help="models part: medium, large or medium,large (real-sized Llama, per-phase split)")
    parser.add_argument("--launches", type=int, default=1, help="models part: fresh launches (median of medians)")
    parser.add_argument("--steps-sized", type=int, default=20, help="models part: steps per variant (median of 2..N)")
    parser.add_argument("--interleave", action="store_true",
                        help="models part: build every variant in the same ranks and step them in turn (ratios "
                             "that hold on a machine whose speed drifts; all variants resident at once)")
    parser.add_argument("--variants", default=None,
                        help=f"models part: comma-separated subset of {','.join(SIZED_VARIANTS)}")
    parser.add_argument("--batch-sized", type=int, default=4, help="models part: sequences per rank")
    parser.add_argument("--precision-sized", choices=("fp32", "bf16"), default="fp32",
                        help="models part: fp32, or bf16 compute with fp32 masters (meant for a CPU with native bf16)")
    parser.add_argument("--seq-sized", type=int, default=64, help="models part: tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="plugins: micro-batch per rank")
    parser.add_argument("--seq", type=int, default=128, help="plugins: sequence length")
    parser.add_argument("--steps", type=int, default=5, help="plugins: timed steps per variant per round (the best step is reported)")
    parser.add_argument("--rounds", type=int, default=5, help="plugins: round-robin rounds")
    parser.add_argument("--warmup", type=int, default=2, help="plugins: untimed steps per variant")
    parser.add_argument("--single-batch", type=int, default=4)
    parser.add_argument("--single-seq", type=int, default=512)
    parser.add_argument("--single-precisions", default="auto",
                        help="comma-separated fp32,bf16; auto: bf16 only where the CPU runs it natively")
    parser.add_argument("--single-steps", type=int, default=2, help="timed steps per loop and dtype (best is reported)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run of every part (a tiny Llama in part 2): checks that the bench runs; "
                             "its numbers mean nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.steps, args.rounds, args.warmup = 2, 32, 1, 1, 1
        args.single_batch, args.single_seq, args.single_steps, args.single_precisions = 1, 32, 1, "fp32"
        args.launches, args.steps_sized, args.batch_sized, args.seq_sized = 1, 2, 1, 16
    if args.part is None:
        args.part = "models" if args.model else "all"
    sizes = [m.strip() for m in (args.model or "medium").split(",") if m.strip()]
    unknown = [m for m in sizes if m not in MODEL_SIZES]
    if unknown:
        parser.error(f"--model {','.join(unknown)}: choose from {', '.join(MODEL_SIZES)} (comma-separated for both)")
    if args.launches < 1 or args.steps_sized < 2:
        parser.error("--launches must be at least 1 and --steps-sized at least 2 (step 1 is not counted)")

    started = time.perf_counter()
    from phalanx_kernels.capability import cpu_bf16_support

    cpu = cpu_bf16_support()
    out = {"bench": "train_throughput", "torch": torch.__version__, "cpus": os.cpu_count(),
           "cpu_capability": cpu.capability, "cpu_bf16": "native" if cpu.native else "emulated",
           "loadavg_start": _loadavg()}
    out["cpu_model"] = cpu_kind()
    print(f"CPU: {out['cpu_model']}, {cpu.capability}, bf16 {'native' if cpu.native else 'emulated'} ({cpu.reason}); "
          f"1-min load average {out['loadavg_start']} on {os.cpu_count()} cores", flush=True)
    if args.part in ("all", "plugins"):
        out["plugins"] = run_plugins(args)
    if args.part in ("all", "single"):
        out["single_process"] = run_single(args)
    if args.part == "models":
        out["models"] = {size: run_sized(args, size) for size in sizes}
    out["wall_s"] = time.perf_counter() - started
    out["loadavg_end"] = _loadavg()
    print("BENCH_JSON " + json.dumps(out), flush=True)
    from phalanx.launch import shutdown
    shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import this file by name
    sys.exit(main())
