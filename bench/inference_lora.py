"""Serving LoRA adapters: time per generated token of one batch on the base model alone, against the
same batch split over two adapters (rank r on every projection) and the base, on the same engine.

    python bench/inference_lora.py                        # SmolLM2-135M if cached, else a tiny Llama
    python bench/inference_lora.py --model tiny --requests 4 --new-tokens 4

The adapters' low-rank products run as one gathered matmul per projection per step for the whole
batch (phalanx.inference.lora), so the mixed batch should cost the base batch plus the small
products; the ratio printed is mixed / base (1.0 = free). Prints the CPU and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import cpu_kind, smollm2_dir, tiny_llama_dir  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, rank: int, count: int = 2) -> list[Path]:
    """`count` PEFT adapters of rank `rank` on every projection, with random non-zero B."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    dirs = []
    for i in range(1, count + 1):
        torch.manual_seed(i)
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)),
                                    peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.01)
        model.save_pretrained(str(out / f"a{i}"))
        dirs.append(out / f"a{i}")
    return dirs


def ms_per_token(engine, prompts, names, new_tokens: int, repeats: int) -> float:
    from phalanx.inference import SamplingParams

    best = float("inf")
    for _ in range(repeats):
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True,
                                 lora_name=names[i % len(names)]) for i in range(len(prompts))]
        start = time.perf_counter()
        engine.generate(prompts, params)
        best = min(best, (time.perf_counter() - start) * 1e3 / (len(prompts) * new_tokens))
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="auto", help="'auto' (SmolLM2-135M if cached, else tiny), 'tiny', or a directory")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from phalanx.inference import LLM

    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    model = smollm2_dir() if args.model == "auto" else None
    if args.model == "tiny" or (args.model == "auto" and model is None):
        model = tiny_llama_dir(root / "tiny-llama")
    elif model is None:
        model = Path(args.model)
    adapters = make_adapters(model, root, args.rank)
    engine = LLM(str(model), dtype=args.dtype, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
                 max_model_len=args.prompt_len + args.new_tokens + 16)
    for i, path in enumerate(adapters, start=1):
        engine.load_lora_adapter(f"a{i}", str(path))
    vocab = engine.model_config.vocab_size if hasattr(engine, "model_config") else 1000
    prompts = [torch.randint(10, min(vocab, 1000), (args.prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.requests)]
    load_before = os.getloadavg()[0]
    print(f"{model.name}, {args.requests} requests x {args.new_tokens} new tokens, adapters rank {args.rank} on "
          f"{len(TARGETS)} projections, dtype {engine.dtype}; CPU {cpu_kind()}; load average {load_before:.2f}")
    base = ms_per_token(engine, prompts, [None], args.new_tokens, args.repeats)
    mixed = ms_per_token(engine, prompts, ["a1", "a2", None], args.new_tokens, args.repeats)
    print(f"base model: {base:.2f} ms per generated token")
    print(f"a1 / a2 / base mixed in one batch: {mixed:.2f} ms per generated token")
    print(f"mixed adapters / base: {mixed / base:.2f}x time per token")
    print(json.dumps({"bench": "inference_lora", "model": model.name, "dtype": str(engine.dtype), "cpu": cpu_kind(),
                      "requests": args.requests, "new_tokens": args.new_tokens, "rank": args.rank,
                      "base_ms_per_token": base, "mixed_ms_per_token": mixed, "ratio": mixed / base,
                      "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
