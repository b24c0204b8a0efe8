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
class ExpertNames:
    """A mixture-of-experts block's names inside a decoder layer. blocks: the block's prefixes,
    the checkpoint's first ("block_sparse_moe." for Mixtral), then transformers' module name
    ("mlp."). per_expert: the per-expert projection names of a checkpoint ({"w1": "gate", ...}).
    Accepted: `<block>gate.weight` (the router), `<block>experts.<e>.<proj>.weight` (one expert,
    as checkpoints store them) and transformers' fused `<block>experts.gate_up_proj`
    [experts, 2·width, hidden] / `<block>experts.down_proj` [experts, hidden, width]."""

    blocks: tuple[str, ...]
    per_expert: dict[str, str]

    def parse(self, local: str) -> tuple[str, int | None] | None:
        """(role, expert index or None) of a name inside a layer (with its .weight), or None.
        Roles: "router", "expert_gate", "expert_up", "expert_down" (one expert), "experts_gate_up",
        "experts_down" (all experts, fused)."""
        for block in self.blocks:
            if not local.startswith(block):
                continue
            rest = local[len(block):]
            fixed = {"gate.weight": "router", "experts.gate_up_proj": "experts_gate_up",
                     "experts.down_proj": "experts_down"}
            if rest in fixed:
                return fixed[rest], None
            parts = rest.split(".")
            if (len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[2] in self.per_expert
                    and parts[3] == "weight"):
                return "expert_" + self.per_expert[parts[2]], int(parts[1])
        return None

    def checkpoint_names(self, num_experts: int) -> list[str]:
        """The names one layer's block has in a checkpoint (inside the layer)."""
        block = self.blocks[0]
        return [f"{block}gate.weight"] + [f"{block}experts.{e}.{proj}.weight" for e in range(num_experts)
                                          for proj in self.per_expert]

    def covered(self, local: str, num_experts: int) -> list[str]:
        """The checkpoint names (inside the layer) that a name fills: a fused tensor fills one
        projection of every expert; a router under another block name, the checkpoint's router."""
        parsed = self.parse(local)
        if parsed is None:
            return []
        role, _ = parsed
        names = self.checkpoint_names(num_experts)
        if role == "router":
            return names[:1]
        if role.startswith("experts_"):
            wanted = {"experts_gate_up": ("gate", "up"), "experts_down": ("down",)}[role]
            projs = [p for p, r in self.per_expert.items() if r in wanted]
            return [n for n in names[1:] if n.split(".")[-2] in projs]
        return []


@dataclass(frozen=True)
class NameTable:
    prefixes: tuple[str, ...]  # prefixes of the checkpoint's names, longest first (stripped)
    layer_prefix: str  # after the stripped prefix: "layers." / "h."
    top: dict[str, tuple[Piece, ...]]  # model-level names (without prefix, without .weight/.bias)
    layer: dict[str, tuple[Piece, ...]]  # per-layer names (after "<layer_prefix><i>.")
    ignored: tuple[str, ...] = ()  # name suffixes that are buffers, not weights
    experts: ExpertNames | None = None  # mixture-of-experts blocks (their router and experts)

    def layer_local(self, name: str) -> tuple[int, str] | None:
        """(layer index, the name inside the layer, with its .weight) of a checkpoint name, or None."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if not name.startswith(self.layer_prefix):
            return None
        index, _, local = name[len(self.layer_prefix):].partition(".")
        return (int(index), local) if index.isdigit() else None

    def layer_name(self, index: int, local: str) -> str:
        return f"{self.prefixes[0] if self.prefixes else ''}{self.layer_prefix}{index}.{local}"

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
