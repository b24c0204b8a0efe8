"""Exponential moving average of a model's trainable weights, kept right under data parallelism.

    ema = EMA(decay=0.9999)                       # hand it to fit(..., hooks=[ema])
    with ema.swapped():                           # evaluate / sample with the averaged weights
        ...
    ema.full_state_dict()                         # {name: full fp32 tensor}, on every rank

Approach. The average follows the weights *after* each optimizer step, i.e. what every rank
holds once the plugin has synchronised the update, so no extra communication is needed while
training:
- DDP, ZeRO-1/2: each rank holds the full, identical parameters; each keeps the same full average.
- FSDP2: parameters are DTensor shards; each rank averages only its local shard (1/dp of the
  memory) and `full_state_dict` gathers the shards when saving.
- Gemini: parameters are placeholders between steps; each rank averages its part of the fp32
  masters in the chunks (`phalanx.gemini.local_masters`); `swapped` writes into the masters.
The average is kept in fp32 whatever the training dtype. `fit` calls `bind` after the Booster
has applied the layout, `after_step` after every optimizer step, and `save`/`load` inside each
checkpoint (directory `ema/`, safetensors, in the checkpoint's manifest), so resume is exact.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from phalanx.observe import is_main_process

EMA_FILE = "ema.safetensors"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard, else the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Gather a shard kept for DTensor parameter `like` into the full tensor (collective)."""
    if hasattr(like, "to_local"):
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(t, like.device_mesh, like.placements, shape=like.shape,
                                  stride=like.stride()).full_tensor()
    return t


def _gemini_masters(model: nn.Module, names: list[str]):
    """The fp32 master pieces to follow when GeminiPlugin boosted `model`, else None."""
    from phalanx.booster.plugins.gemini import GeminiPlugin
    from phalanx.booster.state import boosted_state

    state = boosted_state(model)
    if state is None or not isinstance(state.plugin, GeminiPlugin):
        return None
    from phalanx.gemini.local_masters import LocalMasters
    return LocalMasters(state.plugin.manager, names)


class EMA:
    """EMA of the trainable parameters: `shadow = decay * shadow + (1 - decay) * param`.

    decay: the target decay. warmup: use min(decay, (1 + n) / (10 + n)) after n updates, so an
    average started from random weights is not dominated by them for ~1/(1-decay) steps
    (diffusers' EMAModel does the same). update_every: update every N optimizer steps.
    """

    name = "ema"

    def __init__(self, decay: float = 0.9999, warmup: bool = True, update_every: int = 1):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay={decay}: must be in [0, 1), e.g. 0.999 or 0.9999")
        if update_every < 1:
            raise ValueError(f"EMA update_every={update_every}: must be at least 1")
        self.decay, self.warmup, self.update_every = decay, warmup, update_every
        self.num_updates = 0
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._shadow: list[torch.Tensor] = []
        self._masters = None  # LocalMasters when the model is boosted by GeminiPlugin

    # ---------------------------------------------------------------- binding and updating
    def bind(self, model: nn.Module) -> "EMA":
        """Track `model`'s trainable parameters (the boosted model, or a plain one). The average
        starts at the current weights."""
        from phalanx.booster import unwrap_model

        module = unwrap_model(model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("EMA: the model has no trainable parameters to average")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._masters = _gemini_masters(model, self._names)
        self._shadow = [t.float().clone() for t in self._local_values()]
        return self

    def _local_values(self) -> list[torch.Tensor]:
        """This rank's part of each tracked weight, now."""
        if self._masters is not None:
            return self._masters.pieces()
        return [_local(p.detach()) for p in self._params]

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))

    @torch.no_grad()
    def update(self) -> None:
        self._check_bound()
        weight = 1.0 - self.current_decay()
        torch._foreach_lerp_(self._shadow, [t.float() for t in self._local_values()], weight)
        self.num_updates += 1

    def after_step(self, step: int) -> None:
        if step % self.update_every == 0:
            self.update()

    # ---------------------------------------------------------------- using the average
    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """Inside: the model's parameters hold the average; the trained weights come back after."""
        self._check_bound()
        if self._masters is not None:
            backup = [t.clone() for t in self._masters.pieces()]
            self._masters.write(self._shadow)
            try:
                yield
            finally:
                self._masters.write(backup)
            return
        backup = [_local(p.detach()).clone() for p in self._params]
        for p, s in zip(self._params, self._shadow):
            _local(p.data).copy_(s)
        try:
            yield
        finally:
            for p, b in zip(self._params, backup):
                _local(p.data).copy_(b)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: full fp32 average} on CPU (a collective under FSDP: call on every rank)."""
        return {n: t.cpu() for n, t in self._gathered().items()}

    def _gathered(self) -> dict[str, torch.Tensor]:
        self._check_bound()
        if self._masters is not None:
            return self._masters.gather(self._shadow)
        return {n: _full(s, p) for n, s, p in zip(self._names, self._shadow, self._params)}

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: Path) -> None:
        """Write `directory/ema.safetensors` from rank 0 (every rank must call: FSDP gathers)."""
        self.snapshot(directory)()

    def snapshot(self, directory: Path) -> Callable[[], None]:
        """Gather the average and copy it to the host now (every rank must call); returns the
        file write, which an asynchronous checkpoint runs in its background thread."""
        state = self._gathered()  # every rank gathers; only rank 0 copies to the host and writes
        if not is_main_process():
            return lambda: None
        host = {k: v.to("cpu", copy=True).contiguous() for k, v in state.items()}
        metadata = {"num_updates": str(self.num_updates), "decay": str(self.decay)}

        def write() -> None:
            directory.mkdir(parents=True, exist_ok=True)
            save_file(host, str(directory / EMA_FILE), metadata=metadata)
        return write

    def load(self, directory: Path) -> None:
        self._check_bound()
        path = Path(directory) / EMA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint was written without EMA; resume it with "
                                    "EMA off or start a new output_dir")
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            self.num_updates = int(f.metadata().get("num_updates", 0))
            missing = [n for n in self._names if n not in set(f.keys())]
            if missing:
                raise KeyError(f"{path} lacks EMA weights for {missing[:3]}: it belongs to a different model")
            state = {n: f.get_tensor(n) for n in self._names}
        for i, (n, s, p) in enumerate(zip(self._names, self._shadow, self._params)):
            full = state[n].float()
            if self._masters is not None:
                full = self._masters.piece_of(i, full)
            elif hasattr(p, "to_local"):  # keep only this rank's shard of the full average
                from torch.distributed.tensor import distribute_tensor
                full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
            s.copy_(full.to(s.device))

    def _check_bound(self) -> None:
        if not self._params:
            raise RuntimeError("EMA is not bound to a model: call ema.bind(model) (fit does it for hooks=[ema])")
