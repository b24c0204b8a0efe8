"""Serving under load: `phalanx serve` driven by N concurrent streaming clients.

    python bench/serve.py                                  # SmolLM2-135M if cached, else a tiny Llama
    python bench/serve.py --model tiny --clients 1,8 --new-tokens 16
    python bench/serve.py --in-process --threads 1

`--dtype auto` (the default) is the engine's default for this machine (bfloat16 where bf16
computes faster than fp32, else float32), resolved here, printed, and passed on as that dtype.

The server runs as a subprocess (`python -m phalanx.cli serve ...`, the real command) unless
`--in-process`, which runs `OpenAIServer` in this process instead (its HTTP event loop and engine
thread then share the interpreter with the clients). For each client count in `--clients`, that
many clients each send one streaming /v1/completions request at the same moment (distinct
random-token prompts of `--prompt-len` tokens, `--new-tokens` new tokens, greedy, EOS ignored) and
time what they receive:

- throughput: all generated tokens / wall time from the first request to the last [DONE];
- TTFT: request sent -> first text chunk, p50 and p99 over the clients;
- inter-token: gaps between consecutive text chunks of a stream, p50 and p99 over all gaps (a
  chunk carries one token unless the client fell behind, when the server sends the text so far);
- TPOT: per stream (last chunk - first chunk) / (tokens - 1), mean over the clients.

Every stream is checked: HTTP 200, a finish_reason on the last chunk, `[DONE]`, and the usage's
completion_tokens equal to --new-tokens. The ratios printed are against the same server with one
client (when 1 is among --clients). Printed with the load average before and after and the
CPU kind: on a shared machine the numbers move with the neighbours' load. The last line is JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def smollm2_dir() -> Path:
    from phalanx.pretrained import default_dir, is_converted

    path = default_dir()
    return path if is_converted(path) else None


def tiny_llama_dir(out: Path) -> Path:
    """A random Llama (hidden 256, 4 layers). With SmolLM2 cached it gets SmolLM2's tokenizer (and
    vocabulary size); otherwise it has no tokenizer and the streams carry token ids (logprobs)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smol = smollm2_dir()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152 if smol else 32000, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    if smol:
        AutoTokenizer.from_pretrained(str(smol)).save_pretrained(out)
    return out


def cpu_kind() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def resolved_dtype(name: str) -> str:
    """`name`, or for "auto" the dtype the engine's `dtype="auto"` picks on this machine."""
    from phalanx.inference.model_runner import resolve_dtype
    from phalanx_kernels.accelerator import current_device

    return str(resolve_dtype(name, None, current_device())).removeprefix("torch.")


# -- the server ------------------------------------------------------------------------------------
class Subprocess:
    def __init__(self, model: Path, args) -> None:
        env = dict(os.environ)
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [sys.executable, "-m", "phalanx.cli", "serve", str(model), "--port", "0", "--dtype", args.dtype,
               "--max-num-seqs", str(max(args.clients)), "--max-queue", str(max(args.clients)),
               "--max-model-len", str(args.prompt_len + args.new_tokens + 8), "--kv-cache-gib", str(args.kv_cache_gib)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for_url(timeout=300)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _wait_for_url(self, timeout: float) -> str:
        deadline, seen = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            seen.append(line)
            if " on http://" in line:
                print(line.strip(), flush=True)
                return line.split(" on ")[1].split("/v1")[0]
        self.stop()
        raise SystemExit("phalanx serve did not start:\n" + "".join(seen)[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class InProcess:
    def __init__(self, model: Path, args) -> None:
        import torch

        from phalanx.inference import LLM, OpenAIServer

        if args.threads:
            torch.set_num_threads(args.threads)
        engine = LLM(str(model), dtype=args.dtype, max_num_seqs=max(args.clients),
                     max_model_len=args.prompt_len + args.new_tokens + 8, kv_cache_memory_gib=args.kv_cache_gib)
        self.server = OpenAIServer(engine, port=0, max_queue=max(args.clients)).start()
        self.url = self.server.url

    def stop(self) -> None:
        self.server.shutdown()


# -- the clients -----------------------------------------------------------------------------------
async def one_stream(client, url: str, prompt: list[int], new_tokens: int, token_logprobs: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if token_logprobs:  # a model without a tokenizer streams no text: count its tokens instead
        body["logprobs"] = 0
    sent = time.perf_counter()
    times, finish, usage, done = [], None, None, False
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["text"] or (choice.get("logprobs") or {}).get("tokens"):
                    times.append(time.perf_counter())
                finish = choice["finish_reason"] or finish
    if not done or finish is None or usage is None or usage["completion_tokens"] != new_tokens or not times:
        raise RuntimeError(f"malformed stream: done={done} finish={finish} usage={usage} chunks={len(times)}")
    return {"sent": sent, "times": times, "tokens": usage["completion_tokens"]}


async def one_round(url: str, prompts: list[list[int]], new_tokens: int, token_logprobs: bool) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, p, new_tokens, token_logprobs) for p in prompts))
        wall = time.perf_counter() - start
    ttft = [r["times"][0] - r["sent"] for r in results]
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / max(1, r["tokens"] - 1) for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": len(prompts), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
            "tpot_mean_ms": 1e3 * statistics.fmean(tpot)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="auto", help="'auto' (SmolLM2-135M if cached, else tiny), 'smollm2', "
                        "'tiny' (a random Llama), or an HF model directory")
    parser.add_argument("--clients", default="1,8,32,64", help="comma-separated concurrent client counts")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the server's dtype; auto: the engine's default for this machine (resolved here, "
                        "reported, and passed to the server as that concrete dtype)")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--in-process", action="store_true", help="run the server in this process")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.dtype = resolved_dtype(args.dtype)

    tmp = tempfile.TemporaryDirectory()
    if args.model in ("auto", "smollm2"):
        model = smollm2_dir()
        if model is None and args.model == "smollm2":
            raise SystemExit("SmolLM2-135M is not cached; run the llama recipe's convert step or use --model tiny")
        model = model or tiny_llama_dir(Path(tmp.name) / "tiny-llama")
    elif args.model == "tiny":
        model = tiny_llama_dir(Path(tmp.name) / "tiny-llama")
    else:
        model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    no_tokenizer = not any((model / f).exists() for f in ("tokenizer.json", "tokenizer.model"))

    import torch

    g = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()
    print(f"model {model.name}, {args.dtype}, prompts {args.prompt_len} tokens, {args.new_tokens} new tokens; "
          f"CPU {cpu_kind()}; load average {load_before[0]:.2f}", flush=True)
    server = (InProcess if args.in_process else Subprocess)(model, args)
    rows = []
    try:
        warm = [torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.warmup)]
        if warm:
            asyncio.run(one_round(server.url, warm, args.new_tokens, no_tokenizer))
        for n in args.clients:
            prompts = [torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
            row = asyncio.run(one_round(server.url, prompts, args.new_tokens, no_tokenizer))
            row["load_avg_1m"] = os.getloadavg()[0]
            rows.append(row)
            print(f"clients {n:3d}: {row['tokens_per_s']:8.1f} tokens/s | TTFT p50 {row['ttft_p50_ms']:8.1f} ms "
                  f"p99 {row['ttft_p99_ms']:8.1f} ms | inter-token p50 {row['itl_p50_ms']:7.1f} ms "
                  f"p99 {row['itl_p99_ms']:7.1f} ms | TPOT {row['tpot_mean_ms']:7.1f} ms | "
                  f"{row['wall_s']:.1f} s, load {row['load_avg_1m']:.2f}", flush=True)
    finally:
        server.stop()
        tmp.cleanup()
    one = next((r for n, r in zip(args.clients, rows) if n == 1), None)
    if one is not None:  # the peer: the same server with one client
        for n, row in zip(args.clients, rows):
            if n != 1:
                row["throughput_vs_one_client"] = row["tokens_per_s"] / one["tokens_per_s"]
                print(f"{n} clients / 1 client: {row['throughput_vs_one_client']:.2f}x throughput, "
                      f"TTFT p50 {row['ttft_p50_ms'] / one['ttft_p50_ms']:.2f}x", flush=True)
    print(json.dumps({"model": model.name, "dtype": args.dtype, "cpu": cpu_kind(), "threads": args.threads,
                      "in_process": args.in_process, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                      "load_avg_before": load_before[0], "load_avg_after": os.getloadavg()[0], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
