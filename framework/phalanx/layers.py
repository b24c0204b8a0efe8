"""The floors of phalanx: which top-level package may import which (docs/architecture.md).

Every top-level package or module of `phalanx` sits on one floor of `LAYERS`, lowest first. A
package imports only from floors below its own, and from a package on its own floor only where
`PEERS` lists the pair. The root `phalanx/__init__.py` is the package called "phalanx" here.
`phalanx.testing` (the test helpers) is imported by the tests, and in the framework only by the
packages in `TESTING_USERS`; nothing in the framework imports the `tests` tree.

tests/framework/test_import_order.py reads this table and checks every import in
framework/phalanx against it (module-level and inside functions); docs/architecture.md prints it
(`markdown_table()`, kept equal by that test). This module imports nothing.
"""
from __future__ import annotations

from typing import NamedTuple


class Floor(NamedTuple):
    name: str
    packages: tuple[str, ...]
    holds: str


LAYERS: tuple[Floor, ...] = (
    Floor("leaves", ("emulate", "malloc", "hostmem", "config", "observe", "param_binding", "layout", "data",
                     "pretrained", "torchrun", "diffusion", "layers"),
          "self-contained helpers that import nothing from phalanx: the emulated GPU, the allocator, host "
          "memory, typed configs, logging and metrics, parameter names, the `Layout` value, data pipelines "
          "(and `IGNORE_INDEX`), pretrained weights, the torchrun starter, diffusion maths, this table"),
    Floor("process", ("launch",), "one rank: device, threads, allocator setting, the process group"),
    Floor("front door", ("phalanx",), "`phalanx/__init__.py`: re-exports `launch`, registers the emulator"),
    Floor("groups", ("mesh", "json_collectives", "device", "watchdog"),
          "what ranks share: the device mesh, JSON collectives, the run's device, the hang watchdog"),
    Floor("models", ("models",), "the model-family table (torch and transformers only)"),
    Floor("precision", ("amp",), "dtype policy, loss scaling, clipping, the fused optimizer step"),
    Floor("checkpoint", ("checkpoint",), "atomic directories, HF export, optimizer fragments, the checkpoint writer"),
    Floor("sharding", ("zero", "shard"), "ZeRO's flat shards; tensor parallelism by shard policies"),
    Floor("parallel", ("lazy", "sequence", "pipeline", "gemini"),
          "meta-device init, sequence and pipeline parallelism, Gemini's chunk tiers"),
    Floor("booster", ("booster",), "the Booster and its plugins: one layout applied to a training script"),
    Floor("plan", ("plan",), "memory and time per layout, and the measured peaks"),
    Floor("train", ("train",), "the training loop every app uses"),
    Floor("testing", ("testing",), "the test helpers: spawn ranks, tiny models, numerical comparisons"),
    Floor("serving", ("inference", "selfcheck"), "inference and the serve command; `phalanx selfcheck`"),
    Floor("command", ("cli",), "the `phalanx` command"),
)

# Same-floor imports that are allowed, importer -> imported (no cycles).
PEERS: dict[str, tuple[str, ...]] = {
    "shard": ("zero",),
    "gemini": ("lazy",),
    "selfcheck": ("inference",),
    "observe": ("malloc",),  # release_free_memory trims through the one allocator owner
}

# Framework packages that may import `phalanx.testing` (selfcheck runs the tests' smoke checks).
TESTING_USERS: tuple[str, ...] = ("selfcheck",)


def floor_of(package: str) -> int | None:
    """The index in LAYERS of `package`'s floor, or None when no floor lists it."""
    for i, floor in enumerate(LAYERS):
        if package in floor.packages:
            return i
    return None


def may_import(importer: str, imported: str) -> bool:
    """Whether top-level package `importer` may import `imported` (both on a floor)."""
    if importer == imported:
        return True
    if imported == "testing" and importer not in TESTING_USERS:
        return False
    low, high = floor_of(imported), floor_of(importer)
    if low is None or high is None:
        return False
    return low < high or (low == high and imported in PEERS.get(importer, ()))


def markdown_table() -> str:
    """LAYERS as the table docs/architecture.md shows (highest floor first, as in the drawing)."""
    rows = ["| floor | name | packages | holds |", "|---|---|---|---|"]
    for i in reversed(range(len(LAYERS))):
        floor = LAYERS[i]
        packages = ", ".join(f"`{p}`" for p in floor.packages)
        rows.append(f"| {i} | {floor.name} | {packages} | {floor.holds} |")
    return "\n".join(rows)
