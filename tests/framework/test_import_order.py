"""Every import in framework/phalanx runs downhill: a package imports only from floors below its own
(or a listed peer on its own floor) of `phalanx.layers.LAYERS`, never a private name of another
package, never the `tests` tree, and `phalanx.testing` only from `TESTING_USERS`.

The checker reads the source with `ast`, so imports inside functions count as much as those at the
top of a module; relative imports, `from phalanx import x` and `importlib.import_module("phalanx.x")`
with a literal name are resolved to the package they reach. See docs/architecture.md.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

from phalanx import layers

REPO = Path(__file__).resolve().parents[2]
PHALANX = REPO / "framework" / "phalanx"


# ---------------------------------------------------------------------------- the checker
def top_level_names(root: Path) -> set[str]:
    """The top-level packages and modules under `root` (a `phalanx` directory)."""
    names = {p.stem for p in root.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py"))}
    return names


def _owner(rel: Path) -> str:
    """The top-level package a file belongs to ("phalanx" for the root __init__.py)."""
    if len(rel.parts) == 1:
        return "phalanx" if rel.name == "__init__.py" else rel.stem
    return rel.parts[0]


def imports_in(source: str, rel: Path, root: str = "phalanx") -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, dotted module, names taken from it) for every import in the source of the file at
    `rel` (relative to the directory of package `root`), resolved to absolute names."""
    module = [root, *rel.with_suffix("").parts]
    package = module[:-1]  # for __init__.py: the package itself; else the module's package
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = tuple(a.name for a in node.names)
            if base == root == "phalanx":  # `from phalanx import lazy`: the submodule, where there is one
                for name in names:
                    yield node.lineno, f"phalanx.{name}", ()
            else:
                yield node.lineno, base, names
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value, ()


def _target(dotted: str, known: set[str]) -> str | None:
    """The top-level phalanx package a dotted module name reaches; "tests" for the test tree;
    None outside phalanx."""
    parts = dotted.split(".")
    if parts[0] in ("tests", "conftest"):
        return "tests"
    if parts[0] != "phalanx":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in known else "phalanx"


def _where(package: str) -> str:
    i = layers.floor_of(package)
    return "no floor" if i is None else f"floor {i} '{layers.LAYERS[i].name}'"


def violations(root: Path) -> list[str]:
    """Every import under `root` (a phalanx directory) that breaks the order, as
    "file:line: what is wrong"."""
    known = top_level_names(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        owner = _owner(rel)
        for line, dotted, names in imports_in(path.read_text(), rel):
            target = _target(dotted, known)
            if target is None or target == owner:
                continue
            at = f"phalanx/{rel}:{line}"
            if target == "tests":
                found.append(f"{at}: framework code imports the test tree ({dotted})")
                continue
            if target == "testing" and owner not in layers.TESTING_USERS:
                found.append(f"{at}: {owner} imports the test helpers phalanx.testing; only "
                             f"{', '.join(layers.TESTING_USERS)} may (move what it needs below both)")
            elif not layers.may_import(owner, target):
                found.append(f"{at}: upward import: {owner} ({_where(owner)}) imports {dotted} "
                             f"({target}: {_where(target)})")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{at}: {owner} takes {target}'s private {', '.join(private)} from {dotted}: "
                             "use a public name")
    return found


# ---------------------------------------------------------------------------- the tree as it is
def test_every_import_in_phalanx_goes_downhill():
    found = violations(PHALANX)
    assert not found, "imports against phalanx/layers.py (docs/architecture.md):\n" + "\n".join(found)


def test_the_kernels_import_nothing_from_phalanx():
    kernels = REPO / "kernels" / "phalanx_kernels"
    found = [f"{path.relative_to(REPO)}:{line}: imports {dotted}"
             for path in sorted(kernels.rglob("*.py"))
             for line, dotted, _ in imports_in(path.read_text(), path.relative_to(kernels), "phalanx_kernels")
             if dotted == "phalanx" or dotted.startswith("phalanx.")]
    assert not found, "phalanx_kernels sits below phalanx:\n" + "\n".join(found)


def test_every_package_is_on_exactly_one_floor():
    listed = [p for floor in layers.LAYERS for p in floor.packages]
    assert len(listed) == len(set(listed)), "a package is on two floors"
    missing = top_level_names(PHALANX) - set(listed)
    assert not missing, f"put {sorted(missing)} on a floor of phalanx/layers.py LAYERS (and docs/architecture.md)"
    stale = set(listed) - top_level_names(PHALANX) - {"phalanx"}
    assert not stale, f"LAYERS lists packages that do not exist: {sorted(stale)}"


def test_peers_share_a_floor_and_form_no_cycle():
    for importer, peers in layers.PEERS.items():
        for peer in peers:
            assert layers.floor_of(importer) == layers.floor_of(peer) is not None, (importer, peer)
            assert importer not in layers.PEERS.get(peer, ()), f"{importer} and {peer} may import each other"


def test_the_architecture_doc_shows_the_table():
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert layers.markdown_table() in doc, ("docs/architecture.md's floor table differs from phalanx/layers.py: "
                                            "paste `phalanx.layers.markdown_table()` into it")


# ---------------------------------------------------------------------------- the checker catches what it must
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A phalanx directory with every package of LAYERS (empty) plus `files`."""
    root = tmp_path / "phalanx"
    for floor in layers.LAYERS:
        for package in floor.packages:
            if package != "phalanx":
                (root / package).mkdir(parents=True, exist_ok=True)
                (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


# The five imports issue 34 removed, each as it was (two inside functions).
OLD_IMPORTS = {
    "checkpoint reaches into booster": (
        "checkpoint/writer.py",
        "import torch\n\n\ndef _snapshot():\n    from phalanx.booster.booster import _scheduler_state\n",
        5, ["upward import: checkpoint", "phalanx.booster.booster", "private _scheduler_state"]),
    "amp imports zero": (
        "amp/mixed_precision_optimizer.py", "from phalanx.zero.fused_step import fused_step\n",
        1, ["upward import: amp", "phalanx.zero.fused_step"]),
    "data imports train": (
        "data/chat.py", '"""Chat data."""\nfrom phalanx.train.losses import IGNORE_INDEX\n',
        2, ["upward import: data", "phalanx.train.losses"]),
    "plan imports the test helpers": (
        "plan/measure.py", "def measure():\n    from phalanx.testing import tiny_llama_config\n",
        2, ["plan imports the test helpers phalanx.testing"]),
    "hybrid takes checkpoint's private name": (
        "booster/plugins/hybrid/checkpoint.py", "from phalanx.checkpoint.hf import SpreadModelCopy, _names_not_saved\n",
        1, ["booster takes checkpoint's private _names_not_saved"]),
}


@pytest.mark.parametrize("case", list(OLD_IMPORTS))
def test_the_checker_fails_on_each_old_upward_import(tmp_path, case):
    name, source, line, words = OLD_IMPORTS[case]
    found = violations(_tree(tmp_path, {name: source}))
    assert found, f"{case}: not caught"
    assert all(f.startswith(f"phalanx/{name}:{line}: ") for f in found), found
    for word in words:
        assert any(word in f for f in found), (word, found)


@pytest.mark.parametrize("name, source", [
    ("checkpoint/writer.py", "def f():\n    from ..booster import booster\n"),                 # relative
    ("checkpoint/writer.py", "from .. import booster\n"),
    ("data/__init__.py", "from ..train import losses\n"),                                      # package __init__
    ("amp/clip.py", "from phalanx import zero\n"),
    ("amp/clip.py", "import phalanx.zero.optimizer as z\n"),
    ("data/chat.py", "import importlib\nm = importlib.import_module('phalanx.train.losses')\n"),
    ("malloc.py", "import phalanx\n"),                                                         # the front door is above
])
def test_the_checker_resolves_every_form_of_import(tmp_path, name, source):
    found = violations(_tree(tmp_path, {name: source}))
    assert len(found) == 1 and "upward import" in found[0], found


@pytest.mark.parametrize("name, source, words", [
    ("train/step.py", "def f():\n    import tests.framework.peak_memory\n", "imports the test tree"),
    ("train/step.py", "from tests.framework import gemini_workers\n", "imports the test tree"),
    ("inference/server.py", "from phalanx.testing import spawn\n", "only selfcheck may"),
    ("cli.py", "from phalanx import testing\n", "only selfcheck may"),
])
def test_the_checker_flags_framework_code_importing_tests(tmp_path, name, source, words):
    found = violations(_tree(tmp_path, {name: source}))
    assert found and words in found[0], found


def test_the_checker_allows_downhill_peer_and_own_package_imports(tmp_path):
    root = _tree(tmp_path, {
        "booster/booster.py": "from phalanx.checkpoint.hf import save_hf_model\nfrom phalanx.booster.state import x\n",
        "shard/policy.py": "from phalanx.zero.partition import FlatLayout\n",   # a listed peer
        "selfcheck/plugins.py": "from phalanx.testing import spawn\n",          # a testing user
        "cli.py": "import torch\nfrom phalanx.inference import serve\n",
    })
    assert violations(root) == []


def test_the_checker_refuses_an_unlisted_peer(tmp_path):
    found = violations(_tree(tmp_path, {"zero/optimizer.py": "from phalanx.shard import policy\n"}))
    assert len(found) == 1 and "upward import: zero" in found[0], found
