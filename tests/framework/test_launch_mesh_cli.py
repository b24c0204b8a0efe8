"""launch (single process and torchrun), mesh layout arithmetic, and the `phalanx` command."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.cli import environment_report
from phalanx.mesh import LayoutError, ParallelConfig
from phalanx.torchrun import build_run_command


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


COMMAND_MODULES = ["phalanx.cli", "phalanx.torchrun", "phalanx.inference.serve"]
FRAMEWORK = Path(__file__).resolve().parents[2] / "framework"


def test_command_modules_import_fresh():
    """Each module the `phalanx` command is made of imports on its own in a new interpreter (no
    import order between them is needed)."""
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for m in COMMAND_MODULES}
    for module, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"import {module}:\n{out[-2000:]}"


def _imported_modules(path) -> set[str]:
    """Every module a file imports, at the top or inside functions (`from . import x` resolved)."""
    import ast

    package = ".".join(path.relative_to(FRAMEWORK).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_the_cli_is_imported_by_nothing_in_the_framework():
    """Dependencies point one way: the command imports the framework, never the reverse (the
    server used to import `phalanx.cli` to restart itself under torchrun; both now use
    `phalanx.torchrun`)."""
    files = sorted((FRAMEWORK / "phalanx").rglob("*.py"))
    assert len(files) > 50
    offenders = [str(f.relative_to(FRAMEWORK)) for f in files if f.name != "cli.py"
                 and any(m == "phalanx.cli" or m.startswith("phalanx.cli.") for m in _imported_modules(f))]
    assert offenders == []
    assert "phalanx.torchrun" in _imported_modules(FRAMEWORK / "phalanx" / "inference" / "serve.py")


def test_phalanx_run_gives_each_restart_a_fresh_rendezvous_store(monkeypatch):
    from phalanx.torchrun import run_environment

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert run_environment()["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_launch_prefixes_the_agent_store_with_the_restart_attempt(monkeypatch):
    """Under torchrun's shared agent store, each restart attempt gets keys of its own (the stale
    keys of the previous attempt made gloo connect to a dead rank's port)."""
    import datetime

    import torch.distributed as dist

    from phalanx.launch import elastic_attempt_store
    from phalanx.testing import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert elastic_attempt_store(1, datetime.timedelta(seconds=10)) is None  # torch's env:// is fine then
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    store = elastic_attempt_store(1, datetime.timedelta(seconds=10))
    store.set("rank_0", "address")
    assert agent_store.get("phalanx/attempt3/rank_0") == b"address"


@pytest.mark.slow
def test_plain_torchrun_restart_recovers_through_launch(tmp_path):
    """`torchrun --standalone --max-restarts 1` (the shared agent store, not `phalanx run`): after
    a rank is SIGKILLed the restarted ranks initialise through phalanx.launch and finish."""
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent("""
        import os, signal, torch, torch.distributed as dist, phalanx
        ctx = phalanx.launch(seed=0)
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        for i in range(4):
            t = torch.ones(1)
            dist.all_reduce(t)
            if attempt == 0 and ctx.rank == 1 and i == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank {ctx.rank} finished in attempt {attempt}", flush=True)
        phalanx.shutdown()
    """))
    env = dict(os.environ, PHALANX_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=1", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        import signal
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "rank 0 finished in attempt 1" in out and "rank 1 finished in attempt 1" in out
