"""Helpers for multi-process tests and benchmarks: spawn N ranks on this machine.

`spawn(fn, world_size, *args)` starts `world_size` processes on a free port, one thread per
rank, runs `phalanx.launch()` and then `fn(*args)` in each, and returns the list of per-rank
return values. A rank that raises makes `spawn` raise with that rank's traceback; ranks that do
not finish within `timeout` are killed.

Ranks are forked from one server process that imported torch, torch.distributed, transformers (and
diffusers, when installed) once (multiprocessing's "forkserver"), not started as fresh
interpreters that import them again: the imports cost ~5 s of CPU per rank (a 4-rank start 20 s of
CPU on a 2-core machine, measured), a fork 0.1 s. Each rank gets the caller's environment as it
is at `spawn` time. `PHALANX_SPAWN_METHOD=spawn` restores fresh interpreters.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import atexit
import importlib.util

import torch
import torch.multiprocessing as mp

_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# imported once by the fork server, not by every rank: transformers' top package is lazy, so its
# model code is named too (a 4-rank spawn building Mixtral/Llama models: 46 -> 29 s per rank)
_PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils",
            "transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral", "diffusers")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    pass


def _context():
    """The multiprocessing context ranks start from (see the module docstring)."""
    method = os.environ.get("PHALANX_SPAWN_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"PHALANX_SPAWN_METHOD={method!r}: use 'forkserver' (default) or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # The server imports the hub libraries once, and they read these at import time.
        for key in _OFFLINE:
            os.environ.setdefault(key, "1")
        ctx.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return ctx


def _child(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, threads: int,
           args: tuple, kwargs: dict, env: dict[str, str]) -> None:
    os.environ.clear()  # a forked rank starts with the server's environment: take the caller's
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
        # A rank forked by the fork server ends with os._exit, which skips the interpreter's exit
        # handlers: run them here as a normally exiting process would (temporary directories and
        # other finalizers registered with atexit / weakref.finalize). Cleared once run.
        atexit._run_exitfuncs()


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, threads: int = 1,
          env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the per-rank results in rank order.

    `fn` must be importable (defined at module level) because ranks start as fresh processes.
    """
    ctx = _context()
    port = free_port()
    # The caller's environment, with the test defaults over it and the `env` argument over those.
    env = {**os.environ, **{key: "1" for key in _OFFLINE}, "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": str(threads), **(env or {})}
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


def train_one_process(model, batches, lr: float, weight_decay: float = 0.01, device=None) -> list[float]:
    """Plain torch on one process: AdamW over whole batches of token ids (each its own labels), the
    reference that parallel runs are compared with; returns the losses. `device`: where the model
    and the batches go (default: where the model is)."""
    if device is not None:
        model = model.to(device)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for batch in batches:
        batch = batch.to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class MasterWeights:
    """Plain torch's mixed precision on one process, the reference that low-precision runs are
    compared with: the model computes in `dtype` and the optimizer updates fp32 master copies of
    its parameters (`masters`, by name; build the optimizer on `masters.values()`). In fp32 the
    copies change nothing."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32):
        self.model = model.to(dtype)
        self.masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in self.model.named_parameters()}

    def step(self, optimizer: torch.optim.Optimizer, scale: float = 1.0, max_norm: float | None = None) -> float:
        """Move the model's gradients (divided by the loss `scale`) to the masters, clip them to
        `max_norm`, step and zero `optimizer`, copy the masters back; return the gradient norm."""
        for n, p in self.model.named_parameters():
            self.masters[n].grad = p.grad.float() / scale
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(list(self.masters.values()), max_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.masters[n])
        return norm.item()

    def state(self) -> dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m in self.masters.items()}


def boosted_step(booster, model, optimizer, ids: torch.Tensor) -> torch.Tensor:
    """One optimizer step of a boosted causal LM on this rank's token ids (their own labels):
    through the pipeline schedule under pp_size > 1, else forward + `booster.backward`. Returns
    this rank's loss (the batch's, on every pipeline rank)."""
    if getattr(booster.plugin, "pp_size", 1) > 1:
        loss = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), model, optimizer=optimizer)["loss"]
    else:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token-id prompts left-padded to one width: how Hugging Face
    `generate` takes a batch (the baseline of the inference tests and bench/inference.py)."""
    from phalanx.train.data import pad_rows

    return pad_rows(prompts, pad_id, side="left")


# ---------------------------------------------------------------------------- numerical comparisons
# The equivalence tests compare a distributed run with one plain process. Two measures, both
# relative, so that a tolerance means the same whatever the size of the values:
#   rel     |got − want| / |want| for numbers (the worst step of a list of losses); for a tensor,
#           max |got − want| / max |want| (relative to its magnitude; per tensor for a dict).
#   update  ‖Δgot − Δwant‖ / ‖Δwant‖ over all tensors, Δ = weights after training − before: the
#           fraction of what the optimizer changed that differs. AdamW normalises every element's
#           step to about ±lr, so rounding noise in a gradient that cancels to near zero moves that
#           weight by up to lr: a max-abs bound on the weights measures the noise, not the code.
#           Its floor: weights stored in a dtype hold an update only to their own rounding, so
#           `check` allows eps·‖want‖/‖Δwant‖ beyond the tolerance (one SGD step at lr 1e-2 moves
#           the tiny models' weights by 1/1000 of their norm: up to 6e-4 in fp32; 5 AdamW steps:
#           5e-7).
# Tolerances are multiples of the dtype's machine epsilon (`eps`); each states what was measured.
# With PHALANX_TOLERANCE_LOG=file every check appends a JSON line (test, what, measure, value, tol,
# floor, where) to it: docs/testing.md.

def eps(dtype: torch.dtype) -> float:
    """Machine epsilon: the gap between 1 and the next representable number (fp32 1.2e-7, bf16
    7.8e-3, fp16 9.8e-4)."""
    return torch.finfo(dtype).eps


# Safety factor of `rounding_rtol`: the largest fp32 rel error measured across the suites is
# 0.8·eps·√n (losses, logits, gradients, gradient norms, attention blocks; AVX-512 and AVX2
# kernels alike; docs/testing.md), so 8 leaves a factor of 10.
ROUNDING_SAFETY = 8.0


# The update measure of fp32 weights after AdamW steps. AdamW normalises each element's step, so
# an element whose gradient cancels to a few roundings carries that relative error (not bounded
# by eps) into a step of ~lr: no eps·√n bound holds. 1e-4 (840 eps): correct runs measure ≤ 7e-6
# (ZeRO with clipping on AVX2 kernels, 3.8e-7 on AVX-512; fit through tp2 6.8e-6); subtle bugs on
# the ZeRO recipe 2e-3 or more (weight decay ignored 4.6e-3, beta2 0.99 for 0.999 2.3e-3, a norm
# weight frozen 2e-2, lr 3% high 4.4e-2).
ADAMW_UPDATE_RTOL = 1e-4


# Low-precision runs (bf16/fp16 compute, fp32 master weights, AdamW) against the same recipe on
# one process: (loss rel, gradient-norm rel, update measure), in units of the dtype's eps (bf16
# 7.8e-3, fp16 9.8e-4). The roundings of a low-precision sum differ between orders by ~eps and
# Adam amplifies them as in fp32; a loss averages the independent roundings of its tokens. The
# worst measured (ZeRO, DDP/FSDP, tp2, pp2; AVX2 kernels change them by < 2x; docs/testing.md):
LOW_PRECISION_RTOL = {
    # eps/8, 1.3·eps, 13·eps: 1.9e-4, 1.8e-3, 0.067 (tp2: one more rounding per row-parallel sum)
    torch.bfloat16: (eps(torch.bfloat16) / 8, 1.3 * eps(torch.bfloat16), 13 * eps(torch.bfloat16)),
    # eps, eps, 31·eps: 7.1e-5, 2.1e-4, 0.021 (tp2)
    torch.float16: (eps(torch.float16), eps(torch.float16), 31 * eps(torch.float16)),
}


def rounding_rtol(dtype: torch.dtype, n: int) -> float:
    """Tolerance for the rel error of a value (loss, logits, gradient, gradient norm, an SGD
    update) computed by the same arithmetic with its sums in another order (sharded matmuls,
    all-reduce, microbatches): ROUNDING_SAFETY · eps · √n, n the length of the longest reduction
    behind it (for a loss or a weight gradient: the tokens of the batch). Two orders of an n-term
    sum differ by a random walk of about √n roundings of eps/2 each."""
    if n < 1:
        raise ValueError(f"reduction size n must be >= 1, got {n}")
    return ROUNDING_SAFETY * eps(dtype) * n ** 0.5


class Diff(NamedTuple):
    """A measured difference, where its worst part is, the measure's name and the part of it that
    the rounding of the compared values alone may explain (picklable, so rank functions can return
    it through `spawn`)."""

    value: float
    where: str = ""
    measure: str = "rel error"
    floor: float = 0.0


def _as_tensors(x) -> torch.Tensor:
    return x.detach().double().cpu() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def rel_diff(got, want) -> Diff:
    """The rel measure of a number, a tensor, a list of numbers or tensors (by index) or a dict of
    tensors (by key, every key of `want` must be in `got`); `where` names the worst entry."""
    if isinstance(want, dict):
        missing = sorted(set(want) - set(got))
        if missing or not want:
            raise AssertionError(f"nothing to compare: missing keys {missing}" if missing else "nothing to compare")
        parts = ((k, rel_diff(got[k], want[k])) for k in want)
        return max((Diff(d.value, f"{k} {d.where}".strip()) for k, d in parts), key=lambda d: d.value)
    if isinstance(want, (list, tuple)):
        if len(got) != len(want) or not want:
            raise AssertionError(f"got {len(got)} values for {len(want)} expected")
        parts = ((i, rel_diff(g, w)) for i, (g, w) in enumerate(zip(got, want, strict=True)))
        return max((Diff(d.value, f"[{i}] {d.where}".strip()) for i, d in parts), key=lambda d: d.value)
    g, w = _as_tensors(got), _as_tensors(want)
    if g.shape != w.shape:
        raise AssertionError(f"shape {tuple(g.shape)} != expected {tuple(w.shape)}")
    if not torch.isfinite(g).all():
        return Diff(float("inf"), "non-finite values")
    err = (g - w).abs()
    scale = w.abs().max().item() if w.numel() else 0.0
    worst = err.max().item() if err.numel() else 0.0
    where = ""
    if w.dim() and w.numel():
        where = str(tuple(int(i) for i in torch.unravel_index(err.argmax(), w.shape)))
    if scale == 0.0:
        return Diff(0.0 if worst == 0.0 else float("inf"), where)
    return Diff(worst / scale, where)


def update_diff(got, want, start) -> Diff:
    """The update measure ‖Δgot − Δwant‖ / ‖Δwant‖ (Δ = after − `start`) over every key of `want`
    (dicts of tensors, or three tensors); `where` names the tensor with the largest share of the
    difference."""
    if isinstance(want, torch.Tensor):
        got, want, start = {"tensor": got}, {"tensor": want}, {"tensor": start}
    missing = sorted((set(want) - set(got)) | (set(want) - set(start)))
    if missing or not want:
        raise AssertionError(f"nothing to compare: missing keys {missing}" if missing else "nothing to compare")
    num, den, rounding, worst, where = 0.0, 0.0, 0.0, -1.0, ""
    for k, want_k in want.items():
        s = _as_tensors(start[k])
        g, w = _as_tensors(got[k]), _as_tensors(want_k)
        if g.shape != w.shape or s.shape != w.shape:
            raise AssertionError(f"{k}: shapes {tuple(g.shape)}, {tuple(w.shape)}, start {tuple(s.shape)} differ")
        d = ((g - w) ** 2).sum().item()
        num, den = num + d, den + ((w - s) ** 2).sum().item()
        # two roundings of each element differ by at most ulp(w) <= eps·|w|
        dtype = want_k.dtype if isinstance(want_k, torch.Tensor) and want_k.is_floating_point() else torch.float64
        rounding += eps(dtype) ** 2 * (w ** 2).sum().item()
        if d > worst:
            worst, where = d, k
    if den == 0.0:
        raise AssertionError("the reference did not change: an update measure needs training to move the weights")
    return Diff((num / den) ** 0.5, str(where), "update error ‖Δgot−Δwant‖/‖Δwant‖", floor=(rounding / den) ** 0.5)


def check(diff: Diff, tol: float, what: str = "") -> float:
    """Assert `diff.value <= tol + diff.floor`, naming `what`, the worst entry and the measure;
    return the value."""
    value, where, measure, floor = diff
    log = os.environ.get("PHALANX_TOLERANCE_LOG")
    if log:
        import json

        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what, "measure": measure,
                                "value": value, "tol": tol, "floor": floor, "where": where}) + "\n")
    if not value <= tol + floor:  # also catches NaN
        at = f" at {where}" if where else ""
        rounding = f" + {floor:.3g} (the rounding of the compared values)" if floor else ""
        raise AssertionError(f"{what}: {measure} {value:.3g}{at} exceeds the tolerance {tol:.3g}{rounding}")
    return value


def assert_rel_close(got, want, tol: float, what: str = "") -> float:
    """`check(rel_diff(got, want), tol, what)`."""
    return check(rel_diff(got, want), tol, what)


def assert_update_close(got, want, start, tol: float, what: str = "") -> float:
    """`check(update_diff(got, want, start), tol, what)`."""
    return check(update_diff(got, want, start), tol, what)


def live_saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages that a causal LM's decoder forward (`model.model`) leaves held
    for backward, parameters excluded. Each saved tensor goes into a weakly referenced box that
    lives exactly as long as its graph node, so a side branch the model drops (a router's logits)
    neither counts nor aliases a later tensor's freed address. For checking activation estimates
    against what autograd really keeps (`phalanx.plan`)."""
    import weakref

    class Box:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    boxes = []

    def pack(t):
        box = Box(t)
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        out = model.model(input_ids=ids).last_hidden_state
    storages = {box.t.untyped_storage().data_ptr(): box.t.untyped_storage().nbytes()
                for box in (ref() for ref in boxes) if box is not None}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in params)
