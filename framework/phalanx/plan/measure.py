"""Measuring the peak memory of a few training steps on this rank, to check the plan against.

On a CPU-only machine the figure is resident memory (`phalanx.observe.memory.resident_bytes`):
"anon" is everything torch allocates (the device side), "shmem" the host pool of
`phalanx.hostmem` (offloaded optimizer state). glibc is first told to unmap freed blocks, or
resident memory lags live memory by what the allocator keeps for reuse
(`phalanx.malloc.follow_live_memory`). On a GPU the figure is
`torch.cuda.max_memory_allocated`. The baseline is taken after a warm-up step of a tiny model
(imports, thread pools, autograd's engine and the process group's first collectives take memory
once per process) and before the measured model is built.
"""
from __future__ import annotations

import gc
from typing import Any

import torch

from phalanx.malloc import follow_live_memory

# The warm-up model: a Llama of ~100k parameters, built before the baseline so that the
# per-process first-use memory is not counted in the measured peak.
_WARM_UP_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def _quiesce() -> None:
    from phalanx.observe.memory import release_free_memory

    gc.collect()
    release_free_memory()


def _train_steps(plugin_kwargs: dict, config: Any, seq: int, micro_batch: int, steps: int,
                 peak=None, seed: int = 0) -> list[float]:
    """Build `config`'s model, boost it with make_plugin(**plugin_kwargs), train `steps` AdamW
    steps on random tokens with the model's own loss; sample `peak` at every module's forward and
    backward. plugin_kwargs may hold "lora": {rank, target_modules} (adapters through
    `booster.enable_lora`, the optimizer built after them)."""
    from transformers import AutoModelForCausalLM

    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.device import to_device

    kwargs = dict(plugin_kwargs)
    name = kwargs.pop("name")
    checkpointing = kwargs.pop("checkpointing", False)
    lora = kwargs.pop("lora", None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing and name != "hybrid":
        model.activation_checkpointing_enable()
    if name == "hybrid":
        kwargs["gradient_checkpointing"] = checkpointing
    booster = Booster(plugin=make_plugin(name, **kwargs))
    if lora:
        import peft

        model = booster.enable_lora(model, peft.LoraConfig(r=lora["rank"], lora_alpha=2 * lora["rank"],
                                                           target_modules=list(lora["target_modules"])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt, *_ = booster.boost(model, opt)
    g = torch.Generator().manual_seed(1)  # the same tokens on every rank (tp ranks must see the same batch)
    handles = []
    if peak is not None:
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(peak.sample))
            handles.append(module.register_forward_hook(peak.sample))
    losses = []
    vocab = config.vocab_size
    for _ in range(steps):
        batch = to_device(torch.randint(0, vocab, (micro_batch, seq), generator=g))  # the run's device
        if peak is not None:
            peak.sample()
        out = model(input_ids=batch, labels=batch).loss
        booster.backward(out, opt)
        if peak is not None:
            peak.sample()
        opt.step()
        if peak is not None:
            peak.sample()
        opt.zero_grad()
        losses.append(float(out.detach()))
    for h in handles:
        h.remove()
    del model, opt, booster
    return losses


def _config(config_kwargs: dict) -> Any:
    """A transformers config: a LlamaConfig's fields, or any family's with "model_type"."""
    from transformers import AutoConfig, LlamaConfig

    kwargs = {"attn_implementation": "sdpa", **config_kwargs}
    model_type = kwargs.pop("model_type", "llama")
    return LlamaConfig(**kwargs) if model_type == "llama" else AutoConfig.for_model(model_type, **kwargs)


def _warm_up_config(config_kwargs: dict) -> dict:
    """The warm-up model: the measured model's family (a mixture of experts keeps its experts, so
    an expert-parallel plugin can split them) at the warm-up size."""
    if config_kwargs.get("model_type", "llama") == "llama":
        return dict(_WARM_UP_CONFIG)
    small = dict(config_kwargs, **_WARM_UP_CONFIG)
    if "moe_intermediate_size" in small:
        small["moe_intermediate_size"] = _WARM_UP_CONFIG["intermediate_size"]
    return small


def measure_training_peak(plugin_kwargs: dict, config_kwargs: dict, seq: int, micro_batch: int,
                          steps: int = 3) -> dict:
    """Per rank (call on every rank, e.g. through phalanx.testing.spawn): peak memory of
    `steps` training steps above the baseline, by kind ("anon" device, "shmem" host pool,
    "total"), in bytes. `plugin_kwargs`: make_plugin's arguments with "name" (and optionally
    "checkpointing", "lora"); `config_kwargs`: a LlamaConfig's, or another family's with "model_type"."""
    from phalanx.device import emulated
    from phalanx.observe.memory import PeakResident, resident_bytes

    if emulated():
        return {"skip": "the emulated GPU does not model real memory (docs/testing.md): measure on the CPU or a GPU"}
    if not follow_live_memory():
        return {"skip": "resident memory follows live memory only with glibc's mallopt"}
    # warm-up: the same plugin on a tiny model, so per-process first-use memory is in the baseline
    _train_steps(plugin_kwargs, _config(_warm_up_config(config_kwargs)), 16, 1, 2)
    _quiesce()
    config = _config(config_kwargs)
    base = resident_bytes()
    with PeakResident() as peak:
        losses = _train_steps(plugin_kwargs, config, seq, micro_batch, steps, peak=peak)
    _quiesce()
    out = {key: peak.max[key] - base[key] for key in ("anon", "shmem", "total") if key in base}
    out["losses"] = losses
    return out


def measure_many(cases: list[tuple[dict, dict, int, int]], steps: int = 3) -> list[dict]:
    """measure_training_peak for each (plugin_kwargs, config_kwargs, seq, micro_batch) in turn,
    in this process (one spawn for several layouts: starting ranks is the slow part)."""
    return [measure_training_peak(*case, steps=steps) for case in cases]
