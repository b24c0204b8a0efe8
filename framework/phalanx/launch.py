"""Process start-up: read torchrun's environment, pick device and backend, seed, shut down.

`launch()` works the same under `torchrun` (or `phalanx run`) and as a plain single process: in
the latter case it creates a one-rank process group, so every plugin runs through the same code
path whatever the world size.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from phalanx.malloc import keep_freed_memory
from phalanx_kernels.accelerator import EMULATED_TYPE, accelerator_type, device_module, display


@dataclass(frozen=True)
class DistContext:
    """What a rank knows about itself after `launch()`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_CONTEXT: DistContext | None = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc


def choose_device_and_backend(local_rank: int) -> tuple[torch.device, str]:
    """The accelerator with its collective backend when there is one (CUDA with NCCL; the emulated
    GPU with its NCCL path, see phalanx.emulate), else CPU with gloo (never a mixed backend string
    on a real GPU: 'cpu:gloo,cuda:nccl' fails on machines without NCCL)."""
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu"), "gloo"
    module = device_module(kind)
    index = local_rank % module.device_count()
    module.set_device(index)
    if kind == "cuda":
        return torch.device("cuda", index), "nccl"
    from phalanx.emulate.collectives import BACKEND

    return torch.device(kind, index), BACKEND


def uses_nccl_path(backend: str) -> bool:
    """Whether collectives of this backend take device tensors only (NCCL, and the emulated GPU's)."""
    return backend == "nccl" or EMULATED_TYPE in backend


def set_cpu_threads(local_world_size: int, threads: int | None = None) -> int:
    """Give each rank an equal share of the cores so ranks on one host do not oversubscribe.
    OMP_NUM_THREADS is not read (`phalanx run` and torchrun set it to 1 for every rank before this
    share is known): PHALANX_THREADS or `threads` set the count."""
    if threads is None:
        threads = _env_int("PHALANX_THREADS", 0) or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int, rank: int = 0, *, per_rank: bool = False) -> None:
    """Seed python, numpy and torch. With per_rank=True each rank gets seed + rank (for data
    augmentation noise); model initialisation uses the same seed everywhere."""
    s = seed + (rank if per_rank else 0)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


def elastic_attempt_store(world_size: int, timeout: _dt.timedelta) -> dist.Store | None:
    """A store of this restart attempt's own, when torchrun's agent hosts the store.

    Why: torchrun's c10d rendezvous starts one TCPStore in the agent and keeps it for every
    restart, and torch's env:// initialisation connects the workers to it without a per-attempt
    prefix. After a restart the new workers find the previous attempt's keys (gloo's rank
    addresses), connect to a dead worker's old port and fail with "Connection refused" in
    connectFullMesh. Prefixing the keys with the restart count gives every attempt clean keys.

    The restart count is the agent's own: on one node every worker agrees. On several nodes the
    agents may count differently (one restarts after a failure, another after being asked to
    re-rendezvous), so `phalanx run` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead, which
    makes each rendezvous round start a fresh store on a fresh port (then this returns None).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500), world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"phalanx/attempt{attempt}", client)


def launch(
    seed: int | None = 42,
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
    threads: int | None = None,
) -> DistContext:
    """Initialise the process group from torchrun's environment (or a one-rank group).

    Calling it twice returns the existing context.
    """
    global _CONTEXT
    if _CONTEXT is not None and dist.is_initialized():
        return _CONTEXT
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}; start ranks with torchrun or `phalanx run`")
    device, default_backend = choose_device_and_backend(local_rank)
    backend = backend or default_backend
    set_cpu_threads(local_world_size, threads)
    if device.type == "cpu":
        keep_freed_memory()  # phalanx.malloc: large blocks reused step to step, not faulted in again
    timeout = _dt.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL's eager init: real GPUs only
            store = elastic_attempt_store(world_size, timeout)
            if store is not None:
                kwargs["store"] = store
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        else:
            if world_size != 1:
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: start multi-process runs with "
                    "`phalanx run -n N script.py` or torchrun"
                )
            store = dist.HashStore()
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout, **kwargs)
    if device.type == "cpu" and world_size > 1:
        from phalanx_kernels.capability import agree_across_ranks

        agree_across_ranks()  # one precision decision for all ranks (see its docstring)
    if seed is not None:
        seed_everything(seed, rank)
    if rank == 0 and device.type == EMULATED_TYPE:
        print(f"phalanx: {world_size} rank(s), device {display(device)}, backend {backend} (PHALANX_EMULATE_GPU=1)",
              flush=True)
    elif rank == 0 and device.type == "cuda":  # which GPU a run is on, said once at its start
        print(f"phalanx: {world_size} rank(s), device {display(device)} ({torch.cuda.get_device_name(device)}), "
              f"backend {backend}", flush=True)
    _CONTEXT = DistContext(rank, world_size, local_rank, local_world_size, device, backend)
    _destroy_at_exit()
    return _CONTEXT


_EXIT_HOOK = False


def _destroy_at_exit() -> None:
    """Destroy the process group at interpreter exit if the script did not (it never called
    `shutdown`, or its body raised). Without this the group is torn down during the C++ static
    destruction that follows Python's, where a collective thread still joinable aborts the
    process (SIGABRT, "terminate called without an active exception") and a finished job reads
    as failed. No barrier: at exit another rank may already be gone."""
    global _EXIT_HOOK
    if not _EXIT_HOOK:
        atexit.register(_destroy_process_group_quietly)
        _EXIT_HOOK = True


def _destroy_process_group_quietly() -> None:
    global _CONTEXT
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _CONTEXT = None


def context() -> DistContext:
    """The context of the current process, launching a one-rank group if nothing launched yet."""
    if _CONTEXT is None or not dist.is_initialized():
        return launch(seed=None)
    return _CONTEXT


def barrier() -> None:
    """Wait for every rank (nothing to wait for with one rank or no process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group (call at the end of a script; safe to call twice)."""
    global _CONTEXT
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
    _CONTEXT = None


@contextlib.contextmanager
def launched(**launch_kwargs):
    """`with launched(seed=...) as ctx:` — `launch(...)`, then `shutdown()` however the block ends:
    the body of every recipe command's `main`."""
    ctx = launch(**launch_kwargs)
    try:
        yield ctx
    finally:
        shutdown()


class CollectiveError(RuntimeError):
    """A collective failed (most often a timeout because another rank died or diverged)."""


@contextlib.contextmanager
def collective(operation: str):
    """Wrap collectives so a failure names this rank and the operation that hung or broke."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        hint = ""
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            hint = (" (timed out: another rank probably crashed or is stuck before the same collective; "
                    "check its log, or raise launch(timeout_s=...))")
        raise CollectiveError(f"rank {rank}: collective '{operation}' failed{hint}: {exc}") from exc
