"""What test_gemini_disk.py runs on spawned ranks: Gemini with optimizer chunks on disk against the
same run in memory, checkpoints through the disk tier, resident memory under a host budget, and
the chunk-size search on a tiny Qwen2. Plain numbers and CPU tensors come back; the assertions
live in test_gemini_disk.py.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import gemini_workers as gw
from plugin_cases import LR, make_batches

from phalanx.testing import train_one_process

# tiny_llama at gw.CHUNK_MB (12 chunks), in the configurations of test_gemini.py
DISK_CONFIGS = {
    "auto": dict(placement_policy="auto", device_memory_budget=gw.BUDGET),
    "static_offload": dict(placement_policy="static", offload_param_frac=0.5, offload_optim_frac=0.5,
                           shard_param_frac=0.5),
}


def _disk_run(config: dict, steps: int = 5) -> dict:
    booster, plugin, model, opt = gw.build(config)
    losses = gw._train(booster, model, opt, make_batches(steps))
    m = plugin.manager
    out = {"losses": losses, "tiers": [c.optim_tier for c in m.chunks], "peak_host": m.tiers.peak_host,
           "host_budget": m.tiers.host_budget, "disk_bytes": m.tiers.bytes["disk"]}
    if m.disk is not None:  # before the state is gathered (which reads every file once more)
        store = m.disk.store
        out["disk_stats"] = dict(store.stats)
        out["files"] = sorted(os.listdir(store.directory))
        out["directory"] = store.directory
    reads = m.disk.store.stats["reads"] if m.disk is not None else 0
    out["state"] = plugin.full_model_state_dict(model)
    if m.disk is not None:
        out["save_reads"] = m.disk.store.stats["reads"] - reads
        out["params_on_disk"] = sum(len(c.params) for c in m.chunks if c.optim_tier == "disk")
    return out


def equivalence_suite(ckpt: str) -> dict:
    """Each configuration in memory, with every host optimizer chunk on disk, and (auto) with a
    host budget that puts only some of them there; then a checkpoint written through the disk tier."""
    out = {}
    for name, cfg in DISK_CONFIGS.items():
        out[name] = {"memory": _disk_run(cfg), "disk": _disk_run(dict(cfg, offload_to_disk=True))}
    # Everything on the host; then a host budget halfway between what that holds and what it
    # holds with all the optimizer state on disk: "auto" must put some chunks on disk, not all.
    spill = dict(placement_policy="static", offload_param_frac=1.0, offload_optim_frac=1.0)
    full, floor = _disk_run(spill), _disk_run(dict(spill, offload_to_disk=True))
    budget = (full["peak_host"] + floor["peak_host"]) // 2
    out["spill"] = {"memory": full, "all_disk": floor, "budget": budget,
                    "disk": _disk_run(dict(spill, host_memory_budget=budget, offload_to_disk="auto"))}
    out["world"] = dist.get_world_size()
    save_after(dict(DISK_CONFIGS["auto"], offload_to_disk=True), ckpt)
    return out


def two_rank_suite(ckpt: str) -> dict:
    out = equivalence_suite(ckpt)
    out["qwen2"] = chunk_search_suite({"2MiB": "2MiB", "too_small": 30_000})
    return out


def one_rank_suite(ckpt: str) -> dict:
    """After two_rank_suite wrote `ckpt`: equivalence on one rank, resuming, resident memory."""
    out = equivalence_suite(ckpt + "-one-rank")
    out["resume"] = resume_suite(ckpt)
    out["measured"] = measured_memory_suite()
    return out


def save_after(config: dict, directory: str, steps: int = 5) -> None:
    from phalanx.checkpoint import TrainState
    booster, plugin, model, opt = gw.build(config)
    gw._train(booster, model, opt, make_batches(steps))
    booster.save_checkpoint(directory, model, opt, train_state=TrainState(step=steps))


def resume_suite(ckpt: str) -> dict:
    """Resume the disk-tier checkpoint with the disk tier and in memory; save again from the disk
    tier and resume that too (load and save both go through the files)."""
    from phalanx.booster.plugins.gemini import GeminiPlugin

    def disk():
        return GeminiPlugin(precision="fp32", chunk_size_mb=gw.CHUNK_MB, offload_to_disk=True, **DISK_CONFIGS["auto"])

    out = {"disk": gw.resume(disk, ckpt), "memory": gw.resume(gw.gemini_factory("auto"), ckpt)}
    # the disk tier saves what it loaded: load into the disk tier, save at once, resume in memory
    from phalanx.booster import Booster
    from phalanx.checkpoint import TrainState
    from phalanx.testing import tiny_llama

    booster = Booster(plugin=disk())
    model = tiny_llama(seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, opt, *_ = booster.boost(model, opt)
    booster.load_checkpoint(ckpt, model, opt)
    booster.save_checkpoint(ckpt + "-again", model, opt, train_state=TrainState(step=5))
    out["resaved"] = gw.resume(gw.gemini_factory("auto"), ckpt + "-again")
    return out


# ---------------------------------------------------------------------------- resident memory, measured
MEASURED_MODEL = dict(hidden_size=256, intermediate_size=704, vocab_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
MEASURED_CHUNK_MB = 1.0


def _measured(config: dict, steps: int = 3) -> dict:
    """Train MEASURED_MODEL; the peak of the host pool (RssShmem) above what the process held
    before the model was built, over boost and training."""
    import gc

    from phalanx.observe.memory import PeakResident, resident_bytes

    gc.collect()
    base = resident_bytes()
    batch = torch.randint(0, MEASURED_MODEL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    losses = []
    with PeakResident() as peak:
        booster, plugin, model, opt = gw.build(dict(config, chunk_size_mb=MEASURED_CHUNK_MB), **MEASURED_MODEL)
        for _ in range(steps):
            loss = model(input_ids=batch, labels=batch).loss
            booster.backward(loss, opt)
            peak.sample()
            opt.step()
            peak.sample()
            opt.zero_grad()
            losses.append(loss.item())
    m = plugin.manager
    out = {"losses": losses, "host": peak.max["shmem"] - base["shmem"], "padded": sum(c.numel for c in m.chunks),
           "params": sum(p.numel() for p in model.unwrapped.parameters()),
           "accounted_host": m.tiers.peak_host, "disk_bytes": m.tiers.bytes["disk"],
           "on_disk": sum(c.optim_tier == "disk" for c in m.chunks), "chunks": len(m.chunks),
           "host_tensors": 4 * len(m.chunks)}  # at most: shard (= master), gradient, moments
    if m.disk is not None:
        out["disk_stats"] = dict(m.disk.store.stats)
    del booster, plugin, model, opt, loss
    gc.collect()
    return out


MEASURED_HOST_BUDGET = 48 * 2**20  # the host needs 53 MiB in memory (16 B a parameter), ~36 with the optimizer on disk
ALL_ON_HOST = dict(placement_policy="static", offload_param_frac=1.0, offload_optim_frac=1.0)


def measured_memory_suite() -> dict:
    """One rank: everything on the host, in memory, then with the optimizer state on disk under
    MEASURED_HOST_BUDGET; and the in-memory run under that budget, which must be refused."""
    from phalanx.gemini.placement import NotEnoughHostMemory

    if not os.path.exists("/proc/self/status"):
        return {"skip": "resident memory by kind is read from Linux /proc"}
    gw.run("static", steps=1)  # imports, thread pools, autograd's first-step allocations
    out = {"memory": _measured(ALL_ON_HOST),
           "disk": _measured(dict(ALL_ON_HOST, host_memory_budget=MEASURED_HOST_BUDGET, offload_to_disk="auto")),
           "budget": MEASURED_HOST_BUDGET}
    try:
        gw.build(dict(ALL_ON_HOST, host_memory_budget=MEASURED_HOST_BUDGET, chunk_size_mb=MEASURED_CHUNK_MB),
                 **MEASURED_MODEL)
    except NotEnoughHostMemory as exc:
        out["refused"] = str(exc)
    return out


# ---------------------------------------------------------------------------- chunk-size search
QWEN2 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=False, vocab_size=128)


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**QWEN2))


def qwen2_reference(steps: int = 3) -> list[float]:
    """Plain torch, one process, the whole global batch."""
    return train_one_process(tiny_qwen2(), make_batches(steps), LR)


def chunk_search_suite(budgets: dict[str, int | str], steps: int = 3) -> dict:
    """Gemini auto with no chunk size on a tiny Qwen2 under each budget: the losses and the
    chunk size chosen, or the refusal."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins.gemini import GeminiPlugin
    from phalanx.gemini import NotEnoughDeviceMemory

    out = {}
    for name, budget in budgets.items():
        model = tiny_qwen2()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        plugin = GeminiPlugin(placement_policy="auto", device_memory_budget=budget, precision="fp32")
        booster = Booster(plugin=plugin)
        try:
            model, opt, *_ = booster.boost(model, opt)
            losses = gw._train(booster, model, opt, make_batches(steps))
        except NotEnoughDeviceMemory as exc:
            out[name] = {"refused": str(exc)}
            continue
        m = plugin.manager
        out[name] = {"losses": losses, "chunk_numel": m.chunk_numel, "chunks": len(m.chunks),
                     "peak_with_reserve": m.tiers.peak_device_with_reserve, "budget": m.tiers.budget}
    return out
