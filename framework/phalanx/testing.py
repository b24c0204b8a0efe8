"""Helpers for multi-process tests and benchmarks: spawn N ranks on this machine.

`spawn(fn, world_size, *args)` starts `world_size` fresh processes on a free port, one thread per
rank, runs `phalanx.launch()` and then `fn(*args)` in each, and returns the list of per-rank
return values. A rank that raises makes `spawn` raise with that rank's traceback; ranks that do
not finish within `timeout` are killed.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    pass


def _child(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, threads: int,
           args: tuple, kwargs: dict, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PHALANX_THREADS": str(threads),
    })
    torch.set_num_threads(threads)
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    # `phalanx.launch` is the function (re-exported by phalanx/__init__), so `import phalanx.launch as m`
    # would bind the function: take the submodule from the import system instead.
    import importlib
    launch_mod = importlib.import_module("phalanx.launch")
    try:
        launch_mod.launch(seed=42, timeout_s=float(env.get("PHALANX_TEST_COLLECTIVE_TIMEOUT", 120)))
        value = fn(*args, **kwargs)
        payload = ("ok", value)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        with open(result_path, "wb") as f:
            pickle.dump(payload, f)
    except Exception:  # unpicklable value
        with open(result_path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
    finally:
        launch_mod.shutdown() if payload[0] == "ok" else None


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, threads: int = 1,
          env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results in rank order.

    `fn` must be importable (defined at module level) because ranks start as fresh processes.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    env = {k: v for k, v in (env or {}).items()}
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(key, "1")
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    with tempfile.TemporaryDirectory(prefix="phalanx-spawn-") as out_dir:
        procs = []
        for rank in range(world_size):
            p = ctx.Process(target=_child, args=(fn, rank, world_size, port, out_dir, threads, args, kwargs, env),
                            daemon=False)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results, errors = [], []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                code = procs[rank].exitcode
                why = "timed out" if rank in hung else f"exited with code {code} without a result"
                errors.append(f"rank {rank}: {why}")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank} raised:\n{value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            # The first real traceback is the useful one; timeouts of the others follow from it.
            errors.sort(key=lambda e: ("raised" not in e, e))
            raise RankFailed("\n\n".join(errors))
        return results


def tiny_llama_config(**overrides: Any):
    """A LlamaConfig small enough for multi-rank CPU tests (~100k parameters)."""
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(seed: int = 0, **overrides: Any):
    """A freshly initialised tiny `LlamaForCausalLM`, identical on every rank for a given seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token-id prompts left-padded to one width: how Hugging Face
    `generate` takes a batch (the baseline of the inference tests and bench/inference.py)."""
    from phalanx.train.data import pad_rows

    return pad_rows(prompts, pad_id, side="left")
