"""Dispatch: backend selection, overrides, and an import without side effects."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from phalanx_kernels import dispatch, get_backend, rms_norm, set_backend, use_backend
from kernel_checks import HAS_TRITON


def test_import_has_no_side_effects():
    code = ("import json, os, sys; before = dict(os.environ); import phalanx_kernels; "
            "print(json.dumps({'env_same': dict(os.environ) == before, "
            "'triton': 'triton' in sys.modules, 'transformers': 'transformers' in sys.modules}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"env_same": True, "triton": False,
                                                               "transformers": False}


def test_set_backend_validates_and_returns_previous():
    assert get_backend() == "auto"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        set_backend("cuda")
    previous = set_backend("torch")
    try:
        assert previous == "auto" and get_backend() == "torch"
    finally:
        set_backend(previous)


def test_use_backend_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with use_backend("torch"):
            assert get_backend() == "torch"
            raise RuntimeError("boom")
    assert get_backend() == "auto"


def test_auto_uses_reference_on_cpu_and_torch_forces_it():
    x = torch.randn(2, 8)
    assert dispatch.use_triton(x) is False
    with use_backend("torch"):
        assert dispatch.use_triton(x) is False
    w = torch.randn(8)
    assert torch.allclose(rms_norm(x, w), torch.nn.functional.rms_norm(x, (8,), w, 1e-6), atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_forced_triton_on_cpu_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(torch.randn(2))


def test_forced_triton_without_triton_names_the_fix(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with use_backend("triton"), pytest.raises(RuntimeError, match="pip install triton"):
        dispatch.use_triton(torch.randn(2))
