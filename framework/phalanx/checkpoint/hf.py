"""Model weights in the Hugging Face layout: safetensors shards + index json + config.

`save_hf_model` streams: it takes the full tensors one at a time (a plugin's
`iter_full_model_state`) and writes each safetensors file as soon as it is full, in the layout
`save_pretrained` writes (`model.safetensors`, or `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`), with config.json for a `transformers` model, so
`AutoModelForCausalLM.from_pretrained(dir)` opens it unchanged. No pickle anywhere.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import load_file
from torch import nn

from phalanx.checkpoint.atomic import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _alias_names(model: nn.Module) -> set[str]:
    """Names under which a tied parameter (e.g. lm_head = embed_tokens) appears after its first."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        else:
            seen.add(id(p))
    return aliases


def names_not_saved(model: nn.Module) -> set[str]:
    """A tied parameter's later names and a transformers model's `_keys_to_ignore_on_save`: the
    state-dict keys an export leaves out."""
    from transformers import PreTrainedModel

    ignored = getattr(model, "_keys_to_ignore_on_save", None) if isinstance(model, PreTrainedModel) else None
    return _alias_names(model) | set(ignored or [])


def _drop_aliases(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied parameters appear under several names; keep the first."""
    aliases = _alias_names(model)
    return {k: v for k, v in state_dict.items() if k not in aliases}


@dataclass
class ExportStats:
    """What `save_hf_model` wrote, and the most tensor bytes it held at once (the writer's memory
    bound: one shard of `max_shard_size` plus the tensor that does not fit in it)."""

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_bytes: int = 0
    peak_bytes_held: int = 0
    streamed: bool = True


def parse_shard_size(size: str | int) -> int:
    """"2GB" / "500MB" / "64MiB" / an int (bytes) -> bytes, as `save_pretrained` reads them
    (transformers' own parser: GB decimal, GiB binary)."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        return convert_file_size_to_int(size)
    except ValueError:
        raise ValueError(f"max_shard_size={size!r}: use bytes (an int) or a size such as '2GB', '500MB', "
                         "'64MiB'") from None


class ShardedSafetensorsWriter:
    """Writes `(name, tensor)` pairs into safetensors files of at most `max_bytes` each (a tensor
    larger than that gets a file of its own), holding one file's tensors at a time. `finish`
    names the files `model-0000i-of-0000n.safetensors` and writes the index, or a single
    `model.safetensors` when one file was enough — the layout `save_pretrained` produces."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = ExportStats()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[Path, list[str]]] = []
        self._numel = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view of a larger buffer: write (and hold) only its own bytes
        size = tensor.numel() * tensor.element_size()
        self.stats.peak_bytes_held = max(self.stats.peak_bytes_held, self._pending_bytes + size)
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.stats.tensors += 1
        self.stats.total_bytes += size
        self._numel += tensor.numel()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = self.directory / f"model-{len(self._parts) + 1:05d}.safetensors.part"
        save_file(self._pending, str(part), metadata={"format": "pt"})
        self._parts.append((part, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> ExportStats:
        if self._pending or not self._parts:
            self._flush()
        n = len(self._parts)
        if n == 1:
            self._parts[0][0].replace(self.directory / SINGLE)
            self.stats.files = [SINGLE]
            return self.stats
        weight_map = {}
        for i, (part, names) in enumerate(self._parts, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            part.replace(self.directory / final)
            self.stats.files.append(final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.stats.total_bytes, "total_parameters": self._numel},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self.stats


def _needs_transformers_writer(model: nn.Module) -> bool:
    """transformers models whose saved names or layout differ from their state dict (weight
    conversions such as fused MoE experts, quantizers, adapters) are written by `save_pretrained`,
    which needs the whole state dict at once."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "_hf_peft_config_loaded", False):
        return True
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:
            return False
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    return bool(conversions)


def save_hf_model(model: nn.Module, state_dict: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                  directory: str | Path, *, max_shard_size: str | int = "2GB", shard: bool = True,
                  dtype: torch.dtype | None = None, tokenizer=None) -> ExportStats:
    """Write the full weights of `model` (unwrapped) into `directory`, in the layout
    `from_pretrained` reads. Rank 0 only.

    `state_dict`: a dict, or `(name, full CPU tensor)` pairs (a plugin's `iter_full_model_state`),
    consumed one at a time: safetensors files are written as they fill, so the writer holds at
    most one file of `max_shard_size` plus one tensor, never the whole model. Tied aliases are
    dropped, `dtype` casts floating tensors as they come. A transformers model also gets its
    config.json (and generation_config.json); one whose weights are renamed or fused on save
    (`_needs_transformers_writer`) is written by `save_pretrained`, from the whole state dict."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pairs = state_dict.items() if isinstance(state_dict, dict) else state_dict
    size = parse_shard_size(max_shard_size) if shard else 2**62
    from transformers import PreTrainedModel

    is_hf = isinstance(model, PreTrainedModel)
    if is_hf and _needs_transformers_writer(model):
        return _save_with_transformers(model, dict(pairs), directory, size, dtype, tokenizer)
    skipped = names_not_saved(model)
    writer = ShardedSafetensorsWriter(directory, size)
    written_dtype = None
    for name, tensor in pairs:
        if name in skipped:
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if written_dtype is None and tensor.is_floating_point():
            written_dtype = tensor.dtype
        writer.add(name, tensor)
        del tensor
    stats = writer.finish()
    _write_metadata(model, directory, written_dtype, tokenizer)
    return stats


def _write_metadata(model: nn.Module, directory: Path, written_dtype: torch.dtype | None, tokenizer) -> None:
    """config.json (and generation_config.json) of a transformers model, and the tokenizer."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        config = copy.deepcopy(model.config)
        config.dtype = str(written_dtype or model.dtype).split(".")[1]
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
        config.save_pretrained(directory)
        if model.can_generate() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


@dataclass
class SpreadModelCopy:
    """A copy of the full model held across the ranks for a background write: every rank keeps
    the tensors it will write (about 1/N of the model) and knows which file each tensor goes to.
    `write_spread_model` writes them as one Hugging Face sharded export, a file per owning rank."""

    files: dict[str, str]                 # tensor name -> file name, the same on every rank
    tensors: dict[str, torch.Tensor]      # this rank's tensors (copies)
    total_bytes: int
    numel: int
    dtype: torch.dtype | None             # the first floating tensor's, as config.json records it


def spreads(model: nn.Module) -> bool:
    """Whether a model's export can be spread over the ranks (not when transformers renames or
    fuses its weights on save: that writer needs the whole state dict)."""
    from transformers import PreTrainedModel
    return not (isinstance(model, PreTrainedModel) and _needs_transformers_writer(model))


class SpreadOwners:
    """Which rank keeps each tensor of a `SpreadModelCopy`, decided the same way on every rank
    from what every rank knows (the tensors' names, shapes and dtypes in one order), so no rank
    has to tell the others.

    Each tensor goes to the rank that holds the fewest bytes so far. When only some ranks have
    the tensor already (`holders`: e.g. the ranks of the pipeline stage that gathered it), the
    least-loaded of them keeps it unless that takes it past `cap` (about total/N), in which case
    the least-loaded rank of all does and the tensor is sent there: few tensors move, and no rank
    ends above cap plus one tensor (the least-loaded rank holds at most the average so far)."""

    def __init__(self, world: int, cap: int | None = None):
        self.world = world
        self.cap = cap
        self.held = [0] * world
        self.owner_of: dict[str, int] = {}
        self.numel = 0
        self.dtype: torch.dtype | None = None

    def assign(self, name: str, shape: Iterable[int], dtype: torch.dtype, holders: Iterable[int] | None = None) -> int:
        """The owner of tensor `name` (call in the same order on every rank)."""
        numel = math.prod(shape)
        size = numel * dtype.itemsize
        least = min(range(self.world), key=lambda r: (self.held[r], r))
        owner = least
        if holders is not None:
            best = min(holders, key=lambda r: (self.held[r], r))
            if self.cap is None or self.held[best] + size <= self.cap:
                owner = best
        self.held[owner] += size
        self.owner_of[name] = owner
        self.numel += numel
        if self.dtype is None and dtype.is_floating_point:
            self.dtype = dtype
        return owner

    def copy(self, tensors: dict[str, torch.Tensor]) -> SpreadModelCopy:
        """The spread copy of which this rank keeps `tensors`: a file per owning rank,
        `model-0000i-of-0000n.safetensors` in rank order (`model.safetensors` if one rank owns all)."""
        owners = sorted(set(self.owner_of.values()))
        if len(owners) <= 1:
            files = {name: SINGLE for name in self.owner_of}
        else:
            file_of = {r: f"model-{i:05d}-of-{len(owners):05d}.safetensors" for i, r in enumerate(owners, start=1)}
            files = {name: file_of[r] for name, r in self.owner_of.items()}
        return SpreadModelCopy(files=files, tensors=tensors, total_bytes=sum(self.held), numel=self.numel,
                               dtype=self.dtype)


def spread_model_copy(model: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]], rank: int,
                      world: int) -> SpreadModelCopy:
    """Walk `(name, full tensor)` pairs that EVERY rank receives (a plugin's
    `iter_full_model_state` where `full_state_on_every_rank`): each tensor goes to the rank that
    holds the fewest bytes so far (`SpreadOwners`), which keeps a copy. Tied aliases and ignored
    keys are dropped as `save_hf_model` drops them."""
    skipped = names_not_saved(model)
    owners = SpreadOwners(world)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        if name in skipped:
            continue
        if owners.assign(name, tensor.shape, tensor.dtype) == rank:
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        del tensor
    return owners.copy(tensors)


def write_spread_model(model: nn.Module | None, spread: SpreadModelCopy, directory: str | Path, rank: int,
                       tokenizer=None) -> None:
    """This rank's file of a `SpreadModelCopy` (no collectives: safe in a background thread); rank
    0 (which passes the unwrapped `model`) also writes the index, config.json and the tokenizer.
    The directory is complete once every rank has written, which the checkpoint commit checks."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if spread.tensors:
        mine = {spread.files[name] for name in spread.tensors}
        (file,) = mine
        save_file(spread.tensors, str(directory / file), metadata={"format": "pt"})
    if rank == 0:
        if len(set(spread.files.values())) > 1:
            index = {"metadata": {"total_size": spread.total_bytes, "total_parameters": spread.numel},
                     "weight_map": dict(sorted(spread.files.items()))}
            (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        _write_metadata(model, directory, spread.dtype, tokenizer)


def _save_with_transformers(model, state_dict: dict[str, torch.Tensor], directory: Path, size: int,
                            dtype: torch.dtype | None, tokenizer) -> ExportStats:
    state_dict = _drop_aliases(model, state_dict)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    state_dict = {k: v.detach().contiguous() for k, v in state_dict.items()}
    stats = ExportStats(tensors=len(state_dict), streamed=False,
                        total_bytes=sum(v.numel() * v.element_size() for v in state_dict.values()))
    stats.peak_bytes_held = stats.total_bytes
    if dtype is not None:
        model.config.dtype = dtype
    model.save_pretrained(directory, state_dict=state_dict, max_shard_size=size)
    stats.files = sorted(p.name for p in directory.glob("*.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return stats


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
