"""Model weights in the Hugging Face layout: safetensors shards + index json + config.

A `transformers` model is written with its own `save_pretrained` (given our gathered full state
dict), so `AutoModelForCausalLM.from_pretrained(dir)` opens it unchanged. Any other module is
written with `huggingface_hub.save_torch_state_dict`, the same shard/index layout.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file
from torch import nn

from phalanx.checkpoint.atomic import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _drop_aliases(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied parameters (e.g. lm_head = embed_tokens) appear under several names; keep the first."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        else:
            seen[id(p)] = name
    return {k: v for k, v in state_dict.items() if k not in aliases}


def save_hf_model(model: nn.Module, state_dict: dict[str, torch.Tensor], directory: str | Path, *,
                  max_shard_size: str | int = "2GB", shard: bool = True, dtype: torch.dtype | None = None,
                  tokenizer=None) -> None:
    """Write `state_dict` (full, CPU) for `model` (unwrapped) into `directory`. Rank 0 only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state_dict = _drop_aliases(model, state_dict)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    state_dict = {k: v.detach().contiguous() for k, v in state_dict.items()}
    size = max_shard_size if shard else "1000GB"
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        if dtype is not None:
            model.config.dtype = dtype
        model.save_pretrained(directory, state_dict=state_dict, max_shard_size=size)
    else:
        from huggingface_hub import save_torch_state_dict
        save_torch_state_dict(state_dict, directory, max_shard_size=size)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def load_hf_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a HF-layout directory (sharded or single file) onto the CPU."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"model directory {str(directory)!r} does not exist")
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            path = directory / shard
            if not path.is_file():
                raise CheckpointError(f"{index} names shard {shard}, which is missing: the checkpoint is partial")
            state.update(load_file(path))
        return state
    single = directory / SINGLE
    if single.is_file():
        return load_file(single)
    raise CheckpointError(f"{str(directory)!r} holds neither {SINGLE} nor {INDEX}: not a Hugging Face "
                          "safetensors model directory")


def check_state_dict_matches(model: nn.Module, state_dict: dict[str, torch.Tensor],
                             shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Fail with the names and shapes that differ, before anything is overwritten. `shapes`
    overrides the model's own (full shapes of a model split in place)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected.update(shapes or {})
    tied = set(expected) - set(_drop_aliases(model, expected))
    missing = [k for k in expected if k not in state_dict and k not in tied
               and not k.endswith(("rotary_emb.inv_freq", "original_inv_freq"))]
    unexpected = [k for k in state_dict if k not in expected]
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs model {expected[k]}"
             for k, v in state_dict.items() if k in expected and tuple(v.shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} key(s), e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s), e.g. {unexpected[:3]}")
    if wrong:
        problems.append(f"shape mismatch: {wrong[:3]}")
    if problems:
        raise CheckpointError("the checkpoint does not fit this model (" + "; ".join(problems) +
                              "): load it into a model built from the same config")


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    """Hide transformers' "Writing model shards" bar while a checkpoint is saved (it would print
    one bar per checkpoint into the training log), restoring the user's setting afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
