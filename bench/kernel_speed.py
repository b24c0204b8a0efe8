"""Phalanx kernels against torch eager and torch.compile, measured in one run.

Part 1 -- CPU, always: the fused linear + cross-entropy that trains causal LMs. Loss + backward
  for 8,192 tokens, hidden 512, vocabulary 32,000 (the issue's size), chunked reference path vs
  eager `F.linear` + `F.cross_entropy`. Each variant runs in a fresh process, twice:
    - peak RSS growth over the process's own baseline (taken after the inputs exist and a small
      warm-up has run), read from `getrusage` -- what the operating system actually had to give;
    - peak live bytes of torch's CPU allocator, from `torch.profiler` memory events (every
      allocation and free, in order) -- what the tensors themselves needed.
  The two variants' losses and gradients are compared. Target: >= 3x less memory.

Part 2 -- GPU only: every kernel (our Triton, forced) against its torch reference
  run eagerly and under `torch.compile`, forward and forward+backward where training uses it;
  achieved bandwidth (GB/s) or FLOP/s against this device's peak measured in the same run (a large
  copy, a large matmul), and peak memory of the fused cross-entropy against eager and compiled.
  On a machine without a GPU this part prints why it is skipped and the script still exits 0.

    python bench/kernel_speed.py                 # both parts (part 1: ~1-2 min on 2 CPU cores)
    python bench/kernel_speed.py --dtype bf16    # part 1 in bf16
    python bench/kernel_speed.py --part gpu --no-compile

Prints tables and one `BENCH_JSON {...}` line.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_MEMORY_RATIO = 3.0


# =============================================================================================
# Part 1: fused linear + cross-entropy memory on CPU

def _ce_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype):
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[::16] = -100  # some ignored positions, as padding and prompts give
    return h, w, labels


def _ce_fn(variant: str, chunk: int | None) -> Callable:
    from phalanx_kernels.cross_entropy import fused_linear_cross_entropy_reference, linear_cross_entropy_eager
    if variant == "eager":
        return linear_cross_entropy_eager
    return lambda h, w, y: fused_linear_cross_entropy_reference(h, w, y, chunk_size=chunk)


def _allocator_peak(fn: Callable[[], None]) -> int:
    """Peak live bytes of torch's CPU allocator while fn runs (relative to its start)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def ce_worker(args) -> None:
    """One variant in this (fresh) process; prints a JSON line, saves loss and grads."""
    import resource

    import psutil
    dtype = DTYPES[args.dtype]
    h, w, labels = _ce_inputs(args.tokens, args.hidden, args.vocab, dtype)
    fn = _ce_fn(args.worker, args.chunk)
    fn(h[:64], w, labels[:64]).backward()  # warm-up: thread pools, one-time allocations
    h.grad = w.grad = None
    gc.collect()
    base = psutil.Process().memory_info().rss
    start = time.perf_counter()
    loss = fn(h, w, labels)
    loss.backward()
    seconds = time.perf_counter() - start
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit - base
    torch.save({"loss": loss.detach(), "d_hidden": h.grad, "d_weight": w.grad}, args.out)
    h.grad = w.grad = None
    del loss
    gc.collect()
    alloc_peak = _allocator_peak(lambda: fn(h, w, labels).backward())
    print(json.dumps({"rss_peak": rss_peak, "alloc_peak": alloc_peak, "seconds": seconds}))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def cpu_fused_ce(args) -> dict:
    from phalanx_kernels.cross_entropy import default_chunk_size
    chunk = args.chunk or default_chunk_size(args.vocab)
    print(f"\nPart 1 -- fused linear + cross-entropy on CPU: {args.tokens} tokens, hidden {args.hidden}, "
          f"vocab {args.vocab}, {args.dtype}, chunk {chunk} tokens (loss + backward)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("eager", "fused"):
            out = Path(tmp) / f"{variant}.pt"
            cmd = [sys.executable, __file__, "--worker", variant, "--out", str(out), "--tokens", str(args.tokens),
                   "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype,
                   "--chunk", str(chunk)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{variant} worker failed:\n{proc.stderr[-3000:]}")
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[variant]["tensors"] = torch.load(out, weights_only=True)
    eager, fused = results["eager"], results["fused"]
    errors = {k: _rel_err(fused["tensors"][k], eager["tensors"][k]) for k in ("loss", "d_hidden", "d_weight")}
    mib = 1 << 20
    print(f"{'variant':<34}{'peak RSS growth':>17}{'allocator peak':>16}{'time':>9}")
    for name, r in (("eager lm_head + cross_entropy", eager), ("phalanx fused (chunked reference)", fused)):
        print(f"{name:<34}{r['rss_peak'] / mib:>13.0f} MiB{r['alloc_peak'] / mib:>12.0f} MiB{r['seconds']:>8.2f}s")
    rss_ratio = eager["rss_peak"] / max(fused["rss_peak"], 1)
    alloc_ratio = eager["alloc_peak"] / max(fused["alloc_peak"], 1)
    met = min(rss_ratio, alloc_ratio) >= TARGET_MEMORY_RATIO
    print(f"memory ratio eager/fused: {rss_ratio:.1f}x (RSS), {alloc_ratio:.1f}x (allocator); "
          f"target >= {TARGET_MEMORY_RATIO:.0f}x: {'met' if met else 'NOT met'}")
    print(f"time ratio eager/fused: {eager['seconds'] / fused['seconds']:.2f}x")
    print("max relative error fused vs eager: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    return {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype, "chunk": chunk,
            "eager": {k: eager[k] for k in ("rss_peak", "alloc_peak", "seconds")},
            "fused": {k: fused[k] for k in ("rss_peak", "alloc_peak", "seconds")},
            "rss_ratio": rss_ratio, "alloc_ratio": alloc_ratio, "target_met": met, "max_rel_err": errors}


# =============================================================================================
# Part 2: every kernel on a GPU

def time_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call: CUDA events on a GPU, wall clock otherwise."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=10)
    return 2 * n / (ms * 1e-3)


def peak_flops(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, reps=10)
    return 2 * n ** 3 / (ms * 1e-3)


@dataclass
class Case:
    name: str
    ours: Callable[[], object]
    eager: Callable[[], object]
    compiled: Callable[[], object] | None
    bytes: float = 0.0   # minimum traffic, for memory-bound kernels
    flops: float = 0.0   # for compute-bound kernels
    memory: bool = False  # also report peak memory


def _fwd_bwd(fn, inputs, grad):
    """Forward then backward of fn(*inputs) with an upstream gradient `grad`."""
    def run():
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
    return run


def _bind(fn, *args):
    """fn(*args) as a thunk, bound now (a lambda would look `fn` up when called); None stays None."""
    return None if fn is None else (lambda: fn(*args))


def _compile(fn, enabled: bool):
    return torch.compile(fn) if enabled else None


def gpu_cases(device: str, dtype: torch.dtype, compile_: bool, scale: int) -> list[Case]:
    """Kernel cases at Llama-7B-like sizes divided by `scale` (scale > 1 only for --dry-run)."""
    from phalanx_kernels import attention, cross_entropy, glu, layernorm, paged_attention, rmsnorm, rope, softmax
    el = torch.tensor([], dtype=dtype).element_size()
    mk = lambda *s, grad=False: torch.randn(*s, device=device, dtype=dtype, requires_grad=grad)  # noqa: E731
    cases = []

    rows, hid = 16384 // scale, 4096 // scale
    x, w, r = mk(rows, hid, grad=True), mk(hid, grad=True), mk(rows, hid, grad=True)
    dy = torch.randn_like(x)
    n = rows * hid * el
    cases.append(Case("rms_norm fwd", lambda: rmsnorm.rms_norm(x, w), lambda: rmsnorm.rms_norm_reference(x, w),
                      _compile(lambda: rmsnorm.rms_norm_reference(x, w), compile_), bytes=2 * n))
    c = _compile(rmsnorm.rms_norm_reference, compile_)
    cases.append(Case("rms_norm fwd+bwd", _fwd_bwd(rmsnorm.rms_norm, (x, w), dy),
                      _fwd_bwd(rmsnorm.rms_norm_reference, (x, w), dy), c and _fwd_bwd(c, (x, w), dy), bytes=5 * n))
    res = lambda f: (lambda: f(x, w, 1e-6, r))  # noqa: E731
    cases.append(Case("rms_norm+residual fwd", res(rmsnorm.rms_norm), res(rmsnorm.rms_norm_reference),
                      _compile(res(rmsnorm.rms_norm_reference), compile_), bytes=4 * n))
    b = mk(hid, grad=True)
    c = _compile(layernorm.layer_norm_reference, compile_)
    cases.append(Case("layer_norm fwd+bwd", _fwd_bwd(layernorm.layer_norm, (x, w, b), dy),
                      _fwd_bwd(layernorm.layer_norm_reference, (x, w, b), dy), c and _fwd_bwd(c, (x, w, b), dy),
                      bytes=5 * n))

    inter = 11008 // scale
    ga, ub = mk(rows, inter, grad=True), mk(rows, inter, grad=True)
    gy = torch.randn_like(ga)
    n = rows * inter * el
    c = _compile(glu.swiglu_reference, compile_)
    cases.append(Case("swiglu fwd", lambda: glu.swiglu(ga, ub), lambda: glu.swiglu_reference(ga, ub),
                      _bind(c, ga, ub), bytes=3 * n))
    cases.append(Case("swiglu fwd+bwd", _fwd_bwd(glu.swiglu, (ga, ub), gy),
                      _fwd_bwd(glu.swiglu_reference, (ga, ub), gy), c and _fwd_bwd(c, (ga, ub), gy),
                      bytes=8 * n))

    B, T, H, Hk, D = 8, 4096 // scale, 32, 8, 128
    q, k = mk(B, H, T, D), mk(B, Hk, T, D)
    pos = torch.arange(T, device=device).float()[:, None] * (1e-4 ** (torch.arange(0, D, 2, device=device) / D))
    emb = torch.cat((pos, pos), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    c = _compile(rope.apply_rope_reference, compile_)
    cases.append(Case("rope fwd (in place)", lambda: rope.apply_rope(q, k, cos, sin),
                      lambda: rope.apply_rope_reference(q, k, cos, sin), _bind(c, q, k, cos, sin),
                      bytes=2 * (q.numel() + k.numel()) * el))

    tokens, vocab = 16384 // scale, 128256 // scale
    hs, wt = mk(tokens, hid, grad=True), (0.02 * mk(vocab, hid)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    one = torch.ones((), device=device)
    ce = (hs, wt, labels)
    c = _compile(cross_entropy.linear_cross_entropy_eager, compile_)
    cases.append(Case("fused linear+CE fwd+bwd", _fwd_bwd(cross_entropy.fused_linear_cross_entropy, ce, one),
                      _fwd_bwd(cross_entropy.linear_cross_entropy_eager, ce, one), c and _fwd_bwd(c, ce, one),
                      flops=3 * 2 * tokens * hid * vocab, memory=True))

    B, H, Hk, T, D = 4, 32, 8, 4096 // scale, 128
    qa, ka, va = mk(B, H, T, D, grad=True), mk(B, Hk, T, D, grad=True), mk(B, Hk, T, D, grad=True)
    do = torch.randn_like(qa)
    fwd_flops = 4 * B * H * T * T * D / 2  # causal
    attn = lambda f: (lambda *a: f(*a, causal=True))  # noqa: E731
    c = _compile(attn(attention.flash_attention_reference), compile_)
    cases.append(Case("flash_attention fwd (causal, GQA)", lambda: attention.flash_attention(qa, ka, va, True),
                      lambda: attention.flash_attention_reference(qa, ka, va, True),
                      _bind(c, qa, ka, va), flops=fwd_flops))
    cases.append(Case("flash_attention fwd+bwd", _fwd_bwd(attn(attention.flash_attention), (qa, ka, va), do),
                      _fwd_bwd(attn(attention.flash_attention_reference), (qa, ka, va), do),
                      c and _fwd_bwd(c, (qa, ka, va), do), flops=3.5 * fwd_flops))

    B, H, Hk, D, page, ctx = 64, 32, 8, 128, 16, 4096 // scale
    blocks = B * ctx // page
    kc, vc = mk(blocks, page, Hk, D), mk(blocks, page, Hk, D)
    tables = torch.randperm(blocks, device=device).view(B, ctx // page).int()
    lens = torch.full((B,), ctx, device=device, dtype=torch.int32)
    qd = mk(B, H, D)
    pa = (qd, kc, vc, tables, lens)
    c = _compile(paged_attention.paged_decode_attention_reference, compile_)
    cases.append(Case("paged_decode_attention", lambda: paged_attention.paged_decode_attention(*pa),
                      lambda: paged_attention.paged_decode_attention_reference(*pa), _bind(c, *pa),
                      bytes=2 * kc.numel() * el))

    S, Hs, L = 256 // scale, 8, 256 // scale
    logits = mk(1, S, Hs, L, L, grad=True)
    pair = mk(1, 1, Hs, L, L, grad=True)
    mask = torch.rand(1, S, 1, 1, L, device=device) > 0.1
    gs = torch.randn_like(logits)
    n = logits.numel() * el
    c = _compile(softmax.masked_softmax_reference, compile_)
    cases.append(Case("masked_softmax fwd+bwd (Evoformer)", _fwd_bwd(softmax.masked_softmax, (logits, mask, pair), gs),
                      _fwd_bwd(softmax.masked_softmax_reference, (logits, mask, pair), gs),
                      c and _fwd_bwd(c, (logits, mask, pair), gs), bytes=5 * n))
    return cases


def _timed(case: str, variant: str, fn, reps: int) -> float:
    """time_ms, with a failure (out of memory, a compile error) reported as NaN, not a crash."""
    try:
        return time_ms(fn, reps)
    except Exception as exc:  # noqa: BLE001 - a failing peer is a result
        print(f"  {case}: {variant} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return float("nan")


def _peak_memory(fn, device: str) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def gpu_suite(device: str, dtype: torch.dtype, compile_: bool, scale: int, reps: int) -> dict:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    bw, fl = peak_bandwidth(device), peak_flops(device, dtype)
    print(f"\nPart 2 -- kernels on {name}, {str(dtype).replace('torch.', '')}: measured peak "
          f"{bw / 1e9:.0f} GB/s (copy), {fl / 1e12:.1f} TFLOP/s (matmul)")
    print(f"{'kernel':<36}{'ours ms':>9}{'eager ms':>10}{'compile ms':>11}{'vs eager':>10}{'vs compile':>11}"
          f"{'achieved':>18}")
    rows = []
    from phalanx_kernels import use_backend
    # our Triton kernels, also where the default dispatch prefers torch on CUDA (attention); the
    # CPU dry run checks the bench itself with the default dispatch
    ours_backend = "triton" if device == "cuda" else "auto"
    for case in gpu_cases(device, dtype, compile_, scale):
        with use_backend(ours_backend):
            ours = _timed(case.name, "ours", case.ours, reps)
        eager = _timed(case.name, "eager", case.eager, reps)
        compiled = _timed(case.name, "torch.compile", case.compiled, reps) if case.compiled else float("nan")
        if case.flops:
            achieved = case.flops / (ours * 1e-3)
            ach = f"{achieved / 1e12:.1f} TF/s {100 * achieved / fl:.0f}%"
        else:
            achieved = case.bytes / (ours * 1e-3)
            ach = f"{achieved / 1e9:.0f} GB/s {100 * achieved / bw:.0f}%"
        print(f"{case.name:<36}{ours:>9.3f}{eager:>10.3f}{compiled:>11.3f}{eager / ours:>9.2f}x"
              f"{compiled / ours:>10.2f}x{ach:>18}")
        row = {"kernel": case.name, "ours_ms": ours, "eager_ms": eager, "compile_ms": compiled,
               "achieved": achieved, "unit": "flop/s" if case.flops else "byte/s",
               "fraction_of_peak": achieved / (fl if case.flops else bw)}
        if case.memory:
            with use_backend(ours_backend):
                ours_peak = _peak_memory(case.ours, device)
            row["peak_bytes"] = {"ours": ours_peak, "eager": _peak_memory(case.eager, device),
                                 "compile": _peak_memory(case.compiled, device) if case.compiled else float("nan")}
            pb = row["peak_bytes"]
            print(f"  peak memory: ours {pb['ours'] / 2**20:.0f} MiB, eager {pb['eager'] / 2**20:.0f} MiB, "
                  f"compile {pb['compile'] / 2**20:.0f} MiB")
        rows.append(row)
    return {"device": name, "dtype": str(dtype), "peak_bandwidth": bw, "peak_flops": fl, "kernels": rows}


# =============================================================================================

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("all", "cpu", "gpu"), default="all")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="dtype of part 1 (part 2 uses bf16)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=None, help="fused CE tokens per chunk (default: the library's)")
    p.add_argument("--no-compile", action="store_true", help="part 2 without the torch.compile column")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dry-run-on-cpu", action="store_true",
                   help="run part 2's code on CPU at 1/16 size (checks the script, measures nothing useful)")
    p.add_argument("--worker", choices=("eager", "fused"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        ce_worker(args)
        return 0
    report = {"bench": "kernels"}
    if args.part in ("all", "cpu"):
        report["cpu_fused_cross_entropy"] = cpu_fused_ce(args)
    if args.part in ("all", "gpu"):
        if torch.cuda.is_available():
            report["gpu"] = gpu_suite("cuda", torch.bfloat16, not args.no_compile, 1, args.reps)
        elif args.dry_run_on_cpu:
            report["gpu"] = gpu_suite("cpu", torch.float32, not args.no_compile, 16, 2)
        else:
            print("\nPart 2 -- skipped: no CUDA GPU on this machine (torch.cuda.is_available() is False). "
                  "The Triton kernels run only on a GPU; rerun this script on one to time them.")
            report["gpu"] = None
    print("BENCH_JSON " + json.dumps(report, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
