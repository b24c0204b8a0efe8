"""`phalanx serve MODEL`: an OpenAI-compatible server for a local HF model directory.

    phalanx serve path/to/model                         # http://127.0.0.1:8000/v1
    phalanx serve runs/ppo                              # a training output_dir: its latest checkpoint
    phalanx serve runs/ppo/checkpoints/step-00000200    # one checkpoint
    phalanx serve path/to/model --port 9000 --api-key sk-local --max-num-seqs 32 --max-queue 64
    phalanx serve path/to/model --tp-size 2             # restarts itself under torchrun, 2 ranks

The server (FastAPI + uvicorn, `pip install 'phalanx[serve]'`) holds at most --max-num-seqs
running plus --max-queue waiting requests and answers 429 beyond that; docs/serving.md has the
routes, limits and metrics.

MODEL is a Hugging Face model directory (config.json, weights, tokenizer), or what training wrote
(`model_dir`): a checkpoint directory, served from its `policy/` (the RLHF recipe's PPO export: the
actor alone, under its Hugging Face names) or else its `model/`; or a training output_dir, served
from its latest complete checkpoint the same way. The served model name defaults to the name of
the directory given.

With --tp-size N > 1 the command runs torchrun's agent, which starts this module on N ranks; rank
0 serves HTTP and drives the engine, the other ranks run their model shards for every step it
broadcasts. Ctrl-C (SIGINT) or SIGTERM stops it cleanly: the agent passes the signal on, the
other ranks ignore it and wait for rank 0, which stops serving and then tells them to stop.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from phalanx.checkpoint.find import CHECKPOINT_MODEL_DIRS, model_dir  # noqa: F401 - re-exported


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx serve", description="Serve a Llama-family HF model directory over "
                                "an OpenAI-compatible HTTP API.")
    p.add_argument("model", help="a local Hugging Face model directory (config.json, weights, tokenizer), a "
                   "training checkpoint (its policy/ or model/ is served) or a training output_dir (its latest "
                   "checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; the URL is printed)")
    p.add_argument("--api-key", default=os.environ.get("PHALANX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $PHALANX_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--max-tokens-limit", type=int, default=None, help="the largest max_tokens a request may ask for "
                   "(default: the context length); more is answered 400")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="the longest prompt in tokens (default: the "
                   "context length less one); longer is answered 400")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait beyond the --max-num-seqs "
                   "running ones; more are answered 429 with Retry-After (default 256)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (restarts under torchrun)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences batched together")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="tokens per engine step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV-cache budget on CPU, GiB per rank")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of the GPU the engine may use")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--draft-model", default=None, help="a small HF model directory (or checkpoint, output_dir) "
                   "for speculative decoding")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of equal prefixes")
    return p


_STOP = threading.Event()


def _interrupt(signum, frame):
    """SIGINT and SIGTERM stop the server the same way: they set the event `serve_forever` waits
    on (no exception raised into whatever the main thread is doing: a KeyboardInterrupt inside
    `Thread.join` can leave the HTTP thread marked finished while it runs, `OpenAIServer.serve_forever`).
    Only the first one counts: under torchrun a worker can get SIGINT twice (from the terminal's
    process group and from the agent passing it on)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _STOP.set()


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tp_size > 1 and "WORLD_SIZE" not in os.environ:
        from phalanx.torchrun import run_here
        return run_here(["-n", str(args.tp_size), "-m", "phalanx.inference.serve", *argv])
    if args.max_queue < 0:
        print(f"phalanx serve: --max-queue {args.max_queue} must be >= 0", file=sys.stderr)
        return 2
    try:
        model = model_dir(args.model)
        draft = model_dir(args.draft_model) if args.draft_model else None
    except FileNotFoundError as exc:
        print(f"phalanx serve: {exc}", file=sys.stderr)
        return 2
    if model != Path(args.model).expanduser() and os.environ.get("RANK", "0") == "0":
        print(f"phalanx serve: serving the model in {model}", flush=True)
    served_name = args.served_model_name or Path(args.model).expanduser().resolve().name
    return _serve(args, model, draft, served_name)


def _serve(args, model: Path, draft: Path | None, served_name: str) -> int:
    """Build the engine over `model` (every rank) and serve it (rank 0) until a signal."""
    from phalanx.inference.engine import LLM
    from phalanx.inference.server import OpenAIServer

    engine = LLM(model, tp_size=args.tp_size, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                 max_model_len=args.max_model_len, kv_cache_memory_gib=args.kv_cache_gib,
                 gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
                 draft_model=draft, num_speculative_tokens=args.num_speculative_tokens,
                 enable_prefix_caching=not args.no_prefix_caching)
    if not engine.tp.is_driver:
        # A worker that left on the signal would break the driver's last broadcast ("stop").
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        engine.run_worker()
        return 0
    # Explicitly, so the server stops on them even when started with SIGINT ignored (as a
    # non-interactive shell starts a background job), as torchrun's agent does.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    server = OpenAIServer(engine, host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=served_name, max_tokens_limit=args.max_tokens_limit,
                          max_prompt_tokens=args.max_prompt_tokens, max_queue=args.max_queue)
    print(f"phalanx serve: {server.model_name} on {server.url}/v1 ({engine.num_blocks} KV blocks of "
          f"{args.block_size} tokens, max_model_len {engine.max_model_len}, at most {server.loop.capacity} "
          "requests in flight"
          f"{', API key required' if server.api_key else ''}); Ctrl-C stops", flush=True)
    try:
        server.serve_forever(stop=_STOP)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
