"""Reading Hugging Face weights into the runner's (fused, possibly sharded) parameters, from a
model directory or from a live state dict, without materialising what this rank does not hold.

A *source* yields `(name, read)` pairs, where `read(dim, start, length)` returns the tensor or,
with a dim, only that slice of it: safetensors files are read slice by slice (a TP rank touches
only its shard), in-memory tensors are narrowed views. Names are normalised so a state dict from
`LlamaForCausalLM` (or any supported family's model), its inner base model, a DDP/`torch.compile` wrapper or an FSDP2 model
(DTensors are gathered with `full_tensor()`) all load.

`tp_shard_source` feeds an engine from a tensor-parallel *trainer* (HybridParallelPlugin) over the
same group: each rank copies its own training shard straight into its engine shard wherever the
two layouts cut a weight the same way, and gathers, one tensor at a time, only the weights they
cut differently (see its docstring).
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


class ReaderSource:
    """Weights already given as `(name, Reader)` pairs: `state_dict_source` (and so
    `LLM.load_weights`) passes them through unchanged. Iterate it once."""

    def __init__(self, pairs: Iterable[tuple[str, Reader]]) -> None:
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[str, Reader]]:
        return iter(self.pairs)


def state_dict_source(state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | ReaderSource
                      ) -> Iterator[tuple[str, Reader]]:
    if isinstance(state_dict, ReaderSource):
        yield from state_dict
        return
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
            loaded.update(getattr(model, "covered_weight_names", lambda n: ())(name))  # fused experts
    if unknown:
        raise ValueError(f"{len(unknown)} weight(s) do not belong to a {model.spec.family} model of this shape, "
                         f"e.g. {unknown[:4]}")
    if strict:
        missing = sorted(model.expected_weight_names() - loaded)
        if missing:
            raise ValueError(f"{len(missing)} weight(s) missing from the checkpoint, e.g. {missing[:4]}")
    return loaded


# -- from a tensor-parallel trainer -----------------------------------------------------------------
def _local_offset(spec, full_shape, rank: int, tp: int, dim: int | None, start: int, length: int) -> int | None:
    """Where the full-tensor range [start, start + length) along `dim` lies in this rank's training
    piece (its sections side by side, each padded to its chunk), or None when the piece does not
    hold all of it."""
    if dim is None or dim != spec.dim:
        return None
    at = 0
    for lo, hi, pad in spec.slices(full_shape, rank, tp):
        if lo <= start and start + length <= hi:
            return at + start - lo
        at += hi - lo + pad
    return None


class TPShardSource(ReaderSource):
    """`tp_shard_source`'s readers; `gathered` names the weights that had to be gathered."""

    def __init__(self, pairs: Iterable[tuple[str, Reader]], gathered: list[str]) -> None:
        super().__init__(pairs)
        self.gathered = gathered


def tp_shard_source(model: torch.nn.Module, plan, engine_model) -> TPShardSource:
    """The weights of `model`, split by a tensor-parallel trainer as `plan` (a
    `phalanx.shard.TPPlan`) records, for an engine model (`DecoderModel`) whose tensor-parallel
    rank and size are the plan's. A collective over `plan.group`: every rank of it calls this and
    iterates the result in full.

    For each weight the engine's targets (`weight_targets`) say which ranges of the full tensor
    this rank needs. Where the training piece on this rank holds them (attention heads and MLP
    features are cut into the same contiguous blocks by both, the vocabulary of the LM head into
    the same padded blocks), the reader is a view of the training piece: no communication, no
    copy. Otherwise (the engine keeps the token embedding whole, the trainer splits it by
    vocabulary; or any layout the two do not share) that one weight is all-gathered over the
    group, unsharded, copied, and dropped before the next: the extra memory is one full tensor at
    a time. The choice is made once per call from every rank's view (one small all-reduce), so
    the ranks always join the same gathers.
    """
    import torch.distributed as dist

    from phalanx.shard.state import gather_full

    if (plan.rank, plan.size) != (engine_model.tp_rank, engine_model.tp_size):
        raise ValueError(f"the trainer's tensor-parallel rank {plan.rank} of {plan.size} is not the engine's "
                         f"{engine_model.tp_rank} of {engine_model.tp_size}: build the engine over the same group")
    state = model.state_dict()
    sharded = [name for name, t in state.items() if plan.size > 1 and plan.spec(name).is_sharded]
    local_ok = []
    for name in sharded:
        spec, full_shape = plan.spec(name), plan.params[name].full_shape
        try:
            targets = [] if normalize_name(name).endswith(_IGNORED_SUFFIXES) else \
                engine_model.weight_targets(normalize_name(name))
        except KeyError:
            targets = []  # load_weights names it as unknown
        local_ok.append(all(_local_offset(spec, full_shape, plan.rank, plan.size, t[1], t[2], t[3]) is not None
                            for t in targets))
    if sharded:  # the same decision on every rank, or the gathers below would not pair up
        flags = torch.tensor(local_ok, dtype=torch.int32)
        device = next((t.device for t in state.values()), torch.device("cpu"))
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=plan.group)
        local_ok = [bool(f) for f in flags.tolist()]
    gather = {name for name, ok in zip(sharded, local_ok) if not ok}

    def shard_reader(name: str, piece: torch.Tensor) -> Reader:
        spec, full_shape = plan.spec(name), plan.params[name].full_shape

        def read(dim: int | None, start: int, length: int) -> torch.Tensor:
            offset = _local_offset(spec, full_shape, plan.rank, plan.size, dim, start, length)
            if offset is None:
                raise RuntimeError(f"{name}: the engine asked for {length} rows at {start} of dim {dim}, which this "
                                   "rank's training shard does not hold")
            return piece.narrow(dim, offset, length)
        return read

    def pairs() -> Iterator[tuple[str, Reader]]:
        for name, tensor in state.items():
            tensor = tensor.detach()
            if name in gather:
                full = gather_full(name, tensor, plan)
                yield name, _narrow(full)
                del full  # one gathered tensor alive at a time
            elif plan.size > 1 and plan.spec(name).is_sharded:
                yield name, shard_reader(name, tensor)
            else:
                yield name, _narrow(tensor)

    return TPShardSource(pairs(), sorted(gather))
