"""Tiny video recipe configs for the tests of this folder (see video_tiny.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op thread: the models are tiny and the machine is shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
