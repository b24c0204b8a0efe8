"""Reading Hugging Face weights into the runner's (fused, possibly sharded) parameters, from a
model directory or from a live state dict, without materialising what this rank does not hold.

A *source* yields `(name, read)` pairs, where `read(dim, start, length)` returns the tensor or,
with a dim, only that slice of it: safetensors files are read slice by slice (a TP rank touches
only its shard), in-memory tensors are narrowed views. Names are normalised so a state dict from
`LlamaForCausalLM` (or any supported family's model), its inner base model, a DDP/`torch.compile` wrapper or an FSDP2 model
(DTensors are gathered with `full_tensor()`) all load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

Reader = Callable[[int | None, int, int], torch.Tensor]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def normalize_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name.startswith(_BASE_MODEL_PREFIXES):
        name = "model." + name
    return name


def _narrow(tensor: torch.Tensor) -> Reader:
    def read(dim: int | None, start: int, length: int) -> torch.Tensor:
        t = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # DTensor (FSDP2/TP)
        return t if dim is None else t.narrow(dim, start, length)
    return read


def state_dict_source(state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, Reader]]:
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        yield name, _narrow(tensor.detach())


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    return [single] if single.exists() else sorted(path.glob("*.safetensors"))


def directory_source(path: str | Path) -> Iterator[tuple[str, Reader]]:
    """Weights of an HF model directory: safetensors (single or sharded) or pytorch_model*.bin."""
    path = Path(path)
    files = _safetensors_files(path)
    if files:
        from safetensors import safe_open
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, _safetensors_reader(f, name)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no weights in {path}: expected model.safetensors, a sharded "
                                "model.safetensors.index.json, or pytorch_model.bin")
    for file in bins:
        yield from state_dict_source(torch.load(file, map_location="cpu", weights_only=True, mmap=True))


def _safetensors_reader(handle, name: str) -> Reader:
    def read(dim: int | None, start: int, length: int) -> torch.Tensor:
        if dim is None:
            return handle.get_tensor(name)
        sl = handle.get_slice(name)
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return sl[index]
    return read


def load_weights(model, source: Iterable[tuple[str, Reader]], *, strict: bool) -> set[str]:
    """Copy every weight of `source` into `model` (a `DecoderModel`); returns the names loaded.

    Unknown names are an error (a different architecture or a wrong file); with `strict`, so are
    missing ones (an incomplete checkpoint).
    """
    loaded: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for raw_name, read in source:
            name = normalize_name(raw_name)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            try:
                targets = model.weight_targets(name)
            except KeyError:
                unknown.append(raw_name)
                continue
            for target in targets:
                dest, dim, start, length = target[:4]
                transpose = len(target) > 4 and target[4]
                src = read(dim, start, length)
                if transpose:  # stored [in, out] (GPT-2's Conv1D)
                    src, dim = src.t(), (None if dim is None else 1 - dim)
                view = dest if dim is None or dest.shape[dim] == length else dest.narrow(dim, 0, length)
                if tuple(src.shape) != tuple(view.shape):
                    raise ValueError(f"weight {raw_name!r} has shape {tuple(src.shape)} but this model (TP rank "
                                     f"{model.tp_rank} of {model.tp_size}) expects {tuple(view.shape)}; does the "
                                     "config match the weights?")
                view.copy_(src)
            loaded.add(name)
    if unknown:
        raise ValueError(f"{len(unknown)} weight(s) do not belong to a {model.spec.family} model of this shape, "
                         f"e.g. {unknown[:4]}")
    if strict:
        missing = sorted(model.expected_weight_names() - loaded)
        if missing:
            raise ValueError(f"{len(missing)} weight(s) missing from the checkpoint, e.g. {missing[:4]}")
    return loaded
