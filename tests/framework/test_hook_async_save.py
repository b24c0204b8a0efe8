"""A hook's state in an asynchronous checkpoint: `EMA.snapshot` copies the average on the
training thread at the save's step, and its file is written by the checkpoint's background
thread with the other files (issue 35: EMA used to write synchronously inside an async save)."""
from __future__ import annotations

import threading

import torch
from safetensors.torch import load_file

import train_helpers as th
from phalanx.train import EMA, fit


class RecordingEMA(EMA):
    """EMA that remembers, per save, the average it copied and the thread that wrote the file."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copied: dict[str, dict[str, torch.Tensor]] = {}
        self.writer_threads: dict[str, str] = {}

    def snapshot(self, directory):
        write = super().snapshot(directory)
        self.copied[directory.parent.name.split(".tmp-")[0]] = {k: v.clone() for k, v in self.full_state_dict().items()}

        def recorded():
            self.writer_threads[directory.parent.name.split(".tmp-")[0]] = threading.current_thread().name
            write()
        return recorded


def test_ema_file_is_written_by_the_async_writer_with_the_state_of_its_step(tmp_path):
    ema = RecordingEMA(decay=0.5, warmup=False)
    result = fit(th.config(tmp_path, max_steps=4, save_every=2, async_save=True, resume=False), th.tiny_llama(seed=0),
                 th.ArithmeticSequences(), hooks=[ema])
    assert result.final_step == 4
    assert set(ema.writer_threads) == set(ema.copied) and len(ema.copied) == 2, ema.writer_threads
    for name, thread in ema.writer_threads.items():
        assert thread.startswith("phalanx-checkpoint-"), (name, thread)  # not the training thread
        written = load_file(str(tmp_path / "checkpoints" / name / "ema" / "ema.safetensors"))
        assert set(written) == set(ema.copied[name])
        for key, value in ema.copied[name].items():
            assert torch.equal(written[key], value.cpu()), (name, key)
    # the step-2 average is not the step-4 one: the copy was taken at its own step, not at write time
    first, last = sorted(ema.copied)
    assert any(not torch.equal(ema.copied[first][k], ema.copied[last][k]) for k in ema.copied[first])
