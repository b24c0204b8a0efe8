"""Checkpoint safety: atomic writes, manifests, refusing partial or corrupt checkpoints."""
from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.booster import Booster
from phalanx.booster.plugins import DDPPlugin
from phalanx.checkpoint import CheckpointError, FragmentReader, TrainState, atomic_directory, verify_manifest
from phalanx.testing import tiny_llama


@pytest.fixture()
def booster_and_model():
    phalanx.launch(seed=0)
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=DDPPlugin())
    model, opt, *_ = booster.boost(model, opt)
    ids = torch.randint(0, 128, (2, 8))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    yield booster, model, opt
    phalanx.shutdown()


def test_corrupt_and_partial_checkpoints_are_refused(tmp_path, booster_and_model):
    booster, model, opt = booster_and_model
    path = booster.save_checkpoint(tmp_path / "ckpt", model, opt, train_state=TrainState(step=1))
    verify_manifest(path)
    shard = next((path / "model").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        booster.load_checkpoint(path, model, opt)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        booster.load_checkpoint(path, model, opt)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="partial"):
        booster.load_checkpoint(path, model, opt)


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, booster_and_model):
    booster, model, opt = booster_and_model
    path = booster.save_checkpoint(tmp_path / "ckpt", model, opt, train_state=TrainState(step=1))
    before = (path / "train_state.json").read_text()
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(path) as tmp:
            (tmp / "half-written.bin").write_bytes(b"x" * 100)
            raise KeyboardInterrupt  # e.g. the job was killed mid-save
    assert (path / "train_state.json").read_text() == before
    assert not list(tmp_path.glob("ckpt.tmp-*"))
    state = booster.load_checkpoint(path, model, opt)
    assert state.step == 1


def test_fragment_reader_joins_ranges_from_several_files(tmp_path):
    """A parameter that straddles two ranks' shards reads back whole, and any sub-range too."""
    from safetensors.torch import save_file
    import json
    full = torch.arange(10, dtype=torch.float32)
    save_file({"a": full[:4].clone()}, str(tmp_path / "r0.safetensors"))
    save_file({"b": full[4:].clone()}, str(tmp_path / "r1.safetensors"))
    index = {"format": "phalanx-optim-fragments/1", "param_groups": [], "params": {
        "w": {"shape": [2, 5], "scalars": {"step": 3.0},
              "states": {"exp_avg": [[0, 4, "r0.safetensors", "a"], [4, 10, "r1.safetensors", "b"]]}}}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    reader = FragmentReader(tmp_path)
    assert torch.equal(reader.read("w", "exp_avg", 0, 10), full)
    assert torch.equal(reader.read("w", "exp_avg", 3, 7), full[3:7])
    assert reader.scalars("w") == {"step": 3.0}
    with pytest.raises(CheckpointError, match="no state for parameter"):
        reader.read("v", "exp_avg", 0, 1)


def test_load_model_refuses_a_different_architecture(tmp_path, booster_and_model):
    booster, model, opt = booster_and_model
    booster.save_model(model, tmp_path / "m")
    other = tiny_llama(seed=0, hidden_size=48)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        booster.load_model(other, tmp_path / "m")


def test_loss_scaler_state_is_saved_once_with_the_optimizer(tmp_path):
    """The fp16 scaler's state lives in the optimizer checkpoint only (not train_state.json) and
    comes back with the optimizer, from a full checkpoint and from save_optimizer alone."""
    import json

    from phalanx.booster.state import boosted_state

    phalanx.launch(seed=0)
    try:
        model = tiny_llama(seed=0)
        booster = Booster(plugin=DDPPlugin(precision="fp16"))
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert boosted_state(model).optimizer is opt and boosted_state(opt) is boosted_state(model)
        saved = {"scale": 512.0, "good_steps": 7, "skipped_steps": 2}
        opt.scaler.load_state_dict(saved)
        path = booster.save_checkpoint(tmp_path / "ckpt", model, opt, train_state=TrainState(step=1))
        only_optimizer = booster.save_optimizer(opt, tmp_path / "optim")
        assert "loss_scaler" not in json.loads((path / "train_state.json").read_text())
        for source, load in ((path, lambda: booster.load_checkpoint(path, model, opt)),
                             (only_optimizer, lambda: booster.load_optimizer(opt, only_optimizer))):
            opt.scaler.load_state_dict({"scale": 2.0**16, "good_steps": 0, "skipped_steps": 0})
            load()
            got = {"scale": opt.scaler.scale, "good_steps": opt.scaler.good_steps,
                   "skipped_steps": opt.scaler.skipped_steps}
            assert got == saved, source
    finally:
        phalanx.shutdown()


def _save_where_rank1_cannot_write(directory: str) -> dict:
    """Booster.save_checkpoint used directly (no fit) on 2 ranks, rank 1's part of the save fails."""
    import torch.distributed as dist

    from phalanx.checkpoint.writer import CheckpointSaveError

    model = tiny_llama(seed=0)
    booster = Booster(plugin=DDPPlugin())
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 128, (2, 8))
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()

    def extra(tmp):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")

    from pathlib import Path
    good = booster.save_checkpoint(Path(directory) / "good", model, opt, train_state=TrainState(step=1))
    try:
        booster.save_checkpoint(Path(directory) / "bad", model, opt, train_state=TrainState(step=2),
                                extra_writer=extra)
        error = None
    except CheckpointSaveError as exc:
        error = str(exc)
    return {"error": error, "good": good.is_dir()}


def test_direct_save_failing_on_one_rank_raises_on_every_rank(tmp_path):
    """No rank is left at a barrier: both raise CheckpointSaveError naming rank 1's error, no
    checkpoint and no temporary directory remain (issue 35)."""
    from phalanx.testing import spawn

    results = spawn(_save_where_rank1_cannot_write, 2, str(tmp_path), timeout=120)
    for result in results:
        assert result["good"]
        assert result["error"] is not None and "rank 1" in result["error"] and "No space left" in result["error"], result
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob("bad.tmp-*"))
    verify_manifest(tmp_path / "good")
