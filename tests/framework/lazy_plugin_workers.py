"""What test_lazy_plugins.py runs on spawned ranks: a lazy (meta-device) model boosted by FSDP,
ZeRO-2 and Gemini, against the same model built eagerly, returning plain numbers and CPU tensors
(the assertions live in the test).

The model is a tiny Llama whose vocabulary (131) no world size divides (uneven FSDP rows, chunk
shards that cut parameters) with tied embeddings (one parameter under two names).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.testing import tiny_llama_config

VOCAB = 131
LR = 1e-2


def config():
    return tiny_llama_config(vocab_size=VOCAB, tie_word_embeddings=True)


def build_eager(seed: int = 3):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config())


def batch(seed: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (4, 12), generator=g)


def plugin(name: str, precision: str = "fp32"):
    from phalanx.booster.plugins import DDPPlugin, FSDPPlugin, GeminiPlugin, ZeroPlugin

    if name == "fsdp":
        return FSDPPlugin(precision=precision)
    if name == "zero2":
        return ZeroPlugin(stage=2, precision=precision)
    if name == "gemini":  # chunks of ~1,300 fp32 elements: 12 of them, several parameters cut by shards
        return GeminiPlugin(placement_policy="static", chunk_size_mb=0.005, precision=precision)
    if name == "ddp":
        return DDPPlugin(precision=precision)
    raise ValueError(name)


class ReadCounter:
    """Counts the tensor elements every `CheckpointSource` reads in this process."""

    def __enter__(self):
        from phalanx.lazy.sources import CheckpointSource

        self.cls, self.original, self.elements = CheckpointSource, CheckpointSource._read, 0
        counter = self

        def counted(source, tensor, param, dtype=None):
            counter.elements += tensor.numel()
            return counter.original(source, tensor, param, dtype)

        CheckpointSource._read = counted
        return self

    def __exit__(self, *exc):
        self.cls._read = self.original
        return False


def held_elements(name: str, booster, model) -> int:
    """Parameter elements this rank holds after boosting (its shards, or the whole model)."""
    from torch.distributed.tensor import DTensor

    if name == "gemini":
        return sum(c.shard_numel for c in booster.plugin.manager.chunks)
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.unwrapped.parameters())


def _boost(name: str, model, precision: str = "fp32", seed: int | None = None):
    from phalanx.booster import Booster

    booster = Booster(plugin=plugin(name, precision))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    if seed is not None:
        torch.manual_seed(seed)  # the random-init source draws its seed at boost
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _step(booster, model, opt) -> dict:
    """Logits on a fixed batch, then one training step on this rank's half of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().clone()
    local = ids.chunk(world)[rank]
    loss = model(input_ids=local, labels=local).loss
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    return {"logits": logits, "after_step": booster.plugin.full_model_state_dict(model)}


def load_suite(directory: str, names=("fsdp", "zero2", "gemini")) -> dict:
    """Per plugin: the eager model and the lazy one (from the checkpoint in `directory`), boosted
    the same way: gathered weights after boost and after one step, logits, what was read and held."""
    from phalanx import lazy

    total = sum(p.numel() for p in build_eager().parameters())
    out = {"total": total}
    for name in names:
        eager_booster, eager, eager_opt = _boost(name, build_eager())
        eager_state = eager_booster.plugin.full_model_state_dict(eager)
        eager_run = _step(eager_booster, eager, eager_opt)
        with ReadCounter() as counter:
            booster, model, opt = _boost(name, lazy.from_pretrained(directory))
        held = held_elements(name, booster, model)
        state = booster.plugin.full_model_state_dict(model)
        run = _step(booster, model, opt)
        out[name] = {"eager": eager_state, "lazy": state, "read": counter.elements, "held": held,
                     "eager_logits": eager_run["logits"], "lazy_logits": run["logits"],
                     "eager_after_step": eager_run["after_step"], "lazy_after_step": run["after_step"]}
    return out


def random_init_suite(names=("fsdp", "zero2", "gemini"), seed: int = 11) -> dict:
    """A lazy model initialised at random under each plugin, gathered, against the same lazy model
    materialised whole in one process with the same seed."""
    from phalanx import lazy

    torch.manual_seed(seed)
    reference = lazy.materialize(lazy.from_config(config())).state_dict()
    out = {"reference": {k: v.clone() for k, v in reference.items()}}
    for name in names:
        booster, model, _ = _boost(name, lazy.from_config(config()), seed=seed)
        out[name] = booster.plugin.full_model_state_dict(model)
    return out


def low_precision_suite(directory: str, names=("zero2", "gemini")) -> dict:
    """bf16 plugins loading a lazy fp32 checkpoint: the gathered fp32 masters (what a save writes)
    and this rank's bf16 compute weights, against the checkpoint's values."""
    from phalanx import lazy

    out = {}
    for name in names:
        booster, model, _ = _boost(name, lazy.from_pretrained(directory), precision="bf16")
        out[name] = {"masters": booster.plugin.full_model_state_dict(model),
                     "dtypes": sorted({str(p.dtype) for p in model.unwrapped.parameters()})}
        if name == "zero2":
            out[name]["weights"] = {n: p.detach().clone() for n, p in model.unwrapped.named_parameters()}
    return out


def export_suite(directory: str, out_dir: str, name: str = "fsdp", max_shard_size: int = 6000) -> dict:
    """Boost the lazy checkpoint, take one step, save with a tiny shard size (streamed), and
    return the full state (every rank) for the test to compare with `from_pretrained`."""
    from phalanx import lazy

    booster, model, opt = _boost(name, lazy.from_pretrained(directory))
    _step(booster, model, opt)
    booster.save_model(model, out_dir, max_shard_size=max_shard_size)
    return booster.plugin.full_model_state_dict(model)


def suite_2ranks(directory: str, export_dir: str) -> dict:
    """Everything the 2-rank test checks, in one spawn (starting a process group costs seconds)."""
    return {"load": load_suite(directory), "random": random_init_suite(),
            "low": low_precision_suite(directory), "export": export_suite(directory, export_dir)}


def suite_4ranks(directory: str, export_dir: str) -> dict:
    return {"load": load_suite(directory, names=("fsdp", "gemini")), "random": random_init_suite(names=("fsdp",)),
            "export": export_suite(directory, export_dir, name="gemini")}
