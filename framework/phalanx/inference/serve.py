"""`phalanx serve MODEL`: an OpenAI-compatible server for a local HF model directory.

    phalanx serve path/to/model                         # http://127.0.0.1:8000/v1
    phalanx serve runs/ppo                              # a training output_dir: its latest checkpoint
    phalanx serve runs/ppo/checkpoints/step-00000200    # one checkpoint
    phalanx serve path/to/model --port 9000 --api-key sk-local --max-num-seqs 32 --max-queue 64
    phalanx serve path/to/model --tp-size 2             # restarts itself under torchrun, 2 ranks
    phalanx serve base/ --lora sql=runs/sft/adapter --lora chat=runs/chat   # LoRA adapters, `model` picks one

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
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from phalanx.checkpoint.find import CHECKPOINT_MODEL_DIRS, model_dir  # noqa: F401 - re-exported
from phalanx.inference.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS


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
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto: bfloat16 on CUDA with bf16 and on CPUs with fast bf16 "
                   "(AMX), float32 elsewhere, whatever the checkpoint's dtype")
    p.add_argument("--draft-model", default=None, help="a small HF model directory (or checkpoint, output_dir) "
                   "for speculative decoding")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per step (draft model "
                   "or n-gram lookup)")
    p.add_argument("--prompt-lookup-max", type=int, default=0, help="n-gram speculation without a draft model: "
                   "propose what followed the latest earlier occurrence of the last n <= this many tokens (0: off)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="the shortest n-gram looked up")
    p.add_argument("--speculative-config", default=None, metavar="JSON", help="vLLM's form of the above: "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}' or "
                   "'{\"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 4}'")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks of equal prefixes")
    lora = p.add_argument_group("LoRA adapters (docs/serving.md: requests choose one by its name as `model`)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules "
                      "and --lora); adapters can also be loaded later with POST /v1/load_lora_adapter")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="PEFT adapters to load at start: a directory with adapter_config.json, or a LoRA training "
                      "run's output_dir (its adapter/)")
    lora.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="one more adapter, as in "
                      "--lora-modules (repeatable)")
    lora.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS, help="adapters loaded at once (each holds "
                      f"a slot of the stacked low-rank factors; default {DEFAULT_MAX_LORAS})")
    lora.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK, help="the largest adapter rank "
                      f"accepted (default {DEFAULT_MAX_LORA_RANK}); a larger one is refused")
    return p


def lora_modules(args) -> dict[str, str]:
    """NAME=PATH of --lora-modules and --lora as {name: path}; ValueError naming a malformed one."""
    modules: dict[str, str] = {}
    for entry in [*args.lora_modules, *args.lora]:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules/--lora takes NAME=PATH, got {entry!r}")
        if name in modules or name == args.served_model_name:
            raise ValueError(f"the LoRA adapter name {name!r} is given twice (or is the served model's name)")
        modules[name] = path
    return modules


SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def apply_speculative_config(args) -> None:
    """Read `--speculative-config` (vLLM's JSON) into the flags it stands for: method "ngram"
    (prompt_lookup_max, default 3, and prompt_lookup_min) or a draft "model"; ValueError naming
    what is wrong. Not combined with the flags themselves."""
    if args.speculative_config is None:
        return
    try:
        config = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config takes a JSON object, e.g. '{\"method\": \"ngram\"}'")
    unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {unknown} not supported (supported: {', '.join(SPECULATIVE_KEYS)})")
    if args.draft_model or args.prompt_lookup_max:
        raise ValueError("give speculative decoding once: --speculative-config or --draft-model/--prompt-lookup-max")
    method = config.get("method", "draft_model" if "model" in config else None)
    if method == "ngram" and "model" not in config:
        args.prompt_lookup_max = config.get("prompt_lookup_max", 3)
        args.prompt_lookup_min = config.get("prompt_lookup_min", 1)
    elif method in ("draft_model", "draft") and "model" in config and not {"prompt_lookup_max", "prompt_lookup_min"} & set(config):
        args.draft_model = config["model"]
    else:
        raise ValueError(f"--speculative-config: method {method!r} with keys {sorted(config)} is not supported; "
                         "use method 'ngram' (with prompt_lookup_max/min) or a draft 'model'")
    args.num_speculative_tokens = config.get("num_speculative_tokens", args.num_speculative_tokens)


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
    try:
        adapters = lora_modules(args)
        apply_speculative_config(args)
    except ValueError as exc:
        print(f"phalanx serve: {exc}", file=sys.stderr)
        return 2
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
    return _serve(args, model, draft, served_name, adapters)


def _serve(args, model: Path, draft: Path | None, served_name: str, adapters: dict[str, str]) -> int:
    """Build the engine over `model` (every rank) and serve it (rank 0) until a signal."""
    from phalanx.inference.engine import LLM
    from phalanx.inference.server import OpenAIServer

    engine = LLM(model, tp_size=args.tp_size, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                 max_model_len=args.max_model_len, kv_cache_memory_gib=args.kv_cache_gib,
                 gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
                 draft_model=draft, num_speculative_tokens=args.num_speculative_tokens,
                 prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min,
                 enable_prefix_caching=not args.no_prefix_caching,
                 **({"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
                    if adapters or args.enable_lora else {}))
    for name, path in adapters.items():
        try:
            engine.load_lora_adapter(name, path)
        except ValueError as exc:
            print(f"phalanx serve: {exc}", file=sys.stderr)
            return 2
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
