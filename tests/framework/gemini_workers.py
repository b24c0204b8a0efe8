"""What test_gemini.py runs on spawned ranks: tiny-Llama training with GeminiPlugin in many
configurations per spawn, returning plain numbers (losses, the manager's own byte accounting,
resident memory as the kernel counts it) and CPU tensors; the assertions live in test_gemini.py.

Every run trains `tiny_llama(seed=0)` with AdamW on the global batches of `plugin_cases`, each
rank on its share, exactly like the single-process reference there.
"""
from __future__ import annotations

import gc

import torch

from phalanx.device import run_device, to_device
import torch.distributed as dist

from phalanx.testing import tiny_llama, train_one_process

from plugin_cases import LR, make_batches

CHUNK_MB = 0.01  # 2,621 fp32 elements: the tiny model (~27k parameters) spreads over 12 chunks
BUDGET = 1_000_000  # bytes: below the ~1.6 MB that params, gradients, Adam state and activations take together

CONFIGS = {
    "static": dict(placement_policy="static"),
    "static_offload": dict(placement_policy="static", offload_param_frac=0.5, offload_optim_frac=0.5,
                           shard_param_frac=0.5),
    "auto": dict(placement_policy="auto", device_memory_budget=BUDGET),
}


def _train(booster, model, opt, batches, accumulate: int = 1) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        local = to_device(batch.chunk(world)[rank], run_device())
        total = torch.zeros((), device=run_device())
        for mb in local.chunk(accumulate):
            loss = model(input_ids=mb, labels=mb).loss.float() / accumulate
            booster.backward(loss, opt)
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _model(seed: int = 0, checkpointing: bool = False, **overrides):
    model = tiny_llama(seed=seed, **overrides)
    if checkpointing:
        model.activation_checkpointing_enable() if hasattr(model, "activation_checkpointing_enable") \
            else model.gradient_checkpointing_enable()
        model.train()
    return model


def reference(checkpointing: bool = False, **overrides) -> list[float]:
    """Plain torch on one process (for model variants plugin_cases' reference does not build)."""
    return train_one_process(_model(0, checkpointing, **overrides), make_batches(), LR)


def build(config: str | dict, max_norm: float | None = None, seed: int = 0, precision: str = "fp32",
          checkpointing: bool = False, **model_overrides):
    from phalanx.booster import Booster
    from phalanx.booster.plugins.gemini import GeminiPlugin

    kwargs = dict(CONFIGS[config]) if isinstance(config, str) else dict(config)
    kwargs.setdefault("chunk_size_mb", CHUNK_MB)
    # A suite builds many models in one process. On an accelerator the auto policy's tracer
    # charges all device memory it does not own to this model's activations
    # (`memory_allocated()`), so the earlier runs' models, cyclic garbage, must be gone first.
    gc.collect()
    model = _model(seed, checkpointing, **model_overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    plugin = GeminiPlugin(precision=precision, max_norm=max_norm, **kwargs)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    return booster, plugin, model, opt


def run(config: str | dict, accumulate: int = 1, max_norm: float | None = None, steps: int = 5,
        keep_state: bool = False, **build_kwargs) -> dict:
    booster, plugin, model, opt = build(config, max_norm, **build_kwargs)
    losses = _train(booster, model, opt, make_batches(steps), accumulate)
    m = plugin.manager
    out = {"losses": losses, "peak_device": m.tiers.peak_device, "peak_with_reserve": m.tiers.peak_device_with_reserve,
           "budget": m.tiers.budget, "chunks": len(m.chunks), "stats": dict(m.stats),
           "sharded": sum(c.sharded for c in m.chunks), "grad_norm": opt.last_grad_norm}
    if keep_state:
        out["state"] = plugin.full_model_state_dict(model)
    return out


def save_after(config: str, directory: str, steps: int = 5) -> None:
    from phalanx.checkpoint import TrainState
    booster, plugin, model, opt = build(config)
    _train(booster, model, opt, make_batches(steps))
    booster.save_checkpoint(directory, model, opt, train_state=TrainState(step=steps))


def resume(plugin_factory, directory: str, start: int = 5, extra: int = 2) -> list[float]:
    """Load the checkpoint into a fresh model (another seed) and train `extra` more steps."""
    from phalanx.booster import Booster
    booster = Booster(plugin=plugin_factory())
    model = tiny_llama(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, opt, *_ = booster.boost(model, opt)
    state = booster.load_checkpoint(directory, model, opt)
    assert state.step == start
    return _train(booster, model, opt, make_batches(start + extra)[start:])


def gemini_factory(config: str):
    from phalanx.booster.plugins.gemini import GeminiPlugin
    return lambda: GeminiPlugin(precision="fp32", chunk_size_mb=CHUNK_MB, **CONFIGS[config])


def zero2_factory():
    from phalanx.booster.plugins.zero import ZeroPlugin
    return ZeroPlugin(stage=2, precision="fp32")


# ---------------------------------------------------------------------------- suites (one spawn each)
def two_rank_suite(ckpt: str) -> dict:
    import train_helpers as th

    out = {name: run(name) for name in CONFIGS}
    # phalanx.train.fit: its loss reads the LM head's weight directly, and eval calls the decoder
    out["fit"] = th.rank_each_plugin(ckpt + "-fit", ("gemini", "ddp"))
    out["auto_accumulate"] = run("auto", accumulate=2)
    out["static_clip"] = run("static", max_norm=0.5)
    out["auto_tied"] = run("auto", tie_word_embeddings=True)
    save_after("auto", ckpt)
    return out


def four_rank_suite(ckpt: str) -> dict:
    out = {name: run(name) for name in ("static", "auto")}
    out["resume_auto"] = resume(gemini_factory("auto"), ckpt)
    return out


def one_rank_suite(ckpt: str) -> dict:
    from phalanx.gemini import NotEnoughDeviceMemory

    out = {name: run(name) for name in ("static", "auto")}
    out["auto_checkpointing"] = run("auto", checkpointing=True)
    out["static_bf16"] = run("static", precision="bf16")
    out["resume_static"] = resume(gemini_factory("static"), ckpt)
    out["resume_zero2"] = resume(zero2_factory, ckpt)
    errors = {}
    for name, cfg in {"static": dict(placement_policy="static", device_memory_budget=200_000),
                      "auto": dict(placement_policy="auto", device_memory_budget=20_000)}.items():
        try:
            build(cfg)
        except NotEnoughDeviceMemory as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    out["bigger_than_ddp"] = bigger_than_ddp()
    return out


BIG = dict(hidden_size=64, intermediate_size=256, vocab_size=512, num_hidden_layers=4)


def ddp_bytes(n_params: int, activations: int) -> int:
    """What plain data parallelism holds on the device in fp32: weights, gradients, two Adam
    moments (16 bytes a parameter) and the activations."""
    return 16 * n_params + activations


def bigger_than_ddp(budget: int = 2_500_000) -> dict:
    """A model whose DDP footprint exceeds `budget` trains under it with Gemini auto."""
    booster, plugin, model, opt = build(dict(placement_policy="auto", device_memory_budget=budget,
                                             chunk_size_mb=0.05), **BIG)
    g = torch.Generator().manual_seed(7)
    batch = to_device(torch.randint(0, BIG["vocab_size"], (2, 16), generator=g), run_device())
    losses = []
    for _ in range(6):
        loss = model(input_ids=batch, labels=batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    m = plugin.manager
    n_params = sum(p.numel() for p in model.unwrapped.parameters())  # the chunks add < 1 element a rank each
    activations = max(plugin.tracer.by_position)
    return {"losses": losses, "ddp_bytes": ddp_bytes(n_params, activations), "budget": budget,
            "peak_device": m.tiers.peak_device, "peak_with_reserve": m.tiers.peak_device_with_reserve,
            "evictions": m.stats["evictions"]}


# ---------------------------------------------------------------------------- resident memory, measured
MEASURED_MODEL = dict(hidden_size=384, intermediate_size=1024, vocab_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)  # 7.3M parameters: 146 MB of model data
MEASURED_BUDGET = 32 * 2**20
MEASURED_CHUNK_MB = 1.0


def _return_freed_memory_to_the_kernel() -> bool:
    """glibc keeps freed blocks for reuse below a threshold it raises as the program frees large
    blocks, so resident memory lags behind live memory by whatever it decided to keep (measured:
    72 MiB resident for 33 MiB live in the budgeted run below). A fixed 64 KiB mmap threshold
    (every tensor bigger than that is unmapped when freed) and trim threshold make resident
    memory follow what is alive (`phalanx.malloc.follow_live_memory`). False where there is no
    glibc `mallopt`."""
    from phalanx.malloc import follow_live_memory

    return follow_live_memory()


def _sample_at_every_module(model, peak) -> list:
    """Sample resident memory at each module's forward start/end and backward start (on top of
    the sampling thread), so that no module step's working set goes unseen."""
    handles = []
    for module in model.unwrapped.modules():
        handles.append(module.register_forward_pre_hook(peak.sample))
        handles.append(module.register_forward_hook(peak.sample))
        if any(True for _ in module.parameters(recurse=False)):  # leaf modules return tensors
            handles.append(module.register_full_backward_pre_hook(peak.sample))
    return handles


def _measured_run(budget: int | None, steps: int = 3) -> dict:
    """Train MEASURED_MODEL with Gemini auto under `budget`; the peaks of resident memory over
    the steps, above what the process held before the model was built, by kind: on a CPU-only
    machine "device" is the kernel's RssAnon (everything torch allocates) and "host" its
    RssShmem (the host tier's pool, `phalanx.hostmem`). test_gemini_gpu.py measures a GPU."""
    import gc

    from phalanx.observe.memory import PeakResident, resident_bytes

    gc.collect()
    base = resident_bytes()
    booster, plugin, model, opt = build(dict(placement_policy="auto", device_memory_budget=budget,
                                             chunk_size_mb=MEASURED_CHUNK_MB), **MEASURED_MODEL)
    numels = [p.numel() for p in model.unwrapped.parameters()]
    batch = torch.randint(0, MEASURED_MODEL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    losses = []
    with PeakResident() as peak:
        handles = _sample_at_every_module(model, peak)
        for _ in range(steps):
            loss = model(input_ids=batch, labels=batch).loss
            booster.backward(loss, opt)
            peak.sample()
            opt.step()
            peak.sample()
            opt.zero_grad()
            losses.append(loss.item())
    for h in handles:
        h.remove()
    tiers = plugin.manager.tiers
    out = {"losses": losses, "numels": numels, "budget": tiers.budget,
           "device": peak.max["anon"] - base["anon"], "host": peak.max["shmem"] - base["shmem"],
           "accounted": tiers.peak_device_with_reserve, "evictions": plugin.manager.stats["evictions"]}
    del booster, plugin, model, opt, loss
    gc.collect()
    return out


def measured_memory_suite() -> dict:
    """One rank: Gemini auto without a device budget, then with MEASURED_BUDGET, on a model whose
    data (146 MB) is several times that budget, after a tiny warm-up run (imports, thread pools,
    autograd's engine: ~100 MB the first training step of a process takes once)."""
    if not _return_freed_memory_to_the_kernel():
        return {"skip": "resident memory follows live memory only with glibc's mallopt"}
    run("static", steps=1)
    unbounded = _measured_run(None)
    return {"unbounded": unbounded, "budget": _measured_run(MEASURED_BUDGET)}
