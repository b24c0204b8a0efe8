"""What `fit` does with a NaN loss (skip / roll back, with a limit, logged) and with a checkpoint
save that fails for lack of space (the previous checkpoint stays, the run goes on or stops as
asked, `keep_last` never deletes the last good checkpoint)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import train_helpers as th
from phalanx.checkpoint import list_checkpoints, verify_manifest
from phalanx.observe import read_metrics
from phalanx.testing import spawn, tiny_llama
from phalanx.train import NonFiniteLossError, fit


def poisoned(at_calls: set[int]):
    """A loss_fn whose n-th call (1-based, training only) returns NaN for n in `at_calls`."""
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        loss = model(**batch).loss
        return loss * float("nan") if len(calls) in at_calls else loss
    return loss_fn


class WeightsAfterStep:
    """A TrainHook recording a copy of the weights after each step."""
    name = "weights_probe"

    def __init__(self):
        self.after: dict[int, list[torch.Tensor]] = {}

    def bind(self, model):
        self.model = model

    def after_step(self, step):
        self.after[step] = [p.detach().clone() for p in self.model.parameters()]

    def save(self, directory):
        pass

    def load(self, directory):
        pass


def test_nonfinite_skip_drops_the_step_and_stops_at_the_limit(tmp_path):
    probe = WeightsAfterStep()
    cfg = th.config(tmp_path / "skip", max_steps=6, on_nonfinite="skip", max_nonfinite=2)
    result = fit(cfg, tiny_llama(), th.ArithmeticSequences(), loss_fn=poisoned({3, 5}), hooks=[probe])
    assert result.final_step == 6 and len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    for skipped in (3, 5):  # no optimizer step: the weights are exactly those of the step before
        assert all(torch.equal(a, b) for a, b in zip(probe.after[skipped], probe.after[skipped - 1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(probe.after[4], probe.after[3], strict=True))
    events = [r for r in read_metrics(result.metrics_path) if r.get("event") == "nonfinite_skip"]
    assert [e["step"] for e in events] == [3, 5]

    cfg = th.config(tmp_path / "limit", max_steps=6, on_nonfinite="skip", max_nonfinite=2)
    with pytest.raises(NonFiniteLossError, match=r"nan at step 4.*max_nonfinite=2"):
        fit(cfg, tiny_llama(), th.ArithmeticSequences(), loss_fn=poisoned({2, 3, 4}))


def test_nonfinite_rollback_reloads_the_checkpoint_with_a_lower_lr(tmp_path):
    reference = fit(th.config(tmp_path / "ref", max_steps=6, save_every=2), tiny_llama(), th.ArithmeticSequences(),
                    loss_fn=poisoned(set()))
    cfg = th.config(tmp_path / "rb", max_steps=6, save_every=2, on_nonfinite="rollback", rollback_lr_factor=0.5)
    result = fit(cfg, tiny_llama(), th.ArithmeticSequences(), loss_fn=poisoned({5}))
    records = read_metrics(result.metrics_path)
    rollbacks = [r for r in records if r.get("event") == "nonfinite_rollback"]
    assert rollbacks == [{"step": 5, "event": "nonfinite_rollback", "to_step": 4, "lr_scale": 0.5}]
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    ref_lr = {r["step"]: r["lr"] for r in read_metrics(reference.metrics_path) if "lr" in r}
    assert lr[4] == ref_lr[4] and lr[5] == pytest.approx(ref_lr[5] / 2) and lr[6] == pytest.approx(ref_lr[6] / 2)
    # steps 1-4 are the reference's; 5 and 6 are retrained from step 4's checkpoint
    assert result.losses[:4] == reference.losses[:4] and len(result.losses) == 6
    assert result.final_step == 6
    # the lower rate is saved with the schedule, so a restart keeps it
    import json
    state = json.loads((result.checkpoint_dir / "train_state.json").read_text())
    assert state["lr_scheduler"]["base_lrs"] == [pytest.approx(cfg.lr / 2)] * len(state["lr_scheduler"]["base_lrs"])

    cfg = th.config(tmp_path / "none", max_steps=4, on_nonfinite="rollback")
    with pytest.raises(NonFiniteLossError, match="save_every"):
        fit(cfg, tiny_llama(), th.ArithmeticSequences(), loss_fn=poisoned({2}))


# ---- disk full ------------------------------------------------------------------------------

class FileSizeLimit:
    """A TrainHook that makes this process's writes fail with EFBIG (as on a full disk) from the
    checkpoint of `fail_step` on (RLIMIT_FSIZE, SIGXFSZ ignored). The next checkpoint's snapshot,
    which runs after the failed save has finished (even an asynchronous one), lifts the limit and
    records the complete checkpoints on disk at that moment."""
    name = "fsize_limit"

    def __init__(self, output_dir: str, fail_step: int, limit_bytes: int = 8192):
        self.output_dir, self.fail_step, self.limit = output_dir, fail_step, limit_bytes
        self.step, self.saved_limit = 0, None
        self.on_disk_after_failure: list[str] = []

    def bind(self, model):
        pass

    def after_step(self, step):
        import resource
        import signal

        self.step = step
        if step == self.fail_step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            self.saved_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved_limit[1]))

    def lift(self):
        import resource

        if self.saved_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.saved_limit)
            self.saved_limit = None

    def save(self, directory):
        if self.step == self.fail_step + 1:
            self.lift()
            root = Path(self.output_dir) / "checkpoints"
            self.on_disk_after_failure = sorted(p.name for p in root.iterdir()
                                                if not p.name.startswith(f"step-{self.step:08d}"))

    def load(self, directory):
        pass


def rank_disk_full(root: str):
    """Runs in spawned ranks (the file-size limit must not touch the test process)."""
    from phalanx.checkpoint.writer import CheckpointSaveError

    out = {"ref": fit(th.config(Path(root) / "ref", max_steps=5, save_every=1, keep_last=1), tiny_llama(),
                      th.ArithmeticSequences()).losses}
    for mode, async_save in (("sync", False), ("async", True)):
        run = Path(root) / mode
        limit = FileSizeLimit(str(run), fail_step=3)
        result = fit(th.config(run, max_steps=5, save_every=1, keep_last=1, async_save=async_save), tiny_llama(),
                     th.ArithmeticSequences(), hooks=[limit])
        out[mode] = {"final_step": result.final_step, "after_failure": limit.on_disk_after_failure,
                     "losses": result.losses,
                     "final": [s for s, _ in list_checkpoints(run)], "ckpt": str(result.checkpoint_dir)}
    run = Path(root) / "stop"
    limit = FileSizeLimit(str(run), fail_step=2)
    try:
        fit(th.config(run, max_steps=5, save_every=1, on_save_error="stop"), tiny_llama(), th.ArithmeticSequences(),
            hooks=[limit])
        out["stop"] = "no error"
    except CheckpointSaveError as exc:
        out["stop"] = str(exc)
        out["stop_on_disk"] = [s for s, _ in list_checkpoints(run)]
    finally:
        limit.lift()
    return out


def test_disk_full_keeps_the_previous_checkpoint_and_training_goes_on(tmp_path):
    results = spawn(rank_disk_full, 2, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for mode in ("sync", "async"):
            got = out[mode]
            assert got["final_step"] == 5
            # with keep_last=1 the failed save of step 3 left step 2, the last good one, in place
            assert "step-00000002" in got["after_failure"], (mode, got)
            assert all(".tmp-" not in name for name in got["after_failure"]), (mode, got)
            assert got["final"] == [5], (mode, got)
            assert got["losses"] == out["ref"], "a failed save must not change training"
        assert "was NOT saved" in out["stop"] and "File too large" in out["stop"], out["stop"]
        assert "step-00000001 is intact" in out["stop"] and "on_save_error='stop'" in out["stop"]
        assert out["stop_on_disk"] == [1]
    verify_manifest(Path(results[0]["sync"]["ckpt"]))
