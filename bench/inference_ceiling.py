"""How far can the CPU engine go? The engine against Hugging Face `generate` (the
`bench/inference.py` workload) with parts of our decode step replaced by no-ops, in one run.

    python bench/inference_ceiling.py [--dtype bfloat16] [--threads 1] [--repeats 3] [--compiled]
    python bench/inference_ceiling.py --profile --dtype float32      # where a decode step's time goes
    python bench/inference_ceiling.py --smoke                        # a tiny model: does it run (seconds)

Rows: the real engine; decode attention free (decode groups return an uninitialised tensor,
prefill attention still runs); decode attention and every RMSNorm free. The outputs of the
modified runs are garbage: only their CPU time means something. It is an upper bound on what
faster kernels for those parts could give (their cost going to zero), used to judge whether a
throughput target is reachable with the matmuls and the rest as they are. Times are CPU seconds
(process time), the steadier measure on a shared machine; the best of `--repeats` counts.
With `--compiled` the engine runs its compiled model step (RMSNorm is then inside the compiled
pieces, so the "RMSNorm free" row is dropped).

`--profile` instead breaks one decode step (32 sequences, after the prefill) down by operator
with torch.profiler, for the eager and the compiled engine: matmuls, decode attention (block
gathers + SDPA), KV-cache writes, the compiled pieces' fused kernels, other torch ops, and what
no operator accounts for (Python, dispatch). The profiler adds a few microseconds per operator,
so the step times it shows are a little above the unprofiled ones printed next to them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import inference as bench  # noqa: E402  (the workload and both runners)


CATEGORIES = (  # (category, predicate on a profiler event name), first match wins
    ("matmuls", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")),
    ("attention: SDPA", lambda n: "scaled_dot_product" in n or "flash_attention" in n),
    ("attention: block gathers", lambda n: n == "aten::index_select"),
    ("KV-cache writes", lambda n: n == "aten::index_copy_"),
    ("compiled fused kernels", lambda n: n.startswith("cpp_fused") or n.startswith("triton_")),
)


def profile_decode(engine, prompts, steps: int = 6) -> tuple[float, dict[str, float]]:
    """(unprofiled ms per decode step, {category: ms per step under the profiler})."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from phalanx.inference import SamplingParams
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_new_tokens=3 + 2 * steps + 2, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(3):  # prefill (two steps at a 4096-token budget) and a first decode
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = (time.perf_counter() - start) / steps * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - start) / steps * 1000
    while engine.has_unfinished_requests():
        engine.step()
    totals = {name: 0.0 for name, _ in CATEGORIES}
    totals["other torch ops"] = 0.0
    for event in prof.key_averages():
        if event.key.startswith(("ProfilerStep", "Torch-Compiled Region", "## Call CompiledFxGraph")):
            continue
        name = next((c for c, match in CATEGORIES if match(event.key)), "other torch ops")
        totals[name] += event.self_cpu_time_total / 1000 / steps
    totals["not in an operator (Python, dispatch)"] = profiled_ms - sum(totals.values())
    totals["profiled step"] = profiled_ms
    return plain_ms, totals


def main_profile(args, hf_path) -> int:
    import torch._inductor.config as inductor_config

    from phalanx.inference import LLM
    inductor_config.cpp.enable_kernel_profile = True  # the fused kernels show up as profiler events
    vocab = json.loads((Path(hf_path) / "config.json").read_text())["vocab_size"]
    prompts = bench.make_prompts(32, vocab, 32, 256)
    columns = {}
    for name, flag in (("eager", False), ("compiled", True)):
        engine = LLM(str(hf_path), dtype=args.dtype, max_num_seqs=32, compile=flag)
        bench.run_ours(engine, prompts[:2], 2)  # warm-up (and compilation)
        columns[name] = profile_decode(engine, prompts)
        del engine
    print(f"decode step, 32 sequences, {args.dtype}, {args.threads} thread(s); ms per step")
    print(f"  {'':40} {'eager':>9} {'compiled':>9}")
    print(f"  {'unprofiled step':40} {columns['eager'][0]:9.1f} {columns['compiled'][0]:9.1f}")
    for key in columns["eager"][1]:
        print(f"  {key:40} {columns['eager'][1][key]:9.1f} {columns['compiled'][1][key]:9.1f}")
    print(json.dumps({"bench": "inference_profile", "dtype": args.dtype, "threads": args.threads,
                      **{f"{side}_{k}": round(v, 2) for side, (_, t) in columns.items() for k, v in t.items()},
                      **{f"{side}_step_ms": round(c[0], 2) for side, c in columns.items()}}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="run our engine with compile=True")
    parser.add_argument("--profile", action="store_true", help="break a decode step down by operator instead")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, 4 short prompts, 4 new tokens, "
                        "one repeat: checks that the bench runs; its numbers mean nothing")
    args = parser.parse_args(argv)
    prompts_n, low, high, new_tokens = (4, 8, 16, 4) if args.smoke else (32, 32, 256, 64)
    if args.smoke:
        args.repeats = 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    import phalanx.inference.attention as attention
    import phalanx.inference.llama as llama
    from phalanx.inference import LLM
    from transformers import AutoModelForCausalLM

    tmp = None
    path = bench.smollm2_dir()
    if args.smoke or not (path / "config.json").exists():
        tmp = tempfile.TemporaryDirectory(prefix="phalanx-bench-")
        path = bench.tiny_llama_dir(Path(tmp.name), **(bench.SMOKE_MODEL if args.smoke else {}))
    if args.profile:
        return main_profile(args, path)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
    engine = LLM(str(path), dtype=args.dtype, max_num_seqs=32, compile=args.compiled)
    prompts = bench.make_prompts(prompts_n, hf.config.vocab_size, low, high)

    real_attention, real_norm = llama.paged_attention, llama.rms_norm

    def no_decode_attention(q, k, v, k_cache, v_cache, batch, sliding_window=None):
        if batch.prefills:
            return real_attention(q, k, v, k_cache, v_cache, batch, sliding_window)
        return torch.empty_like(q)

    def no_norm(x, weight, eps, residual=None):
        return x if residual is None else (x, residual)

    variants = {"real engine": (real_attention, real_norm),
                "decode attention free": (no_decode_attention, real_norm),
                "decode attention + RMSNorm free": (no_decode_attention, no_norm)}
    if args.compiled:  # the norms are inside the compiled pieces
        del variants["decode attention + RMSNorm free"]
    bench.run_hf(hf, prompts[:2], 2)
    bench.run_ours(engine, prompts[:2], 2)
    best = {"Hugging Face generate": float("inf"), **{name: float("inf") for name in variants}}
    try:
        for _ in range(args.repeats):
            best["Hugging Face generate"] = min(best["Hugging Face generate"], bench.run_hf(hf, prompts, new_tokens)[1])
            for name, (attention_fn, norm) in variants.items():
                # the eager forward calls llama's names, the compiled one attention's
                llama.paged_attention, llama.rms_norm = attention_fn, norm
                attention.paged_attention = attention_fn
                best[name] = min(best[name], bench.run_ours(engine, prompts, new_tokens)[1])
    finally:
        llama.paged_attention, llama.rms_norm = real_attention, real_norm
        attention.paged_attention = real_attention
    hf_cpu = best["Hugging Face generate"]
    print(f"model {path.name}, {args.dtype}, {args.threads} thread(s); CPU seconds for {prompts_n} x {new_tokens} "
          f"tokens, best of {args.repeats}")
    for name, cpu in best.items():
        print(f"  {name:34} {cpu:7.2f} s   throughput vs HF {hf_cpu / cpu:5.2f}x")
    print(json.dumps({"bench": "inference_ceiling", "dtype": args.dtype, "threads": args.threads,
                      **{name: round(hf_cpu / cpu, 3) for name, cpu in best.items()}}))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
