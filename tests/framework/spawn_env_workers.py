"""Rank bodies for test_spawn.py (module level: ranks import them by name)."""
import os
import sys


def report_env(names: list[str]) -> dict:
    import torch.distributed as dist

    return {"env": {n: os.environ.get(n) for n in names}, "rank": dist.get_rank(),
            "transformers_preloaded": "transformers" in sys.modules}


_KEPT = []


def scratch_directory() -> str:
    """A temporary directory the rank keeps until it exits (cleaned by its exit handlers)."""
    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="phalanx-spawn-scratch-")
    _KEPT.append(scratch)
    return scratch.name
