"""`phalanx selfcheck`'s recipe smoke runs: a recipe whose optional dependency is missing is skipped with the
install command (seen on a GPU machine without biotite / av), anything else that fails is a failure, and the
child keeps the caller's PYTHONPATH (a checkout run with PYTHONPATH=framework:kernels found no `phalanx`)."""
from __future__ import annotations

import subprocess

import pytest

from phalanx.selfcheck import recipes
from phalanx.selfcheck.report import Skip


def _fake_run(returncode: int, stderr: str, seen: dict):
    def run(args, cwd=None, env=None, **_):
        seen["env"] = env
        return subprocess.CompletedProcess(args, returncode, stdout="", stderr=stderr)
    return run


def test_missing_optional_dependency_is_a_skip_naming_the_extra(monkeypatch):
    monkeypatch.setattr(recipes.subprocess, "run", _fake_run(1, "Traceback...\nModuleNotFoundError: No module named "
                                                                  "'biotite'", {}))
    module, args = recipes.SMOKES["protein"]
    with pytest.raises(Skip, match=r"needs 'biotite'.*pip install -e '\.\[protein\]'"):
        recipes._smoke(module, args, "/tmp/unused")


def test_a_missing_phalanx_module_or_any_other_error_fails(monkeypatch):
    for stderr in ("ModuleNotFoundError: No module named 'phalanx'", "RuntimeError: CUDA error: out of memory"):
        monkeypatch.setattr(recipes.subprocess, "run", _fake_run(1, stderr, {}))
        with pytest.raises(AssertionError, match="exited 1"):
            recipes._smoke(*recipes.SMOKES["llama"], "/tmp/unused")


def test_the_child_keeps_the_callers_pythonpath(monkeypatch):
    seen: dict = {}
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site")
    monkeypatch.setattr(recipes.subprocess, "run", _fake_run(0, "", seen))
    recipes._smoke(*recipes.SMOKES["llama"], "/tmp/unused")
    parts = seen["env"]["PYTHONPATH"].split(":")
    assert parts[0] == str(recipes._checkout()) and "/somewhere/site" in parts
