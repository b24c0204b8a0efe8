"""Lazy initialisation: build a model on the meta device (no memory), then materialise only
this rank's pieces when a plugin splits it.

    with phalanx.lazy.init_empty():
        model = AutoModelForCausalLM.from_config(config)      # random init happens later, per rank
    model = phalanx.lazy.from_pretrained("path/to/hf_dir")    # weights read later, only this rank's slices
    model, optimizer, *_ = booster.boost(model, optimizer)    # HybridParallelPlugin materialises

Random initialisation materialises one decoder layer (or one module outside the layers) at a
time at full size, runs the model's own `_init_weights` over it (children first, as transformers
does), and keeps this rank's pieces: peak memory is this rank's share of the model plus one layer.
Every rank draws the same random numbers (same seed, same order), so the pieces fit together.
Loading reads, for each split tensor, only the ranges this rank holds with `safetensors`'
`get_slice`. `materialize(model)` does the same for an unsplit model.

Every plugin accepts a lazy model (`phalanx.lazy.materialise` does the work; docs/big_models.md):
FSDPPlugin reads only this rank's rows of each parameter; GeminiPlugin fills its chunk shards
tensor by tensor (fp32 masters straight from the source); ZeroPlugin and DDPPlugin keep every
parameter whole on every rank by design and materialise it one tensor at a time in the compute
dtype; HybridParallelPlugin reads only this rank's tensor-parallel pieces.
"""
from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from phalanx.lazy.materialise import (buffers_first, flat_reader, materialise_fsdp_shards, materialise_whole,
                                     swap_in)
from phalanx.lazy.sources import CheckpointSource, RandomInitSource, flat_range, is_lazy, materialise_buffers

__all__ = ["init_empty", "from_config", "from_pretrained", "checkpoint_of", "source_for", "materialize",
           "materialise_buffers", "is_lazy", "CheckpointSource", "RandomInitSource", "flat_range", "flat_reader",
           "materialise_whole", "materialise_fsdp_shards", "buffers_first", "swap_in"]

# lazy model built by `from_pretrained` -> the Hugging Face directory its weights come from.
# Weak keys: the entry goes with the model. A copy of a lazy model (copy.deepcopy) is not in it.
_CHECKPOINTS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def init_empty() -> Iterator[None]:
    """Build modules on the meta device: shapes and dtypes only."""
    with torch.device("meta"):
        yield


def from_config(config, model_class=None) -> nn.Module:
    """A transformers model built from `config` on the meta device."""
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    with init_empty():
        return model_class.from_config(config)


def from_pretrained(path: str | Path, model_class=None, **config_overrides) -> nn.Module:
    """A model for the Hugging Face directory `path`, on the meta device; its weights are read
    (only this rank's slices) when it is boosted or `materialize`d."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} holds no config.json: not a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path, **config_overrides)
    model = from_config(config, model_class)
    _CHECKPOINTS[model] = str(path)
    return model


def checkpoint_of(model: nn.Module) -> str | None:
    """The directory `from_pretrained` built `model` from, or None."""
    return _CHECKPOINTS.get(model)


def source_for(model: nn.Module, device: torch.device | str = "cpu", seed: int | None = None, group=None):
    """Where a lazy model's values come from (None for a model that is already materialised).
    `seed` (random init only) defaults to a draw from the global generator; with a process
    `group` (collective: every rank of it calls), rank 0's draw, so that the pieces fit together
    even if the ranks' generators differ."""
    if not is_lazy(model):
        return None
    for prefix, module in model.named_modules():  # the model itself, or the one inside a wrapper
        path = checkpoint_of(module)
        if path is not None:
            return CheckpointSource(model, path, device=device, prefix=prefix)
    if seed is None and group is not None:
        seed = agreed_seed(group, device)
    return RandomInitSource(model, device=device, seed=seed)


def agreed_seed(group, device: torch.device | str = "cpu") -> int:
    """A draw from the global generator on the first rank of `group`, the same on every rank."""
    import torch.distributed as dist

    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        seed = seed.to(device)
        dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    return int(seed.item())


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Materialise a whole lazy model in place (no parallelism), e.g. for one process."""
    from phalanx.shard.tensor_parallel import materialise_params

    source = source_for(model, device)
    if source is not None:
        materialise_params(model, source)
        materialise_buffers(model, source)
    return model
