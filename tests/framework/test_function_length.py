"""No function in framework/ is longer than 120 lines (issue 34): a longer one is a sign that
several jobs share mutable locals, which is what made `fit` hard to change."""
from __future__ import annotations

import ast
from pathlib import Path

FRAMEWORK = Path(__file__).resolve().parents[2] / "framework" / "phalanx"
MAX_LINES = 120


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """'path:line name (N lines)' for every function or method in `root` longer than `limit`
    lines, decorators and docstring included."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_framework_function_is_longer_than_120_lines():
    assert long_functions(FRAMEWORK) == []


def test_the_measure_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:5 long ({MAX_LINES + 1} lines)"]
