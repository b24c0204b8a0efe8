"""LoRA adapters at serve time: PEFT-format adapters loaded beside the base model, chosen per
request, several of them in one batch.

    engine = LLM(base_dir, enable_lora=True, max_loras=4, max_lora_rank=16)
    engine.load_lora_adapter("sql", "runs/sft/adapter")      # adapter_config.json + adapter_model.safetensors
    engine.generate(prompts, [SamplingParams(lora_name="sql"), SamplingParams()])   # adapter and base, one batch

How a batch runs every adapter at once. Each adapted matmul of a decoder layer (the fused q/k/v,
o, the fused gate/up, down) keeps the adapters' low-rank factors stacked by *slot*: A as
[slots, pieces·r_max, in] (the pieces' A one above the other) and B·scaling as
[slots, pieces·r_max, out], block-diagonal over the pieces (piece p's lanes reach only its own
output columns). A step gives every token the slot of its request (0: the base model), and the
layer's call `base(x) + delta(x)` computes the delta of every token with three operations over
the slots the step uses (`LowRankStack.add_delta`): x @ A[:hi]ᵀ gives each token every adapter's
lanes for every piece, a one-hot mask of the token's slot keeps its own adapter's lanes (the
others become exact zeros), and one accumulating matmul of the masked lanes with B[:hi] adds
`scaling · B_s A_s x` to each piece's output columns. One forward per batch, no Python loop over
adapters or pieces, the same shapes whichever adapters the tokens use. A rank below r_max is
zero-padded (the padding adds exact zeros). Where the base weights are packed for oneDNN (bf16 on
a CPU with native bf16) the stacked factors of the slots a step uses are packed too (again when a
step uses more or fewer slots, or after a load or unload): an unpacked bf16 matmul re-lays its
weight out on every call.

Under tensor parallelism each rank keeps its part of every adapter, split as the base weight is
(`_place`, through the model's `role_target`): B by output rows for the column-parallel q/k/v and
gate/up (A whole), A by input columns for the row-parallel o and down (B whole), whose partial
deltas join the base's partial sums in the layer's existing all-reduce. Every rank must load the
same adapters in the same order (`LLM.load_lora_adapter` on every rank, as `generate`); each
step's token slots travel in the step's broadcast.

The wrapper replaces the layer's `linear` (the call every matmul of the decoder goes through,
whatever computes it: F.linear, a packed oneDNN weight) after the weights are loaded, so the base
path is untouched and the adapters add to whatever it returns.

With a draft model (speculative decoding) the target verifies every sequence with its adapter
and the draft model runs without adapters (its shapes are not the adapters').

Limits, each refused by name: DoRA, adapters on embeddings or the LM head,
`modules_to_save`, trained LoRA biases, adapters on expert layers; loading or unloading over HTTP
while serving with tensor parallelism (the other ranks are busy running steps). Prefix caching
keeps working: a request's cached blocks are keyed by its adapter (`Sequence.cache_salt`), so
base and adapter requests never share keys and values.
"""
from __future__ import annotations

import itertools
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from phalanx.inference import packed_linear

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class LoraError(ValueError):
    """A refused adapter operation or request; `status` is what the HTTP server answers
    (404: no such adapter, 400: anything else)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Adapter:
    """A loaded adapter: its slot in the stacked factors (1..max_loras) and the requests using it."""

    name: str
    path: str
    slot: int
    rank: int
    salt: bytes  # prefix-cache key seed: unique per load, so a reloaded name never reuses old blocks
    refs: int = 0


@dataclass
class Piece:
    """One adapted projection of an adapter, placed in a fused matmul of layer `layer`."""

    layer: int
    linear: str  # "qkv", "o", "gate_up", "down"
    piece: int  # which output piece of that matmul (q=0, k=1, v=2; gate=0, up=1)
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [width, r], scaling folded in


# -- reading a PEFT adapter ------------------------------------------------------------------------
def _placement(layer, role: str) -> tuple[str, int] | None:
    """(fused matmul, output piece) of an HF projection role in our decoder layer, or None."""
    if role in ("gate", "up", "down") and layer.gate_up_weight is None:
        return None  # an expert layer
    return {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "o": ("o", 0), "gate": ("gate_up", 0),
            "up": ("gate_up", 1 if layer.gated else 0), "down": ("down", 0)}.get(role)


def output_pieces(layer, linear: str) -> list[tuple[int, int]]:
    """(first output column, width) of each piece of a fused matmul's output."""
    q, kv, inter = layer.q_size, layer.kv_size, layer.inter
    if linear == "qkv":
        return [(0, q), (q, kv), (q + kv, kv)]
    if linear == "gate_up":
        return [(0, inter), (inter, inter)] if layer.gated else [(0, inter)]
    return [(0, getattr(layer, f"{linear}_weight").shape[0])]


def _check_config(config, path: Path) -> None:
    problems = []
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        problems.append(f"its peft_type is {getattr(config, 'peft_type', None)}, not LORA")
    if getattr(config, "use_dora", False):
        problems.append("it is a DoRA adapter (use_dora)")
    if getattr(config, "modules_to_save", None):
        problems.append(f"it trains whole modules (modules_to_save={config.modules_to_save})")
    if getattr(config, "lora_bias", False):
        problems.append("it trains LoRA biases (lora_bias)")
    if problems:
        raise LoraError(f"the adapter in {path} cannot be served: {'; '.join(problems)}. Serve a merged model instead "
                        "(peft's merge_and_unload, or booster.save_lora_as_pretrained(..., merge=True))")


def _scaling(config, module: str, rank: int) -> float:
    from peft.utils.other import get_pattern_key

    alpha = config.lora_alpha
    if getattr(config, "alpha_pattern", None):
        key = get_pattern_key(config.alpha_pattern.keys(), module)
        alpha = config.alpha_pattern.get(key, alpha)
    return alpha / (math.sqrt(rank) if getattr(config, "use_rslora", False) else rank)


def adapter_dir(path: str | Path) -> Path:
    """The PEFT adapter directory `path` names: `path` itself; its `adapter/` (the LLaMA recipe's
    output_dir, an RLHF checkpoint); or the `adapter/` of its latest complete checkpoint (an RLHF
    LoRA run's output_dir)."""
    from phalanx.checkpoint.train_state import latest_checkpoint

    path = Path(path).expanduser()
    candidates = [path, path / "adapter"]
    if path.is_dir() and (checkpoint := latest_checkpoint(path)) is not None:
        candidates.append(Path(checkpoint) / "adapter")
    for candidate in candidates:
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise LoraError(f"no adapter_config.json in {str(path)!r}, its adapter/ or its latest checkpoint's adapter/: give "
                    "the directory a PEFT adapter was saved to (adapter_config.json + adapter_model.safetensors, from "
                    "save_pretrained) or a LoRA training run's output_dir")


def read_adapter(path: str | Path, model, *, max_rank: int, name: str) -> tuple[list[Piece], int]:
    """The pieces of the PEFT adapter in `path` placed in `model` (a `DecoderModel`), and its rank;
    LoraError naming what does not fit (rank above `max_rank`, another base model, a target this
    engine cannot adapt)."""
    from phalanx.booster.lora import import_peft

    path = adapter_dir(path)
    peft = import_peft()
    config = peft.PeftConfig.from_pretrained(str(path))
    _check_config(config, path)
    from peft.utils import load_peft_weights
    tensors = load_peft_weights(str(path), device="cpu")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _KEY.match(key)
        if found is None:
            raise LoraError(f"adapter {name!r} holds {key!r}, which is not a LoRA matrix of a linear layer "
                            "(embedding adapters and extra trained tensors are not served): serve a merged model")
        factors.setdefault(found["module"], {})[found["which"]] = tensor
    pieces, rank = [], 0
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r} has lora_A without lora_B (or the reverse) for {module}")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        rank = max(rank, r)
        if r > max_rank:
            raise LoraError(f"adapter {name!r} has rank {r} (at {module}), above max_lora_rank={max_rank}: "
                            f"restart with --max-lora-rank {r} (LLM(..., max_lora_rank={r}))")
        pieces += _place(model, module, a.float(), b.float() * _scaling(config, module, r), name)
    if not pieces:
        raise LoraError(f"adapter {name!r} in {path} holds no LoRA matrices")
    return pieces, rank


def _place(model, module: str, a: torch.Tensor, b: torch.Tensor, name: str) -> list[Piece]:
    """Where `module`'s factors go: one Piece per role its weight fills (GPT-2's c_attn: q, k, v)."""
    try:
        index, roles, _ = model.names.pieces(f"{module}.weight")
    except KeyError:
        index, roles = None, ()
    if index is None or index >= len(model.layers):
        raise LoraError(f"adapter {name!r} adapts {module!r}, which is not a projection of this model's decoder "
                        "layers (embeddings and the LM head take no served adapter; was it made for another model?)")
    layer, out = model.layers[index], []
    for role in roles:
        where = _placement(layer, role.role)
        if where is None:
            raise LoraError(f"adapter {name!r} adapts {module!r} (role {role.role}), which this engine cannot adapt "
                            "(expert layers and shared experts take no adapter): serve a merged model")
        linear, piece = where
        width = output_pieces(layer, linear)[piece][1]  # this rank's
        fan_in = getattr(layer, f"{linear}_weight").shape[1]  # this rank's
        # this rank's part, as the base weight is split: rows of B for a column-parallel piece (q, k,
        # v, gate, up: its output columns, offset in a fused source such as GPT-2's c_attn), columns
        # of A for a row-parallel one (o, down: its input rows; the partial deltas meet in the
        # layer's all-reduce with the base's partial sums)
        offset = role.offset(model.spec) if linear in ("qkv", "gate_up") else 0
        target = model.role_target(role.role, "weight", index, offset)
        row_parallel = target.dim == 1
        full_in = fan_in * model.tp_size if row_parallel else fan_in
        full_out = _full_width(model, role.role, width)
        if (a.shape[1] != full_in or b.shape[0] < offset + full_out
                or (len(roles) == 1 and b.shape[0] != full_out)):
            raise LoraError(f"adapter {name!r} does not fit this base model at {module!r}: lora_A {list(a.shape)} and "
                            f"lora_B {list(b.shape)}, the layer maps {full_in} inputs to {full_out} outputs; "
                            "was it trained on another base model?")
        if row_parallel:
            out.append(Piece(index, linear, piece, a.narrow(1, target.start, target.length).contiguous(), b))
        else:
            out.append(Piece(index, linear, piece, a, b.narrow(0, target.start, target.length)))
    return out


def _full_width(model, role: str, local: int) -> int:
    """The whole model's output width of `role` (`local`: this rank's): key/value heads may be
    replicated over the ranks rather than split."""
    if role in ("k", "v"):
        return model.spec.num_kv_heads * model.spec.head_dim
    return local * (model.tp_size if role in ("q", "gate", "up") else 1)


# -- the batched low-rank matmul -------------------------------------------------------------------
class StepSlots:
    """The current step's adapter slots, shared by every wrapper: `hi` (the highest slot used) and
    the one-hot mask [tokens, hi] of each token's slot (the base model's tokens: all zero)."""

    def __init__(self) -> None:
        self.hi = 0
        self.mask: torch.Tensor | None = None

    def set(self, token_slots: list[int] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        slots = torch.as_tensor(token_slots, dtype=torch.long)  # on the host
        self.hi = int(slots.max()) if slots.numel() else 0
        if self.hi == 0:
            self.mask = None
            return
        self.mask = F.one_hot(slots, self.hi + 1)[:, 1:].to(dtype).to(device)


class LowRankStack:
    """The stacked factors of every slot for one fused matmul, laid out for two matmuls per step:
    A as [slots, pieces·r_max, in] (every piece's A stacked, so one x·Aᵀ gives all of a slot's
    lanes) and B·scaling as [slots, pieces·r_max, out], block-diagonal over the pieces (piece p's
    r_max rows are non-zero only in its own output columns), so one matmul adds every piece's
    delta to the fused output. Where the base weights are packed for oneDNN (bf16 on a CPU with
    native bf16, `packed_linear`), the factors of the first `hi` slots a step uses are packed too,
    and kept until a step uses another `hi` or an adapter is loaded or unloaded."""

    def __init__(self, pieces: list[tuple[int, int]], fan_in: int, slots: int, rank: int, dtype, device) -> None:
        self.pieces, self.rank = pieces, rank
        out = pieces[-1][0] + pieces[-1][1]
        self.a = torch.zeros(slots, len(pieces) * rank, fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(slots, len(pieces) * rank, out, dtype=dtype, device=device)
        self.packs = packed_linear.can_pack(self.a[0])
        self._packed: tuple | None = None  # (hi, packed A[:hi], packed B[:hi]ᵀ)
        self.calls = 0  # batched deltas computed (one per layer call of a step with adapter tokens)

    def clear(self, slot: int) -> None:
        self.a[slot - 1].zero_()
        self.b[slot - 1].zero_()
        self._packed = None

    def put(self, slot: int, piece: Piece) -> None:
        r, lane = piece.a.shape[0], piece.piece * self.rank
        first, width = self.pieces[piece.piece]
        self.a[slot - 1, lane:lane + r].copy_(piece.a)
        self.b[slot - 1, lane:lane + r, first:first + width].copy_(piece.b.t())
        self._packed = None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: StepSlots) -> torch.Tensor:
        """y (= base(x), [N, out]) plus every token's own adapter delta, in place: three operations
        (every used slot's lanes, the slot mask, one accumulating matmul) whatever the pieces."""
        self.calls += 1
        hi, n = step.hi, x.shape[0]
        _, per_slot, fan_in = self.a.shape
        a, b = self.a[:hi].view(hi * per_slot, fan_in), self.b[:hi].view(hi * per_slot, -1)
        if not self.packs:
            lanes = F.linear(x, a)
            lanes.view(n, hi, per_slot).mul_(step.mask[:, :, None])
            return y.addmm_(lanes, b)
        if self._packed is None or self._packed[0] != hi:
            self._packed = (hi, packed_linear.pack(a), packed_linear.pack(b.t()))
        lanes = packed_linear.linear(x, a, packed=self._packed[1])
        lanes.view(n, hi, per_slot).mul_(step.mask[:, :, None])
        return y.add_(packed_linear.linear(lanes, b.t(), packed=self._packed[2]))


class LoraLayer:
    """Replaces a decoder layer's `linear(name, x, bias)`: the base call, plus the adapters' deltas
    on the matmuls some loaded adapter adapts."""

    def __init__(self, base, step: StepSlots) -> None:
        self.base, self.step = base, step
        self.stacks: dict[str, LowRankStack] = {}

    def __call__(self, name: str, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        y = self.base(name, x, bias)
        stack = self.stacks.get(name)
        if stack is None or self.step.mask is None:
            return y
        return stack.add_delta(x, y, self.step)


@dataclass
class LoraAdapters:
    """The adapter registry of one engine: names -> slots, the layers' wrappers, the step's slots.
    `lock` is held by the engine's model step and by load/unload (which may come from another
    thread: the HTTP server's)."""

    model: object
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    adapters: dict[str, Adapter] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        for what, value in (("max_loras", self.max_loras), ("max_lora_rank", self.max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}={value!r} must be a positive integer")
        self.step = StepSlots()
        self.layers: dict[int, LoraLayer] = {}
        self.structure = 0  # bumped when a matmul gains its stack: captured decode steps re-capture
        self._loads = itertools.count(1)
        param = self.model.embed
        self.dtype, self.device = param.dtype, param.device

    # -- registry
    def load(self, name: str, path: str | Path) -> Adapter:
        """Read the adapter (outside the lock) and place it in a free slot."""
        if not isinstance(name, str) or not name:
            raise LoraError(f"an adapter needs a non-empty name, got {name!r}")
        if name in self.adapters:
            raise LoraError(f"an adapter named {name!r} is already loaded (from {self.adapters[name].path}); "
                            "unload it first or choose another name")
        pieces, rank = read_adapter(path, self.model, max_rank=self.max_lora_rank, name=name)
        with self.lock:
            if name in self.adapters:
                raise LoraError(f"an adapter named {name!r} is already loaded")
            used = {a.slot for a in self.adapters.values()}
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if not free:
                raise LoraError(f"all max_loras={self.max_loras} adapter slots are in use "
                                f"({', '.join(sorted(self.adapters))}): unload one, or restart with a larger --max-loras")
            slot = free[0]
            for layer in self.layers.values():
                for stack in layer.stacks.values():
                    stack.clear(slot)
            for piece in pieces:
                self._stack(piece.layer, piece.linear).put(slot, piece)
            adapter = Adapter(name, str(path), slot, rank, f"lora:{next(self._loads)}".encode())
            self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self.lock:
            adapter = self.get(name)
            if adapter.refs:
                raise LoraError(f"adapter {name!r} is used by {adapter.refs} request(s) in flight: "
                                "unload it when they have finished")
            for layer in self.layers.values():
                for stack in layer.stacks.values():
                    stack.clear(adapter.slot)
            del self.adapters[name]

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise LoraError(f"the LoRA adapter {name!r} is not loaded (loaded: {loaded})", status=404)
        return adapter

    def acquire(self, name: str) -> Adapter:
        with self.lock:
            adapter = self.get(name)
            adapter.refs += 1
            return adapter

    def release(self, adapter: Adapter) -> None:
        with self.lock:
            adapter.refs -= 1

    # -- wrappers and steps
    def _stack(self, index: int, linear: str) -> LowRankStack:
        """The stacked factors of layer `index`'s matmul `linear`, wrapping the layer on first use."""
        layer = self.model.layers[index]
        wrapper = self.layers.get(index)
        if wrapper is None:
            wrapper = self.layers[index] = LoraLayer(layer.linear, self.step)
            layer.linear = wrapper  # module replacement: every matmul of the layer goes through it
        stack = wrapper.stacks.get(linear)
        if stack is None:
            self.structure += 1
            fan_in = getattr(layer, f"{linear}_weight").shape[1]
            stack = wrapper.stacks[linear] = LowRankStack(output_pieces(layer, linear), fan_in, self.max_loras,
                                                          self.max_lora_rank, self.dtype, self.device)
        return stack

    def set_step(self, token_slots: list[int] | torch.Tensor) -> None:
        """The adapter slot of every token of the next forward, in the order of its rows."""
        self.step.set(token_slots, self.dtype, self.device)

    def use_mask(self, mask: torch.Tensor) -> None:
        """The next forward reads every slot's lanes through `mask` [tokens, max_loras] (a captured
        decode step's fixed buffer: its shape does not depend on which adapters the step uses)."""
        self.step.hi, self.step.mask = self.max_loras, mask
