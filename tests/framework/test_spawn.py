"""phalanx.testing.spawn: ranks fork from a server that imported torch and transformers once, and
each rank still sees the caller's environment as it is when `spawn` is called (not as it was when
the server started)."""
import os

import pytest

from phalanx.testing import spawn
from spawn_env_workers import report_env, scratch_directory


def test_ranks_get_the_callers_environment_at_spawn_time(monkeypatch):
    spawn(report_env, 1, ["PATH"])  # the server is running from here on
    monkeypatch.setenv("PHALANX_SPAWN_PROBE", "set after the server started")
    monkeypatch.delenv("PHALANX_SPAWN_GONE", raising=False)
    os.environ["PHALANX_SPAWN_GONE"] = "x"
    monkeypatch.delenv("PHALANX_SPAWN_GONE")
    out = spawn(report_env, 2, ["PHALANX_SPAWN_PROBE", "PHALANX_SPAWN_GONE", "OMP_NUM_THREADS", "HF_HUB_OFFLINE",
                                "EXTRA"], env={"EXTRA": "from the env argument"})
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert o["env"] == {"PHALANX_SPAWN_PROBE": "set after the server started", "PHALANX_SPAWN_GONE": None,
                            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "EXTRA": "from the env argument"}
        assert o["transformers_preloaded"]  # imported by the server, not by this rank


def test_fresh_interpreters_on_request(monkeypatch):
    monkeypatch.setenv("PHALANX_SPAWN_METHOD", "spawn")
    (out,) = spawn(report_env, 1, ["PHALANX_SPAWN_METHOD"])
    assert out["env"]["PHALANX_SPAWN_METHOD"] == "spawn"
    monkeypatch.setenv("PHALANX_SPAWN_METHOD", "fork")
    with pytest.raises(ValueError, match="PHALANX_SPAWN_METHOD='fork'"):
        spawn(report_env, 1, [])


def test_a_ranks_exit_handlers_run():
    """A forked rank leaves through os._exit; its atexit handlers (here a TemporaryDirectory's
    cleanup) still run before `spawn` returns."""
    for path in spawn(scratch_directory, 2):
        assert not os.path.exists(path), path
