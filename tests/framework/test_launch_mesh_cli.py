"""launch (single process and torchrun), mesh layout arithmetic, and the `phalanx` command."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from phalanx.cli import build_run_command, environment_report
from phalanx.mesh import LayoutError, ParallelConfig


def test_layout_arithmetic_in_error():
    with pytest.raises(LayoutError) as info:
        ParallelConfig(dp=2, tp=2, pp=2).resolve(4)
    assert "2 × 2 × 1 × 2 = 8" in str(info.value) and "world size is 4" in str(info.value)
    with pytest.raises(LayoutError, match="not divisible by tp × pp × sp"):
        ParallelConfig(tp=3).resolve(4)
    assert ParallelConfig(tp=2).resolve(4).dp == 2


def test_single_process_launch_creates_one_rank_group():
    import phalanx
    ctx = phalanx.launch(seed=1)
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        phalanx.shutdown()


def test_run_command_translation():
    cmd = build_run_command(["-n", "2", "-m", "apps.llama.pretrain", "--config", "x.yaml"])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert cmd[-4:] == ["-m", "apps.llama.pretrain", "--config", "x.yaml"]
    multi = build_run_command(["-n", "8", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "t.py", "--lr", "1"])
    assert "--nnodes=2" in multi and "--rdzv-endpoint=h:29500" in multi and "--standalone" not in multi


def test_env_report_names_backends():
    report = environment_report()
    assert report["backends"]["gloo"] is True
    assert report["torch"].startswith("2.13.0")


def test_phalanx_run_starts_two_ranks(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch, torch.distributed as dist, phalanx
        ctx = phalanx.launch(seed=0)
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t)
        if ctx.rank == 0:
            print(json.dumps({"world": ctx.world_size, "sum": t.item(), "threads": torch.get_num_threads()}))
        phalanx.shutdown()
    """))
    env = dict(os.environ, PHALANX_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][0]
    assert json.loads(line) == {"world": 2, "sum": 3.0, "threads": 1}
