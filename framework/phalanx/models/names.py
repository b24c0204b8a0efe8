"""Checkpoint weight names: where each Hugging Face weight of a family goes, as *roles* (`q`, `k`,
`v`, `o`, `gate`, `up`, `down`, norms, `embed`, ...). Each family's table says which role(s) a
name fills, at which offset of a fused source tensor, and whether it is stored transposed; the
inference engine (`phalanx.inference.llama.DecoderModel.role_target`) turns a role into the
destination slice of one tensor-parallel rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Piece:
    """Part of an HF weight: fills `role` (its weight or bias); `offset(spec)` is where the role's
    rows start in a fused source tensor; `transposed` for Conv1D weights ([in, out])."""

    role: str
    offset: Callable[[object], int] = lambda spec: 0
    transposed: bool = False


def at(role: str, offset=lambda spec: 0, transposed: bool = False) -> tuple[Piece, ...]:
    return (Piece(role, offset, transposed),)


@dataclass(frozen=True)
class NameTable:
    prefixes: tuple[str, ...]  # prefixes of the checkpoint's names, longest first (stripped)
    layer_prefix: str  # after the stripped prefix: "layers." / "h."
    top: dict[str, tuple[Piece, ...]]  # model-level names (without prefix, without .weight/.bias)
    layer: dict[str, tuple[Piece, ...]]  # per-layer names (after "<layer_prefix><i>.")
    ignored: tuple[str, ...] = ()  # name suffixes that are buffers, not weights

    def pieces(self, name: str) -> tuple[int | None, tuple[Piece, ...], str]:
        """(layer index or None, the pieces, "weight"/"bias") of a checkpoint name; KeyError if unknown."""
        if name == "lm_head.weight":
            return None, self.top["lm_head"], "weight"
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        base, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            raise KeyError(name)
        if base.startswith(self.layer_prefix):
            index, _, local = base[len(self.layer_prefix):].partition(".")
            if not index.isdigit() or local not in self.layer:
                raise KeyError(name)
            return int(index), self.layer[local], kind
        if base not in self.top:
            raise KeyError(name)
        return None, self.top[base], kind

    def names(self, num_layers: int) -> list[tuple[str, str]]:
        """Every (checkpoint name, kind) this family may have, for the expected-weights check."""
        prefix = self.prefixes[0] if self.prefixes else ""
        out = [("lm_head.weight", "weight")] + [(f"{prefix}{t}.{k}", k) for t in self.top if t != "lm_head"
                                                for k in ("weight", "bias")]
        for i in range(num_layers):
            out += [(f"{prefix}{self.layer_prefix}{i}.{local}.{k}", k) for local in self.layer
                    for k in ("weight", "bias")]
        return out
