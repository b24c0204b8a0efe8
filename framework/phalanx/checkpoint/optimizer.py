"""Optimizer state as layout-independent fragments.

For each parameter (named as in the unwrapped model) and each state tensor (`exp_avg`, …) a
rank saves the contiguous ranges `[start, end)` of the *flattened* parameter that it owns: DDP
saves whole ranges from rank 0, FSDP2 its row shard, ZeRO its slice of the flat buffer. Each
rank writes `fragments-rankNNNNN.safetensors`; rank 0 writes `index.json` telling which file
holds which range. Loading is the reverse for whatever ranges a rank owns in the *new* layout,
read lazily with `safetensors.safe_open`, so a checkpoint saved on 4 ranks loads on 2 or 1.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from phalanx.checkpoint.atomic import CheckpointError
from phalanx.json_collectives import all_gather_json

INDEX = "index.json"
FORMAT = "phalanx-optim-fragments/1"


@dataclass
class Fragment:
    param: str
    key: str
    start: int
    end: int
    data: torch.Tensor  # 1-D, end - start elements


@dataclass
class OptimizerFragments:
    fragments: list[Fragment] = field(default_factory=list)
    scalars: dict[str, dict[str, float]] = field(default_factory=dict)  # e.g. {"w": {"step": 5.0}}
    shapes: dict[str, list[int]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # hyper-parameters, "params": [names]
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. loss-scaler state


def _jsonable_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        item = {}
        for k, v in g.items():
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v.tolist()
            if isinstance(v, tuple):
                v = list(v)
            if isinstance(v, (int, float, str, bool, list, type(None))):
                item[k] = v
        out.append(item)
    return out


def save_fragments(frags: OptimizerFragments, directory: str | Path) -> None:
    """Collective: every rank passes its fragments; files go into `directory` (already created)."""
    directory = Path(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    filename, tensors, local = fragment_tensors(frags, rank)
    index = fragment_index(frags, local)
    if tensors:
        save_file(tensors, str(directory / filename))
    if index is not None:
        (directory / INDEX).write_text(json.dumps(index))


def fragment_tensors(frags: OptimizerFragments, rank: int, *, copy: bool = False
                     ) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's file name, its tensors (1-D, on the CPU; copies when `copy`, so training may go
    on while they are written) and the description of them that goes into the index."""
    filename = f"fragments-rank{rank:05d}.safetensors"
    tensors = {}
    entries = []
    for i, f in enumerate(frags.fragments):
        if f.data.numel() != f.end - f.start:
            raise ValueError(f"fragment {f.param}/{f.key} has {f.data.numel()} elements for range {f.start}:{f.end}")
        name = f"{i:06d}"
        data = f.data.detach().reshape(-1)
        tensors[name] = data.to("cpu", copy=True) if copy else data.contiguous().cpu()
        entries.append([f.param, f.key, f.start, f.end, filename, name, str(f.data.dtype).replace("torch.", "")])
    return filename, tensors, {"entries": entries, "scalars": frags.scalars, "shapes": frags.shapes}


def fragment_index(frags: OptimizerFragments, local: dict[str, Any]) -> dict[str, Any] | None:
    """Collective: gather every rank's `local` description (as JSON, `all_gather_json`: names,
    ranges, file names and scalars, no pickle); rank 0 gets the index, others None."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = all_gather_json(local) if world > 1 else [local]
    if rank != 0:
        return None
    params: dict[str, Any] = {}
    for part in gathered:
        for name, shape in part["shapes"].items():
            params.setdefault(name, {"shape": shape, "scalars": {}, "states": {}})
        for name, sc in part["scalars"].items():
            params.setdefault(name, {"shape": None, "scalars": {}, "states": {}})["scalars"].update(sc)
        for pname, key, start, end, fname, tname, dtype in part["entries"]:
            params.setdefault(pname, {"shape": None, "scalars": {}, "states": {}})
            params[pname]["states"].setdefault(key, []).append([start, end, fname, tname])
    return {"format": FORMAT, "world_size": world, "param_groups": _jsonable_groups(frags.param_groups),
            "extra": frags.extra, "params": params}


class FragmentReader:
    """Reads any range of any saved state tensor, whatever layout wrote it."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / INDEX
        if not path.is_file():
            raise CheckpointError(f"{str(self.directory)!r} has no {INDEX}: not a phalanx optimizer checkpoint")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT:
            raise CheckpointError(f"{path}: unknown optimizer checkpoint format {self.index.get('format')!r}")
        self.params: dict[str, Any] = self.index["params"]
        self._handles: dict[str, Any] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.index["param_groups"]

    @property
    def extra(self) -> dict[str, Any]:
        return self.index.get("extra", {})

    def has(self, param: str) -> bool:
        return param in self.params

    def state_keys(self, param: str) -> list[str]:
        return list(self.params[param]["states"])

    def scalars(self, param: str) -> dict[str, float]:
        return dict(self.params[param]["scalars"])

    def shape(self, param: str) -> list[int] | None:
        return self.params[param]["shape"]

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = self.directory / fname
            if not path.is_file():
                raise CheckpointError(f"optimizer checkpoint is missing {path}: it is partial")
            self._handles[fname] = safe_open(str(path), framework="pt", device="cpu")
        return self._handles[fname]

    def read(self, param: str, key: str, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Elements [start, end) of the flattened state `key` of `param`."""
        if param not in self.params:
            raise CheckpointError(f"optimizer checkpoint has no state for parameter {param!r}: it was saved "
                                  "for a different model")
        pieces = self.params[param]["states"].get(key)
        if not pieces:
            raise CheckpointError(f"optimizer checkpoint has no {key!r} state for {param!r}")
        out = torch.empty(end - start, dtype=dtype)
        covered = 0
        for p_start, p_end, fname, tname in pieces:
            lo, hi = max(start, p_start), min(end, p_end)
            if lo >= hi:
                continue
            chunk = self._handle(fname).get_slice(tname)[lo - p_start:hi - p_start]
            out[lo - start:hi - start] = chunk.to(dtype)
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"optimizer checkpoint covers only {covered} of elements {start}:{end} of "
                                  f"{param!r}/{key}: some rank's fragment file is missing")
        return out


def apply_param_group_hyperparams(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Restore learning rates etc. saved with the fragments (group order must match)."""
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the optimizer checkpoint has {len(groups)} parameter groups, this optimizer has "
                              f"{len(optimizer.param_groups)}: build the optimizer the same way as when saving")
    for saved, group in zip(groups, optimizer.param_groups):
        for k, v in saved.items():
            if k == "params" or k not in group:
                continue
            group[k] = tuple(v) if isinstance(group[k], tuple) else v


def fragments_from_full_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> OptimizerFragments:
    """Fragments of a plain torch optimizer whose parameters are whole on this rank
    (`names` maps id(param) -> name in the unwrapped model)."""
    out = OptimizerFragments()
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        out.param_groups.append(g)
        for p in group["params"]:
            name = names[id(p)]
            out.shapes[name] = list(p.shape)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() == p.numel() and value.dim() > 0:
                    out.fragments.append(Fragment(name, key, 0, p.numel(), value.detach().reshape(-1).float()))
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    out.scalars.setdefault(name, {})[key] = float(value.item())
                elif isinstance(value, (int, float)):
                    out.scalars.setdefault(name, {})[key] = float(value)
    return out


def load_full_state_into(optimizer: torch.optim.Optimizer, names: dict[int, str], reader: FragmentReader) -> None:
    """Inverse of `fragments_from_full_state` with every parameter whole on this rank."""
    apply_param_group_hyperparams(optimizer, reader.param_groups)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if not reader.has(name):
                raise CheckpointError(f"optimizer checkpoint has no state for {name!r}: saved for another model")
            state = {}
            for key in reader.state_keys(name):
                state[key] = reader.read(name, key, 0, p.numel()).reshape(p.shape).to(p.dtype).to(p.device)
            for key, value in reader.scalars(name).items():
                state[key] = torch.tensor(value, dtype=torch.float32)
            if state:
                optimizer.state[p] = state
