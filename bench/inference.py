"""Inference throughput: phalanx.inference vs Hugging Face `generate`, measured in one run.

    python bench/inference.py                      # SmolLM2-135M if cached, else a tiny Llama
    python bench/inference.py --dtype bfloat16 --model path/to/hf_dir
    (--dtype auto, the default, is the engine's own default: bfloat16 where this machine computes
    bf16 faster than fp32, float32 elsewhere; it is resolved once and every side, HF included,
    runs in that dtype)
    python bench/inference.py --smoke              # a tiny model, a few tokens: does it run (seconds)

Workload (the issue's): 32 prompts of mixed length (token ids drawn with a fixed seed, 32–256
tokens), 64 new tokens each, greedy, EOS ignored so both sides generate exactly 32 × 64 tokens.
Hugging Face runs the whole batch as one left-padded `generate` call (its fastest way to do 32
prompts); phalanx.inference takes the 32 requests at once and continuously batches them.

Sides: HF `generate`, our engine eager (`compile=False`, the tested reference) and our engine
compiled (`compile=True`: the model step through torch.compile, see
phalanx/inference/compiled.py). The compiled engine's compilation happens in its warm-up and is
reported on its own line, not in its throughput; a second process reuses inductor's on-disk cache
(~/.cache/phalanx/inductor) and compiles faster. `--no-eager` / `--no-compiled` drop a side.
`--ngram N` adds our eager engine with n-gram speculation (`prompt_lookup_max=N`, no draft model):
its gain depends on how often the outputs repeat themselves (SmolLM2's greedy continuations of
these random-token prompts loop a lot), so it is reported apart, never as the engine's speed.
`--workload quote` replaces the random prompts by 32 chat requests to copy a Wikipedia paragraph
(the shipped corpus, through the model's chat template): a workload where outputs quote the prompt.

Single stream: one 128-token prompt, 64 new tokens, batch of one on every side: time to first
token and inter-token latency ((total - TTFT) / 63; ours from the request's own timestamps).

Reported per side: throughput (generated tokens / wall time), time to first token (HF: the
padded prefill + first token, timed with max_new_tokens=1; ours: mean over requests of first
token − arrival), and per-token latency (HF: (total − TTFT) / 63; ours: mean over requests of
(finish − first token) / 63). Each side runs `--repeats` times, interleaved, and the fastest run
counts (the machine is shared; the best run is the least disturbed one). CPU seconds (process
time) are reported too: on a machine shared with other jobs they measure the work each side does
better than wall time; with one thread they exclude time spent waiting for a core. The last line
is JSON.

The model is SmolLM2-135M (Llama architecture) when the llama recipe has cached it under
$PHALANX_CACHE or ~/.cache/phalanx/smollm2-135m-instruct, else a randomly initialised Llama with
hidden 512, 8 layers (the output says which).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def smollm2_dir() -> Path:
    from phalanx.pretrained import default_dir

    return default_dir()


TINY_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4)
# --smoke: the smallest Llama the engine runs, to check the bench runs (numbers meaningless)
SMOKE_MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def tiny_llama_dir(out: Path, **sizes) -> Path:
    """A randomly initialised Llama (TINY_MODEL, or the sizes given) saved under `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_MODEL, **sizes}, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock read after it times the work itself."""
    if device.type != "cpu":
        from phalanx_kernels.accelerator import device_module
        device_module(device).synchronize()


def make_prompts(n: int, vocab: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for length in lengths]


def quote_prompts(model_dir: Path, n: int, seed: int = 0) -> list[list[int]]:
    """`--workload quote`: chat requests asking the model to copy a Wikipedia lead paragraph (the
    shipped apps/llama/data corpus; 250-700 characters each, drawn with a fixed seed), through the
    model's chat template: outputs that quote their prompt, where n-gram speculation applies."""
    import gzip
    import random

    from transformers import AutoTokenizer

    corpus = Path(__file__).resolve().parents[1] / "apps" / "llama" / "data" / "en_wikipedia_leads.jsonl.gz"
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        leads = [row["text"] for row in map(json.loads, f) if 250 <= len(row["text"]) <= 700]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chosen = random.Random(seed).sample(leads, n)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": f"Copy this paragraph exactly:\n\n{text}"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for text in chosen]


def run_hf(model, prompts, new_tokens: int):
    from phalanx.testing import left_padded

    ids, mask = (t.to(model.device) for t in left_padded(prompts))
    with torch.inference_mode():
        start, cpu = time.perf_counter(), time.process_time()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        synchronize(model.device)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return elapsed, cpu, out[:, ids.shape[1]:].tolist()


def run_ours(engine, prompts, new_tokens: int):
    from phalanx.inference import SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.block_manager.reset_prefix_cache()  # a repeat must not reuse the previous run's prefill
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    ttft = statistics.mean(o.first_token_time - o.arrival_time for o in outs)
    tpot = statistics.mean((o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs)
    return elapsed, cpu, ttft, tpot, [o.token_ids for o in outs]


def hf_single_stream(model, prompt, new_tokens: int):
    """(TTFT, inter-token latency) of HF generate on one unpadded prompt."""
    def timed(n):
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(torch.tensor([prompt], device=model.device),
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            synchronize(model.device)
            return time.perf_counter() - start
    ttft, total = timed(1), timed(new_tokens)
    return ttft, (total - ttft) / max(1, new_tokens - 1)


def our_single_stream(engine, prompt, new_tokens: int):
    _, _, ttft, tpot, _ = run_ours(engine, [prompt], new_tokens)
    return ttft, tpot


def profile_engine(label: str, engine, prompts, new_tokens: int) -> None:
    """Where one batched run's host time goes: the 25 costliest operators by self host time, and
    how many kernels were launched and how often the host waited for the device."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run_ours(engine, prompts, new_tokens)
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    launches = sum(n for key, n in count.items() if key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = sum(n for key, n in count.items() if "Synchronize" in key or key == "aten::_local_scalar_dense")
    print(f"\nprofile of {label}, {len(prompts)} prompts x {new_tokens} tokens: {launches} kernel launches, "
          f"{syncs} host waits on the device ({launches / max(1, new_tokens):.0f} launches per decode step)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512bw", "avx512vl", "avx512dq", "avx_ne_convert", "avx2")


def cpu_report() -> dict:
    """Which CPU measured: its model name (lscpu's), the flags that decide bf16 speed (native bf16:
    AVX512-BF16 or AMX; oneDNN's packed bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT), torch's
    kernel level and the 1-minute load average; printed and put in the JSON line."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": name, "cpu_flags": [f for f in BF16_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}


def resolved_dtype(name: str) -> str:
    """`name`, or for "auto" the dtype the engine's `dtype="auto"` picks on this machine, as a
    torch name: HF and the engines are then built in the same dtype."""
    from phalanx.inference.model_runner import resolve_dtype
    from phalanx_kernels.accelerator import current_device

    return str(resolve_dtype(name, None, current_device())).removeprefix("torch.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="an HF Llama-family directory (default: see above)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="every side's dtype; auto: the engine's default for this machine")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-eager", action="store_true", help="skip our eager engine")
    parser.add_argument("--no-compiled", action="store_true", help="skip our compiled engine")
    parser.add_argument("--no-hf-ttft", action="store_true", help="skip HF's separately timed batch TTFT run")
    parser.add_argument("--no-single", action="store_true", help="skip the single-stream latencies")
    parser.add_argument("--ngram", type=int, default=0, metavar="N",
                        help="also time our eager engine with n-gram speculation (prompt_lookup_max=N, no draft "
                        "model; greedy tokens are verified by the model, so they are the eager engine's)")
    parser.add_argument("--ngram-tokens", type=int, default=4, help="tokens proposed per step with --ngram")
    parser.add_argument("--workload", default="random", choices=["random", "quote"],
                        help="random: the issue's random-token prompts (--min-len..--max-len); quote: chat requests "
                        "to copy a Wikipedia paragraph (needs the model's tokenizer and chat template)")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"],
                        help="our engines' decode steps as CUDA graphs (on CUDA; 'off': every step eager)")
    parser.add_argument("--profile", action="store_true", help="after the timings, profile one batched run of each "
                        "engine (torch.profiler) and print its 25 costliest operators by host time, with the "
                        "number of kernel launches and device synchronisations")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, 4 short prompts, 4 new tokens, "
                        "eager only: checks that the bench runs; its numbers mean nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.new_tokens, args.min_len, args.max_len, args.repeats = 4, 4, 8, 16, 1
        args.no_compiled = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from phalanx.inference import LLM

    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="phalanx-bench-")
        path, label = tiny_llama_dir(Path(tmp.name), **SMOKE_MODEL), "smoke: tiny random Llama (hidden 64, 2 layers)"
    elif args.model:
        path, label = Path(args.model), Path(args.model).name
    elif (smollm2_dir() / "config.json").exists():
        path, label = smollm2_dir(), "SmolLM2-135M-Instruct (cached by the llama recipe)"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="phalanx-bench-")
        path = tiny_llama_dir(Path(tmp.name))
        label = "tiny Llama, random init (hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 32000)"
    args.dtype = resolved_dtype(args.dtype)
    dtype = getattr(torch, args.dtype)
    from phalanx_kernels.accelerator import current_device
    # HF runs on the engine's device (the GPU where there is one): the same hardware both sides
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
    hf = hf.to(current_device())
    engines = {}
    graphs = "auto" if args.cuda_graphs == "auto" else False
    if not args.no_eager:
        engines["eager"] = LLM(str(path), dtype=args.dtype, max_num_seqs=max(args.prompts, 1), compile=False,
                               cuda_graphs=graphs)
    if args.ngram:
        engines["ngram"] = LLM(str(path), dtype=args.dtype, max_num_seqs=max(args.prompts, 1), compile=False,
                               cuda_graphs=graphs, prompt_lookup_max=args.ngram,
                               num_speculative_tokens=args.ngram_tokens)
    if not args.no_compiled:
        fast = LLM(str(path), dtype=args.dtype, max_num_seqs=max(args.prompts, 1), compile=True, cuda_graphs=graphs)
        if fast.runner.compiled is None:
            print(f"compiled engine unavailable: {fast.runner.compile_reason}")
        else:
            engines["compiled"] = fast
    prompts = quote_prompts(path, args.prompts) if args.workload == "quote" else \
        make_prompts(args.prompts, hf.config.vocab_size, args.min_len, args.max_len)
    single = make_prompts(1, hf.config.vocab_size, 128, 128, seed=1)[0]
    n_tokens = args.prompts * args.new_tokens
    machine = cpu_report()
    from phalanx_kernels.accelerator import display
    machine["device"] = display(current_device())
    flags = " ".join(machine["cpu_flags"]) or "(none of " + ", ".join(BF16_FLAGS) + ")"
    print(f"device: {machine['device']}; CPU: {machine['cpu']}; flags {flags}; "
          f"torch kernels {machine['torch_cpu_capability']}; load average {machine['load_avg_1m']}")
    print(f"model: {label}\ndtype: {args.dtype}, torch threads: {torch.get_num_threads()}, "
          f"{args.prompts} prompts of {min(map(len, prompts))}–{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all, {args.prompts * max(map(len, prompts))} padded), "
          f"{args.new_tokens} new tokens each, greedy", flush=True)
    for name, engine in engines.items():
        reason = engine.runner.graphs_reason
        print(f"{name} engine: decode steps {'as CUDA graphs' if reason is None else 'eager (' + reason + ')'}")

    # warm-up: first calls pay for lazy initialisation on both sides, and the compiled engine
    # compiles here (batched steps and single-row steps), timed on its own
    run_hf(hf, prompts[:2], 2)
    compile_s = compile_wall = None
    for name, engine in engines.items():
        start = time.perf_counter()
        run_ours(engine, prompts[:2], 2)
        run_ours(engine, prompts[:1], 2)
        if name == "compiled":
            compile_wall = time.perf_counter() - start
            compile_s = engine.runner.compiled.compile_seconds
            print(f"compiled engine: compilation {compile_s:.1f} s (warm-up {compile_wall:.1f} s wall; "
                  f"inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", flush=True)

    hf_runs, hf_ttfts = [], []
    runs: dict[str, list] = {name: [] for name in engines}
    tokens: dict[str, list] = {}
    for r in range(args.repeats):
        wall, cpu, tokens["hf"] = run_hf(hf, prompts, args.new_tokens)
        hf_runs.append((wall, cpu))
        if not args.no_hf_ttft:
            hf_ttfts.append(run_hf(hf, prompts, 1)[0])
        line = f"  run {r + 1}: HF {wall:.2f} s wall / {cpu:.2f} s CPU"
        for name, engine in engines.items():
            wall, cpu, ttft, tpot, tokens[name] = run_ours(engine, prompts, args.new_tokens)
            runs[name].append((wall, cpu, ttft, tpot))
            line += f", {name} {wall:.2f} s wall / {cpu:.2f} s CPU"
        print(line, flush=True)
    hf_wall, hf_cpu = min(w for w, _ in hf_runs), min(c for _, c in hf_runs)
    hf_ttft = min(hf_ttfts) if hf_ttfts else float("nan")
    hf_tps = n_tokens / hf_wall
    hf_tpot = (hf_wall - hf_ttft) / max(1, args.new_tokens - 1)
    labels = {"eager": "phalanx.inference eager", "compiled": "phalanx.inference compiled",
              "ngram": "phalanx.inference eager + n-gram spec."}
    rows = [("Hugging Face generate (padded batch)", hf_tps, n_tokens / hf_cpu, hf_ttft, hf_tpot, hf_wall)]
    result = {"bench": "inference", "model": label, "workload": args.workload, "dtype": args.dtype,
              "threads": torch.get_num_threads(),
              "prompts": args.prompts, "new_tokens": args.new_tokens, "cuda_graphs": args.cuda_graphs,
              "prompt_tokens": sum(map(len, prompts)),
              "hf_tokens_per_s": round(hf_tps, 2), "hf_ttft_s": round(hf_ttft, 3) if hf_ttfts else None,
              "hf_ms_per_token": round(hf_tpot * 1000, 2) if hf_ttfts else None, **machine,
              "load_avg_1m_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    ratios = []
    for name in engines:
        best = min(runs[name])  # the fastest run, with its own TTFT and per-token latency
        cpu = min(c for _, c, _, _ in runs[name])
        tps = n_tokens / best[0]
        rows.append((labels[name], tps, n_tokens / cpu, best[2], best[3], best[0]))
        same_hf = sum(a == b for a, b in zip(tokens["hf"], tokens[name], strict=True))
        agree = sum(x == y for a, b in zip(tokens["hf"], tokens[name]) for x, y in zip(a, b)) / n_tokens
        ratios.append(f"{name} / HF: {tps / hf_tps:.2f}x wall-clock, {hf_cpu / cpu:.2f}x per CPU-second, "
                      f"identical greedy sequences {same_hf}/{args.prompts} (token agreement {agree:.1%})")
        result.update({f"{name}_tokens_per_s": round(tps, 2), f"{name}_ratio": round(tps / hf_tps, 3),
                       f"{name}_ratio_cpu_time": round(hf_cpu / cpu, 3), f"{name}_ttft_s": round(best[2], 3),
                       f"{name}_ms_per_token": round(best[3] * 1000, 2), f"{name}_identical_to_hf": same_hf})
    if "eager" in engines and "compiled" in engines:
        same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"], strict=True))
        ratios.append(f"compiled == eager greedy sequences: {same}/{args.prompts}")
        result["compiled_identical_to_eager"] = same
    if "ngram" in engines:
        spec = engines["ngram"].speculator
        line = f"n-gram speculation: {spec.num_accepted} of {spec.num_proposed} proposals accepted " \
               f"({spec.acceptance_rate:.1%}, all runs)"
        if "eager" in engines:
            same = sum(a == b for a, b in zip(tokens["eager"], tokens["ngram"], strict=True))
            line += f"; ngram == eager greedy sequences: {same}/{args.prompts}"
            result["ngram_identical_to_eager"] = same
        ratios.append(line)
        result["ngram_acceptance_rate"] = round(spec.acceptance_rate, 3)
    if compile_s is not None:
        result.update({"compile_s": round(compile_s, 2), "compile_warmup_wall_s": round(compile_wall, 2)})

    print(f"\n{'':40} {'tokens/s':>9} {'tok/CPU-s':>10} {'TTFT s':>8} {'ms/token':>9} {'wall s':>8}")
    for name, tps, cps, ttft, tpot, wall in rows:
        print(f"{name:40} {tps:9.1f} {cps:10.1f} {ttft:8.2f} {tpot * 1000:9.1f} {wall:8.2f}")
    print()
    for line in ratios:
        print(line)

    if not args.no_single:
        times = [hf_single_stream(hf, single, args.new_tokens) for _ in range(args.repeats)]
        hf_single = (min(t for t, _ in times), min(t for _, t in times))
        print(f"\nsingle stream ({len(single)}-token prompt, {args.new_tokens} new tokens): "
              f"{'':4}{'TTFT ms':>9} {'ms/token':>9}")
        print(f"  {'Hugging Face generate':38} {hf_single[0] * 1000:9.1f} {hf_single[1] * 1000:9.1f}")
        result.update({"single_hf_ttft_ms": round(hf_single[0] * 1000, 2),
                       "single_hf_ms_per_token": round(hf_single[1] * 1000, 2)})
        for name, engine in engines.items():
            times = [our_single_stream(engine, single, args.new_tokens) for _ in range(args.repeats)]
            ours = (min(t for t, _ in times), min(t for _, t in times))
            print(f"  {labels[name]:38} {ours[0] * 1000:9.1f} {ours[1] * 1000:9.1f}")
            result.update({f"single_{name}_ttft_ms": round(ours[0] * 1000, 2),
                           f"single_{name}_ms_per_token": round(ours[1] * 1000, 2)})
    if args.profile:
        for name, engine in engines.items():
            profile_engine(labels[name], engine, prompts, args.new_tokens)
    print(json.dumps(result))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
