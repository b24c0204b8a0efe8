"""How far can the CPU engine go? The engine against Hugging Face `generate` (the
`bench/inference.py` workload) with parts of our decode step replaced by no-ops, in one run.

    python bench/inference_ceiling.py [--dtype bfloat16] [--threads 1] [--repeats 3]

Rows: the real engine; decode attention free (decode groups return an uninitialised tensor,
prefill attention still runs); decode attention and every RMSNorm free. The outputs of the
modified runs are garbage: only their CPU time means something. It is an upper bound on what
faster kernels for those parts could give (their cost going to zero), used to judge whether a
throughput target is reachable with the matmuls and the rest as they are. Times are CPU seconds
(process time), the steadier measure on a shared machine; the best of `--repeats` counts.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    import phalanx.inference.llama as llama
    from phalanx.inference import LLM
    from transformers import AutoModelForCausalLM

    tmp = None
    path = bench.smollm2_dir()
    if not (path / "config.json").exists():
        tmp = tempfile.TemporaryDirectory(prefix="phalanx-bench-")
        path = bench.tiny_llama_dir(Path(tmp.name))
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
    engine = LLM(str(path), dtype=args.dtype, max_num_seqs=32)
    prompts = bench.make_prompts(32, hf.config.vocab_size, 32, 256)

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
    bench.run_hf(hf, prompts[:2], 2)
    bench.run_ours(engine, prompts[:2], 2)
    best = {"Hugging Face generate": float("inf"), **{name: float("inf") for name in variants}}
    try:
        for _ in range(args.repeats):
            best["Hugging Face generate"] = min(best["Hugging Face generate"], bench.run_hf(hf, prompts, 64)[1])
            for name, (attention, norm) in variants.items():
                llama.paged_attention, llama.rms_norm = attention, norm
                best[name] = min(best[name], bench.run_ours(engine, prompts, 64)[1])
    finally:
        llama.paged_attention, llama.rms_norm = real_attention, real_norm
    hf_cpu = best["Hugging Face generate"]
    print(f"model {path.name}, {args.dtype}, {args.threads} thread(s); CPU seconds for 32 x 64 tokens, best of {args.repeats}")
    for name, cpu in best.items():
        print(f"  {name:34} {cpu:7.2f} s   throughput vs HF {hf_cpu / cpu:5.2f}x")
    print(json.dumps({"bench": "inference_ceiling", "dtype": args.dtype, "threads": args.threads,
                      **{name: round(hf_cpu / cpu, 3) for name, cpu in best.items()}}))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
