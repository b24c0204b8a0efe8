"""Evoformer forward + backward (or, with --inference, the forward pass `predict` runs): time and
peak memory against sequence length, one process against Dynamic Axial Parallelism on 2 ranks,
with and without chunking (attention, outer product mean and triangle multiplications `--chunk`
rows at a time); and the longest sequence that fits a memory budget either way, from a fit of the
measured peaks.

    python bench/protein.py                                   # CPU defaults: small channels, short sequences
    python bench/protein.py --lengths 64 128 256 384 --c-m 256 --c-z 128 --chunk 64 --budget-gb 40   # a GPU
    python bench/protein.py --template-cache --lengths 64 --templates 4 --recycles 3   # the template cache

`--template-cache` times one sample through the whole model with templates (tiny.yaml's trunk,
AlphaFold's template stack sizes, or `--config`), its recycling passes included, with the
template embedding cached across passes (`model.template.cache`, the default) and without: the
no-grad forward `predict` runs and a training step's forward + backward (the passes before the
last without gradients). Time only, one process.

The fit's form: unchunked, peak = a + b L^2 + c L^3 -- the pair representation and everything of
its size grow as L^2, and triangle attention's logits [L, heads, L, L] (kept for the backward
pass) as L^3; chunked, peak = a + b L^2, since no tensor then holds more than `chunk` rows of
them (under autograd the chunks are checkpointed). Least squares through all measured lengths;
with fewer lengths than terms the highest terms are dropped (and the line says so).

Each configuration runs in fresh processes (phalanx.testing.spawn: one thread per rank on CPU),
so the peak memory is that configuration's own: CUDA's max_memory_allocated on a GPU, the peak
resident set size of the process on CPU (glibc set to return freed memory, `phalanx.malloc
.follow_live_memory`, so the peak is of live memory, not of what the allocator kept). Prints a table, the DAP/one-process ratios, and one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(length: int, msa_rows: int, c_m: int, c_z: int, blocks: int, chunk: int | None, reps: int,
             inference: bool = False) -> dict:
    """One rank: build the stack, run fwd+bwd (or the no-grad forward) `reps` times, report the
    median time and peak memory."""
    import torch
    import torch.distributed as dist

    from apps.protein.model.dap import Axial, DapAxial
    from apps.protein.model.evoformer import EvoformerConfig, EvoformerStack
    from phalanx.launch import context

    device = context().device
    world = dist.get_world_size()
    ax = DapAxial() if world > 1 else Axial()
    torch.manual_seed(0)
    cfg = EvoformerConfig(c_m=c_m, c_z=c_z, heads_msa=8, c_hidden_msa=max(c_m // 8, 4), heads_pair=4,
                          c_hidden_pair=max(c_z // 4, 4), c_hidden_mul=c_z, c_hidden_opm=max(c_m // 8, 4),
                          chunk_size=chunk)
    stack = EvoformerStack(cfg, blocks).to(device)
    if device.type != "cuda":
        # Resident memory that follows live memory: the rank's launch set glibc to keep freed blocks
        # for reuse (phalanx.malloc), and the peak RSS then counted what glibc kept -- chunked
        # fwd+bwd at 384 residues read 4,884 MiB that way (docs/protein.md). The peak is VmHWM
        # restarted here, over the resident memory now.
        from phalanx.malloc import follow_live_memory
        from phalanx.observe.memory import current_memory_bytes, peak_memory_bytes, release_free_memory, \
            reset_peak_memory
        follow_live_memory()
        release_free_memory()
        if not reset_peak_memory("cpu"):
            raise RuntimeError("bench/protein.py measures CPU memory through /proc/self/clear_refs (Linux)")
        base = current_memory_bytes("cpu")
    m = torch.randn(1, msa_rows, length, c_m, device=device)
    z = torch.randn(1, length, length, c_z, device=device)
    msa_mask = torch.ones(1, msa_rows, length, device=device)
    pair_mask = torch.ones(1, length, length, device=device)
    m_local, z_local = ax.scatter(m, 1).requires_grad_(not inference), ax.scatter(z, 1).requires_grad_(not inference)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(not inference):
            mo, zo = stack(m_local, z_local, msa_mask, pair_mask, ax)
        if not inference:
            (mo.float().square().mean() + zo.float().square().mean()).backward()
        del mo, zo
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        stack.zero_grad()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2 ** 20
    else:
        peak = (peak_memory_bytes("cpu") - base) / 2 ** 20
    return {"time_s": statistics.median(times[1:]), "peak_mib": peak}


def measure(world: int, **kwargs) -> dict:
    from phalanx.testing import spawn

    results = spawn(_measure, world, timeout=1800, **kwargs)
    return {"time_s": max(r["time_s"] for r in results), "peak_mib": max(r["peak_mib"] for r in results)}


def fit_memory(points: list[tuple[int, float]], chunked: bool) -> dict[int, float]:
    """Least-squares coefficients {power: coefficient} of peak MiB against the length L: powers
    0, 2, 3 unchunked (triangle attention's logits grow as L^3), 0, 2 chunked; the highest powers
    dropped when fewer lengths were measured than the form has terms."""
    import numpy as np

    powers = (0, 2) if chunked else (0, 2, 3)
    powers = powers[:len(points)]
    lengths = np.array([p[0] for p in points], dtype=float)
    peaks = np.array([p[1] for p in points], dtype=float)
    coef, *_ = np.linalg.lstsq(lengths[:, None] ** np.array(powers, dtype=float), peaks, rcond=None)
    return {p: float(c) for p, c in zip(powers, coef)}


def describe_fit(fit: dict[int, float]) -> str:
    """'a + b L^2 + c L^3' with the fitted numbers (a negative one written with a minus)."""
    text = ""
    for p, c in fit.items():
        term = f"{abs(c):.4g}" + (f" L^{p}" if p else "")
        text += (("-" if c < 0 else "") + term) if not text else (" - " if c < 0 else " + ") + term
    return text


def longest_fitting(fit: dict[int, float], budget_mib: float, limit: int = 100_000) -> int | None:
    """The longest L whose fitted peak stays within the budget (None without growth to fit)."""
    if len(fit) < 2 or max(fit) == 0 or fit[max(fit)] <= 0:
        return None
    def peak(length):
        return sum(c * length ** p for p, c in fit.items())
    lo, hi = 0, limit
    if peak(hi) <= budget_mib:
        return hi
    while hi - lo > 1:     # the leading term is positive: the peak grows past some L and stays above
        mid = (lo + hi) // 2
        if peak(mid) <= budget_mib:
            lo = mid
        else:
            hi = mid
    return lo or None


def template_cache(args) -> dict:
    """Seconds per sample with the template embedding cached across recycling passes and without."""
    import torch

    from apps.protein.config import load_recipe
    from apps.protein.features import FeatureConfig, crop_window, make_features
    from apps.protein.io import read_structure
    from apps.protein.losses import alphafold_loss
    from apps.protein.model import AlphaFold
    from apps.protein.data_sets import structure_path
    from apps.protein.templates import self_template
    from phalanx.device import current_device, to_device
    from phalanx.train.data import default_collate
    import numpy as np

    torch.set_num_threads(1)
    device = current_device()
    cfg = load_recipe(args.config, ["model.templates=true", f"data.max_templates={args.templates}"])
    chain = read_structure(structure_path("1aki"), "A")            # 129 residues: crops up to that length
    rows = []
    for length in args.lengths:
        fcfg = FeatureConfig(crop_size=length, max_msa_clusters=cfg.data.max_msa_clusters,
                             max_extra_msa=cfg.data.max_extra_msa, max_templates=args.templates)
        feats = make_features(chain, None, fcfg, np.random.default_rng(0), crop_window(chain, length, None),
                              templates=[self_template(chain)] * args.templates)
        batch = to_device(default_collate([feats]), device)
        torch.manual_seed(0)
        model = AlphaFold(cfg.model).to(device)
        tables = {"default_frames": model.default_frames, "atom14_local": model.atom14_local}
        runs = [0]                           # template pair stack runs: once per forward with the cache
        model.template_embedder.pair_stack.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
        for cache in (True, False):
            model.cfg.template.cache = cache
            for mode in ("forward", "fwd+bwd"):
                times = []
                runs[0] = 0
                for _ in range(args.reps + 1):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if mode == "forward":
                        model.eval()
                        with torch.no_grad():
                            model(**batch, recycles=args.recycles)
                    else:
                        model.train()
                        out = model(**batch, recycles=args.recycles)
                        alphafold_loss(out, batch, tables, cfg.loss)[0].backward()
                        model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                row = {"length": length, "templates": args.templates, "recycles": args.recycles, "cache": cache,
                       "mode": mode, "time_s": statistics.median(times[1:]), "stack_runs_per_sample": runs[0] / len(times)}
                rows.append(row)
                print(f"L={length:4d} templates={args.templates} recycles={args.recycles} {mode:8s} "
                      f"cache={'on ' if cache else 'off'} {row['time_s'] * 1e3:9.1f} ms/sample  "
                      f"(template stack {row['stack_runs_per_sample']:g}x per sample)", flush=True)
    saved = {}
    for length in args.lengths:
        for mode in ("forward", "fwd+bwd"):
            on, off = (next(r["time_s"] for r in rows if r["length"] == length and r["mode"] == mode
                            and r["cache"] is c) for c in (True, False))
            saved[f"L{length}_{mode}"] = {"saved_s": off - on, "saved_share": (off - on) / off}
            print(f"L={length} {mode}: the cache saves {(off - on) * 1e3:.1f} ms per sample ({(off - on) / off:.0%})")
    return {"rows": rows, "saved": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--msa-rows", type=int, default=16)
    parser.add_argument("--c-m", type=int, default=32)
    parser.add_argument("--c-z", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=8,
                        help="rows per chunk (attention, outer product mean, triangle multiplication) in the chunked runs")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="one process and/or DAP on 2 ranks")
    parser.add_argument("--inference", action="store_true", help="the no-grad forward (predict's path), not fwd+bwd")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-gb", type=float, default=4.0)
    parser.add_argument("--whole-max-length", type=int, default=None,
                        help="measure the unchunked stack only up to this length (longer ones chunked only): "
                             "unchunked fwd+bwd grows as L^3 and would not fit a small machine at 384")
    parser.add_argument("--template-cache", action="store_true",
                        help="time the whole model with templates, the template embedding cached across recycling "
                             "passes against not (--templates, --recycles, --config; --lengths up to 129)")
    parser.add_argument("--templates", type=int, default=4)
    parser.add_argument("--recycles", type=int, default=3)
    parser.add_argument("--config", default="apps/protein/configs/tiny.yaml",
                        help="the model of --template-cache (templates switched on)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    if args.template_cache:
        if max(args.lengths) > 129:
            parser.error("--template-cache crops 1aki A (129 residues): give --lengths up to 129")
        result = template_cache(args)
        print(json.dumps({"bench": "protein_template_cache", "loadavg": open("/proc/loadavg").read().split()[:3]
                          if os.path.exists("/proc/loadavg") else None, "args": vars(args), **result}))
        return
    machine = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
               "loadavg": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None,
               "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    rows = []
    for length in args.lengths:
        for world in args.ranks:
            for chunk in chunks_at(length, args):
                r = measure(world, length=length, msa_rows=args.msa_rows, c_m=args.c_m, c_z=args.c_z,
                            blocks=args.blocks, chunk=chunk, reps=args.reps, inference=args.inference)
                rows.append({"length": length, "ranks": world, "chunk": chunk, **r})
                print(f"L={length:4d} ranks={world} chunk={str(chunk):>4}  {'fwd' if args.inference else 'fwd+bwd'} "
                      f"{r['time_s'] * 1e3:9.1f} ms  peak {r['peak_mib']:8.1f} MiB/rank", flush=True)
    summary = summarise(rows, args)
    print(json.dumps({"bench": "protein_evoformer", "machine": machine, "args": vars(args), "rows": rows, **summary}))


def chunks_at(length: int, args) -> tuple:
    """The chunk settings measured at `length`: unchunked (None) and `--chunk`, or only `--chunk`
    past `--whole-max-length`."""
    whole_max = getattr(args, "whole_max_length", None)
    return (None, args.chunk) if whole_max is None or length <= whole_max else (args.chunk,)


def summarise(rows: list[dict], args) -> dict:
    """Print and return the DAP/one-process ratios, the memory fits and the longest fitting lengths."""
    budget = args.budget_gb * 1024
    fits, longest = {}, {}
    for world in args.ranks:
        for chunk in (None, args.chunk):
            key = f"ranks{world}_chunk{chunk}"
            pts = [(r["length"], r["peak_mib"]) for r in rows if r["ranks"] == world and r["chunk"] == chunk]
            fit = fit_memory(pts, chunk is not None)
            fits[key], longest[key] = {f"L^{p}": c for p, c in fit.items()}, longest_fitting(fit, budget)
            full = 2 if chunk is not None else 3
            note = "" if len(fit) == full else f" (only {len(pts)} lengths: give {full} or more for the full form)"
            print(f"peak MiB/rank fit ({key}): {describe_fit(fit)}{note}")
    ratios = {}
    for length in args.lengths if {1, 2} <= set(args.ranks) else ():
        if None not in chunks_at(length, args):
            continue
        one = next(r for r in rows if r["length"] == length and r["ranks"] == 1 and r["chunk"] is None)
        dap = next(r for r in rows if r["length"] == length and r["ranks"] == 2 and r["chunk"] is None)
        ratios[length] = {"time_dap2_over_one": dap["time_s"] / one["time_s"],
                          "peak_dap2_over_one": dap["peak_mib"] / max(one["peak_mib"], 1e-9)}
        print(f"L={length}: DAP-2 / one process: time x{ratios[length]['time_dap2_over_one']:.2f}, "
              f"peak memory per rank x{ratios[length]['peak_dap2_over_one']:.2f}")
    for length in args.lengths:
        if None not in chunks_at(length, args):
            continue
        for world in args.ranks:
            whole, part = (next(r for r in rows if r["length"] == length and r["ranks"] == world and r["chunk"] == c)
                           for c in (None, args.chunk))
            print(f"L={length} ranks={world}: chunk {args.chunk} / whole: peak memory x"
                  f"{part['peak_mib'] / max(whole['peak_mib'], 1e-9):.2f}, time x{part['time_s'] / whole['time_s']:.2f}")
    for key, value in longest.items():
        print(f"longest sequence in {args.budget_gb:g} GB per rank ({key}): ~{value} residues (extrapolated)")
    return {"ratios": ratios, "memory_fit_mib": fits, "longest_fitting": longest}


if __name__ == "__main__":
    main()
