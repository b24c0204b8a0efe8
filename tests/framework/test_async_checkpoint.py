"""Asynchronous checkpoints: the same files as a synchronous save, written while training goes
on, one save at a time, and a failed background write leaves the previous checkpoint loadable.
(A rank SIGKILLed during the background write is in test_fault_elastic.py.)"""
from __future__ import annotations

import threading
import time
from itertools import pairwise
from pathlib import Path

import torch
from safetensors.torch import load_file

import train_helpers as th
from phalanx.checkpoint import list_checkpoints, load_hf_state_dict, verify_manifest
from phalanx.checkpoint.writer import CheckpointWriter
from phalanx.observe import read_metrics
from phalanx.testing import spawn, tiny_llama
from phalanx.train import fit


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in load_hf_state_dict(checkpoint / "model").items()}
    for f in sorted((checkpoint / "optimizer").glob("*.safetensors")):
        out.update({f"{f.name}/{k}": v for k, v in load_file(str(f)).items()})
    return out


class StepClock:
    """A TrainHook recording when each step ended, and signalling it."""
    name = "step_clock"

    def __init__(self):
        self.ends: dict[int, float] = {}
        self.ended = {step: threading.Event() for step in range(1, 10)}

    def bind(self, model):
        pass

    def after_step(self, step):
        self.ends[step] = time.perf_counter()
        self.ended[step].set()

    def save(self, directory):
        pass

    def load(self, directory):
        pass


def test_async_save_writes_the_same_checkpoints_while_training_goes_on(tmp_path, monkeypatch):
    sync = fit(th.config(tmp_path / "sync", max_steps=4, save_every=1), tiny_llama(), th.ArithmeticSequences())

    clock = StepClock()
    writes: list[tuple[int, float, float, bool]] = []
    real_write = CheckpointWriter._write_files

    def write_during_next_step(self, snapshot):
        """Hold the write of checkpoint N until training has finished step N + 1 (bounded): only
        possible if training goes on while the checkpoint is written."""
        start = time.perf_counter()
        overlapped = snapshot.step < 4 and clock.ended[snapshot.step + 1].wait(60)
        real_write(self, snapshot)
        writes.append((snapshot.step, start, time.perf_counter(), overlapped))

    monkeypatch.setattr(CheckpointWriter, "_write_files", write_during_next_step)
    result = fit(th.config(tmp_path / "async", max_steps=4, save_every=1, async_save=True), tiny_llama(),
                 th.ArithmeticSequences(), hooks=[clock])

    assert result.losses == sync.losses
    assert [s for s, _ in list_checkpoints(tmp_path / "async")] == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        a, b = (_tensors(p / "checkpoints" / f"step-{step:08d}") for p in (tmp_path / "async", tmp_path / "sync"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"checkpoint {step} differs"
        verify_manifest(tmp_path / "async" / "checkpoints" / f"step-{step:08d}")
    assert [w[0] for w in writes] == [1, 2, 3, 4]
    # training went on while checkpoints 1-3 were written ...
    assert [w[3] for w in writes] == [True, True, True, False]
    # ... and one save at a time: each write starts after the previous one ended
    assert all(later[1] >= earlier[2] for earlier, later in pairwise(writes))


def test_failed_background_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    real_write = CheckpointWriter._write_files

    def full_disk_at_step_2(self, snapshot):
        if snapshot.step == 2:
            (snapshot.tmp / "model").mkdir(parents=True, exist_ok=True)
            (snapshot.tmp / "model" / "half.bin").write_bytes(b"x" * 100)
            raise OSError(28, "No space left on device")
        return real_write(self, snapshot)

    monkeypatch.setattr(CheckpointWriter, "_write_files", full_disk_at_step_2)
    with caplog.at_level("WARNING"):
        result = fit(th.config(tmp_path, max_steps=3, save_every=1, keep_last=1, async_save=True), tiny_llama(),
                     th.ArithmeticSequences())
    assert result.final_step == 3 and [s for s, _ in list_checkpoints(tmp_path)] == [3]
    assert not list((tmp_path / "checkpoints").glob("*.tmp-*"))
    warning = " ".join(r.getMessage() for r in caplog.records if "NOT saved" in r.getMessage())
    assert "step-00000002 was NOT saved" in warning and "No space left on device" in warning
    assert "step-00000001 is intact" in warning
    assert len(read_metrics(result.metrics_path)) >= 3


def test_async_save_on_two_ranks_spreads_the_model_copy_and_writes_the_same_model(tmp_path):
    """DDP, ZeRO-2, FSDP and Gemini hand every rank every gathered tensor, so an asynchronous save
    keeps its copy of the model spread: each rank about half of it (at most half plus one tensor),
    written as one file each of a sharded export that equals the synchronous save's model and
    opens with from_pretrained."""
    from transformers import AutoModelForCausalLM

    plugins = ("ddp", "zero2", "fsdp", "gemini")
    per_rank = spawn(th.rank_async_spread, 2, str(tmp_path), plugins, timeout=600)
    for name in plugins:
        runs = per_rank[0][name]
        assert runs["async"]["losses"] == runs["sync"]["losses"], name
        assert runs["sync"]["held"] == []  # synchronous saves stream; nothing is kept
        for rank_runs in (per_rank[0][name], per_rank[1][name]):
            for record in rank_runs["async"]["held"]:  # one per checkpoint
                assert 0 < record["kept"] <= record["total"] / 2 + record["biggest"], (name, record)
                assert record["files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        for step in (2, 4):
            a, b = (Path(runs[mode]["root"]) / "checkpoints" / f"step-{step:08d}" for mode in ("async", "sync"))
            verify_manifest(a)
            ta, tb = _tensors(a), _tensors(b)
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), (name, step)
        opened = AutoModelForCausalLM.from_pretrained(str(a / "model"))
        saved = load_hf_state_dict(b / "model")
        assert all(torch.equal(opened.state_dict()[k], v) for k, v in saved.items()), name
