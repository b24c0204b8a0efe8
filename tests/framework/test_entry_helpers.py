"""The recipes' shared entry-point helpers: `launched` and `resolve_path`."""
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.config import resolve_path
from phalanx.launch import launched


def test_launched_shuts_the_group_down_even_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"), launched(seed=3) as ctx:
        assert dist.is_initialized() and ctx.world_size == 1
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_resolve_path_takes_relative_paths_from_the_root(tmp_path):
    assert resolve_path("data/x.txt", tmp_path) == tmp_path / "data" / "x.txt"
    assert resolve_path(tmp_path / "abs", "/elsewhere") == tmp_path / "abs"
    assert resolve_path("~/x", tmp_path) == Path.home() / "x"
