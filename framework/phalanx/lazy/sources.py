"""Where the values of a lazily built (meta-device) model come from.

A source answers, for a parameter of the meta model (by name):
- `full(name, param)`: the whole tensor (`phalanx.shard.apply_tp` for a replicated parameter, DDP, ZeRO);
- `local(name, param, spec, rank, tp)`: a tensor-parallel piece (`phalanx.shard.apply_tp`);
- `rows(name, param, start, stop, dtype)`: rows `[start, stop)` of dimension 0 (FSDP2's `Shard(0)`);
- `flat_range(name, param, start, stop, dtype)` (module function): elements `[start, stop)` of the
  flattened tensor (the ZeRO / Gemini flat shards), read as the rows that cover them.

`CheckpointSource` reads only those slices from safetensors; `RandomInitSource` initialises one
unit (decoder layer) at a time and hands each value out once. Every value is asked for once per
rank, even when the rank keeps none of it (an empty range), so a random unit's values are freed.
"""
from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path

import torch

from phalanx_kernels.accelerator import accelerator_rng_fork
from torch import nn

from phalanx.checkpoint.atomic import CheckpointError
from phalanx.shard.spec import ShardSpec


def is_lazy(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def init_weights_fn(model: nn.Module):
    """The `_init_weights` of the (first) transformers model inside `model`, which may be a
    wrapper such as phalanx.train's loss module."""
    for m in model.modules():
        fn = getattr(m, "_init_weights", None)
        if callable(fn):
            return fn
    raise TypeError(f"{type(model).__name__} holds no model with an `_init_weights` method: lazy random "
                    "initialisation needs a transformers model (or build the model eagerly)")


def materialised_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The values of the parameters of a partly lazy model that are not on the meta device (a
    lazy base with real LoRA adapters), by every name they go by: a plugin may replace their
    storage (FSDP2's `to_empty`) before it asks the source for them. Detached views, no copies."""
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}


def peft_free_name(name: str) -> str:
    """A parameter's name with PEFT's wrapper segment taken out (`q_proj.base_layer.weight` ->
    `q_proj.weight`): a LoRA model's base weights under the names its checkpoint has."""
    return name.replace(".base_layer.", ".")


def _without_adapters(module: nn.Module) -> nn.Module:
    """`module` with every PEFT LoRA layer in it replaced by its base layer (in place; the module
    itself if it is one)."""
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        return _without_adapters(module.base_layer)
    for cname, child in list(module.named_children()):
        setattr(module, cname, _without_adapters(child))
    return module


def _empty_like_on(t: torch.Tensor, device) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device)


class RandomInitSource:
    """Random initialisation by the model's own `_init_weights`, one unit at a time: a decoder
    layer (every ModuleList child), or a single module outside the layers.

    A unit is initialised once, as a full-size copy, when its first value is asked for (before any
    of its modules is replaced); the model's meta parameters are left alone, so tied weights stay
    tied. Each value is handed out once and then dropped: the parallel layout keeps its pieces. Each unit draws from its own generator state, seeded from `seed` and
    the unit's name, so its values do not depend on the order in which units are materialised: a
    model initialised lazily under any parallel layout equals the same lazy model materialised
    whole (same `seed`). `seed` defaults to a draw from the global generator (identical on every
    rank after `launch`)."""

    def __init__(self, model: nn.Module, device="cpu", seed: int | None = None):
        self.model = model
        # A copy of the meta model as built (no memory): units are initialised from it, so a plugin
        # may cast (`model.to(bf16)`) or re-class (FSDP2's `fully_shard`) the live model first and
        # the values still equal an eager fp32 init of the model as built. A model that cannot be
        # copied (already split: it holds process groups) is used as it is.
        try:
            self.template = copy.deepcopy(model)
        except (TypeError, RuntimeError):
            self.template = model
        self.device = torch.device(device)
        self.seed = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)
        self._units = {id(child) for m in self.template.modules() if isinstance(m, nn.ModuleList) for child in m}
        self._values: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()
        self._known = materialised_values(model)

    def _unit_name(self, name: str) -> str:
        parts = name.split(".")[:-1]
        module = self.template
        for i, part in enumerate(parts):
            module = getattr(module, part)
            if id(module) in self._units:
                return ".".join(parts[:i + 1])
        return ".".join(parts)

    def _seed_name(self, unit_name: str) -> str:
        """The unit's name inside the transformers model (a wrapper's prefix left out), so that a
        model boosted inside phalanx.train's loss module gets the same values as on its own."""
        for name, m in self.template.named_modules():
            if callable(getattr(type(m), "_init_weights", None)):  # its own (a PeftModel forwards the name)
                if name and unit_name.startswith(name + "."):
                    return unit_name[len(name) + 1:]
                return "" if name and unit_name == name else unit_name
        return unit_name

    def _initialise(self, unit_name: str) -> None:
        unit = copy.deepcopy(self.template.get_submodule(unit_name) if unit_name else self.template)
        unit = _without_adapters(unit)  # a LoRA model's base draws what the model without adapters draws
        unit.to_empty(device=self.device)
        with torch.no_grad(), accelerator_rng_fork(self.device):
            torch.manual_seed((self.seed + zlib.crc32(self._seed_name(unit_name).encode())) % 2**63)
            unit.apply(init_weights_fn(self.template))  # children before parents, as transformers does
        prefix = peft_free_name(unit_name + ".") if unit_name else ""
        for n, t in [*unit.named_parameters(remove_duplicate=False), *unit.named_buffers()]:
            self._values.setdefault(prefix + n, t.detach())
        self._done.add(unit_name)

    def _value(self, name: str, param: torch.Tensor) -> torch.Tensor:
        if not param.is_meta:
            return param.detach()
        return self._take(name)

    def _take(self, name: str) -> torch.Tensor:
        if name in self._known:  # materialised before (LoRA adapters on a lazy base)
            return self._known[name].to(self.device)
        key = peft_free_name(name)  # values are kept under the names without adapters
        if key not in self._values:
            unit = self._unit_name(name)
            if unit in self._done:
                raise RuntimeError(f"lazy init: {name!r} was asked for twice, or after its unit {unit!r} was split")
            self._initialise(unit)
        return self._values.pop(key)

    def local(self, name: str, param: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
        return spec.shard(self._value(name, param), rank, tp)

    def full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        return self._value(name, param)

    def rows(self, name: str, param: torch.Tensor, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `[start, stop)` (dimension 0) of the initial value, in `dtype` (default: as built)."""
        value = self._take(name)
        piece = value[start:stop] if value.dim() else value
        return piece.to(self.device, dtype or value.dtype, copy=True)

    def buffers(self, module: nn.Module) -> None:
        prefix = next(n for n, m in self.model.named_modules() if m is module)
        for bname, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                module._buffers[bname] = self._value(f"{prefix}.{bname}" if prefix else bname, b).clone()


class CheckpointSource:
    """Values from a Hugging Face safetensors directory, reading only the needed slices."""

    def __init__(self, model: nn.Module, path: str | Path, device="cpu", prefix: str = ""):
        from safetensors import safe_open

        self.model = model
        self.prefix = prefix + "." if prefix else ""  # where the checkpoint's model sits inside `model`
        self.path = Path(path)
        self.device = torch.device(device)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{str(self.path)!r} holds neither model.safetensors nor its index: no weights to "
                                  "load lazily")
        self.elements_read = 0  # how many tensor elements were read (only this rank's slices)
        self._files: dict[str, object] = {}
        self._open = lambda f: self._files.setdefault(f, safe_open(str(self.path / f), framework="pt", device="cpu"))
        if weight_map is None:
            handle = self._open("model.safetensors")
            weight_map = {k: "model.safetensors" for k in handle.keys()}
        self.weight_map: dict[str, str] = weight_map
        aliases: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
        self._aliases = {n: names for names in aliases.values() for n in names}  # tied weights: any name
        self._known = materialised_values(model)

    def _materialised(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        """The value of a parameter that was not lazy (a LoRA adapter), or None."""
        if name in self._known:
            return self._known[name].to(self.device)
        return None if param.is_meta else param.detach()

    def _key(self, name: str) -> str:
        for candidate in self._aliases.get(name, [name]):
            if self.prefix and candidate.startswith(self.prefix):
                candidate = candidate[len(self.prefix):]
            candidate = peft_free_name(candidate)
            if candidate in self.weight_map:
                return candidate
        raise CheckpointError(f"{str(self.path)!r} has no tensor {name!r}: the checkpoint was saved for another model")

    def _slice(self, name: str):
        key = self._key(name)
        return self._open(self.weight_map[key]).get_slice(key)

    def _check_shape(self, name: str, param: torch.Tensor, shape) -> None:
        if tuple(shape) != tuple(param.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(shape)} vs model {tuple(param.shape)}: load it "
                                  "into a model built from the same config")

    def local(self, name: str, param: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
        known = self._materialised(name, param)
        if known is not None:
            return spec.shard(known, rank, tp)
        view = self._slice(name)
        self._check_shape(name, param, view.get_shape())
        if not spec.is_sharded:
            return self._read(view[:], param)
        parts = []
        for a, b, _ in spec.slices(param.shape, rank, tp):
            index = tuple([slice(None)] * spec.dim + [slice(a, b)])
            parts.append(self._read(view[index], param))
        return spec.assemble(parts, param.shape, rank, tp)

    def _read(self, tensor: torch.Tensor, param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.elements_read += tensor.numel()
        return tensor.to(self.device, dtype or param.dtype)

    def rows(self, name: str, param: torch.Tensor, start: int, stop: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `[start, stop)` (dimension 0) read from the file, in `dtype` (default: the parameter's)."""
        known = self._known.get(name)
        if known is not None:
            return (known[start:stop] if known.dim() else known).to(self.device, dtype or known.dtype, copy=True)
        view = self._slice(name)
        self._check_shape(name, param, view.get_shape())
        return self._read(view[start:stop] if param.dim() else view[:], param, dtype)

    def full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        known = self._materialised(name, param)
        if known is not None:
            return known
        view = self._slice(name)
        self._check_shape(name, param, view.get_shape())
        return self._read(view[:], param)

    def buffers(self, module: nn.Module) -> None:
        """Buffers saved in the checkpoint are read from it; the others (rotary frequencies) come
        from `_init_weights`, run on a copy of the module when it has parameters (which must not be
        re-initialised, and may still be on the meta device or sharded)."""
        prefix = next(n for n, m in self.model.named_modules() if m is module)
        meta = [bname for bname, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        computed = module
        if any(True for _ in module.parameters(recurse=False)):
            computed = copy.deepcopy(module)
            for pname, p in list(computed.named_parameters(recurse=False)):
                computed._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                                           requires_grad=p.requires_grad)
        for bname in meta:
            computed._buffers[bname] = _empty_like_on(computed._buffers[bname], self.device)
        with torch.no_grad():
            init_weights_fn(self.model)(computed)
        for bname in meta:
            key = f"{prefix}.{bname}" if prefix else bname
            key = key[len(self.prefix):] if self.prefix and key.startswith(self.prefix) else key
            if key in self.weight_map:
                value = self._open(self.weight_map[key]).get_tensor(key).to(self.device, module._buffers[bname].dtype)
            else:
                value = computed._buffers[bname]
            module._buffers[bname] = value


def flat_range(source, name: str, param: torch.Tensor, start: int, stop: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elements `[start, stop)` of the flattened value of `param`, read as the rows that cover them
    (so a flat shard costs at most two rows more than its own size)."""
    if param.dim() == 0:
        return source.rows(name, param, 0, 1, dtype).reshape(-1)[start:stop]
    row = param[0].numel() if param.shape[0] else 1
    if stop <= start or row == 0:
        return source.rows(name, param, 0, 0, dtype).reshape(-1)
    first, last = start // row, -(-stop // row)
    block = source.rows(name, param, first, last, dtype).reshape(-1)
    return block[start - first * row:stop - first * row]


def materialise_buffers(model: nn.Module, source) -> None:
    """Give every buffer still on the meta device its value (after the parameters)."""
    if source is None:
        return
    for module in model.modules():
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            source.buffers(module)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers still on the meta device after materialising: {left[:3]}")
