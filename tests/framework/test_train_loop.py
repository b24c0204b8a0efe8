"""`phalanx.train.fit` in one process: learning, accumulation, outputs, checkpoints, bad input."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_helpers as th
from phalanx.checkpoint import latest_checkpoint, list_checkpoints, verify_manifest
from phalanx.config import ConfigError
from phalanx.observe import read_metrics
from phalanx.testing import ADAMW_UPDATE_RTOL, check, eps, rel_diff, rounding_rtol, tiny_llama, update_diff
from phalanx.train import NonFiniteLossError, causal_lm_eval, fit

# bf16 compute (fp32 masters) against fp32 over 10 steps: losses within one bf16 rounding,
# eps(bf16) = 7.8e-3 (measured 5.2e-4 on AVX-512, 6.4e-4 with AVX2 kernels)
BF16_LOSS_RTOL = eps(torch.bfloat16)


def test_fit_learns_and_writes_everything(tmp_path):
    """Loss falls; metrics JSONL, loss PNG, eval records and a from_pretrained-able checkpoint."""
    from transformers import AutoModelForCausalLM

    evals = []
    eval_fn = causal_lm_eval(th.ArithmeticSequences(n=16, seed=99), batch_size=8)

    def recording_eval(model, step):
        evals.append(step)
        assert not model.training and not torch.is_grad_enabled()
        return eval_fn(model, step)

    model = tiny_llama(seed=0)
    cfg = th.config(tmp_path, max_steps=40, save_every=20, keep_last=2, eval_every=20, log_every=5, plot=True,
                    peak_tflops=None)
    result = fit(cfg, model, th.ArithmeticSequences(n=128), eval_fn=recording_eval)

    assert result.final_step == 40 and result.start_step == 0 and len(result.losses) == 40
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 1.5, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert evals == [20, 40]
    assert result.last_eval["loss"] < math.log(th.VOCAB) and result.last_eval["ppl"] > 1

    records = read_metrics(result.metrics_path)
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [5, 10, 15, 20, 25, 30, 35, 40]
    assert {"lr", "grad_norm", "tokens_per_s", "tflops_per_rank", "mfu", "tokens_seen"} <= set(records[-1]) | set(records[-2])
    assert [r["step"] for r in records if "eval/loss" in r] == [20, 40]
    assert result.tokens_per_s > 0 and 0 < result.mfu < 1
    assert result.loss_plot == tmp_path / "loss.png" and result.loss_plot.read_bytes()[:4] == b"\x89PNG"

    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 40]
    assert result.checkpoint_dir == latest_checkpoint(tmp_path)
    verify_manifest(result.checkpoint_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(result.checkpoint_dir / "model")
    ids = th.ArithmeticSequences(n=4, seed=5).input_ids
    model.eval()
    with torch.no_grad():  # the same fp32 weights: the same forward up to its summation order
        check(rel_diff(reloaded(input_ids=ids).logits, model(input_ids=ids).logits),
              rounding_rtol(torch.float32, th.SEQ), "reloaded checkpoint: logits")


def test_accumulation_2x2_equals_batch_4_with_uneven_padding(tmp_path):
    """Token-weighted averaging makes 2 micro-batches of 2 the same step as one batch of 4, even
    when padding gives the micro-batches different numbers of target tokens."""
    data = {"pad": True, "n": 32}
    big, big_model = th.train(tmp_path / "big", data, max_steps=4, micro_batch_size=4, grad_accum_steps=1)
    acc, acc_model = th.train(tmp_path / "acc", data, max_steps=4, micro_batch_size=2, grad_accum_steps=2)
    check(rel_diff(acc.losses, big.losses), rounding_rtol(torch.float32, 4 * th.SEQ), "2 x 2 vs 4 x 1: losses")
    check(update_diff(dict(acc_model.named_parameters()), dict(big_model.named_parameters()),
                      dict(tiny_llama(seed=0).named_parameters())), ADAMW_UPDATE_RTOL, "2 x 2 vs 4 x 1: weights")


def test_bf16_tracks_fp32(tmp_path):
    """bf16 compute with fp32 master weights follows the fp32 run (BF16_LOSS_RTOL) and saves fp32
    weights."""
    from safetensors.torch import load_file

    fp32, _ = th.train(tmp_path / "fp32", max_steps=10)
    bf16, model = th.train(tmp_path / "bf16", max_steps=10, precision="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    check(rel_diff(bf16.losses, fp32.losses), BF16_LOSS_RTOL, "bf16 vs fp32: losses")
    assert sum(bf16.losses[-3:]) / 3 < sum(bf16.losses[:3]) / 3 - 0.2
    weights = load_file(str(bf16.checkpoint_dir / "model" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in weights.values())


def test_nan_loss_stops_before_the_step_is_saved(tmp_path):
    calls = []

    def poisoned_loss(model, batch):
        calls.append(1)
        loss = model(**batch).loss
        return loss * float("nan") if len(calls) == 3 else loss

    cfg = th.config(tmp_path, max_steps=5, save_every=1)
    with pytest.raises(NonFiniteLossError) as err:
        fit(cfg, tiny_llama(), th.ArithmeticSequences(), loss_fn=poisoned_loss)
    message = str(err.value)
    assert "nan at step 3" in message and "step-00000002" in message and "lr" in message
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]
    verify_manifest(latest_checkpoint(tmp_path))


def test_keep_last_prunes_only_after_a_new_checkpoint(tmp_path):
    th.train(tmp_path, max_steps=5, save_every=1, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]


def test_existing_checkpoints_need_resume(tmp_path):
    th.train(tmp_path, max_steps=2)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(FileExistsError, match="resume=true"):
        th.train(tmp_path, max_steps=4, resume=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    again, _ = th.train(tmp_path, max_steps=2)  # already complete: nothing to train
    assert again.start_step == 2 and again.final_step == 2 and again.losses == []


def test_resume_says_when_the_schedule_changed(tmp_path, capfd):
    """The lr schedule is rebuilt from the config: a resumed run with a raised max_steps (decay_steps
    unset) decays on another curve than the first session, which looked like a resume bug in the video
    recipe. One warning names it; raising max_steps with decay_steps kept at the old horizon does not."""
    th.train(tmp_path, max_steps=2)
    capfd.readouterr()
    th.train(tmp_path, max_steps=3)
    out = capfd.readouterr()
    warned = [line for line in (out.out + out.err).splitlines() if "learning-rate schedule" in line]
    assert len(warned) == 1 and "cosine ends at step 2 -> 3" in warned[0], warned
    th.train(tmp_path / "kept", max_steps=2, decay_steps=4)
    th.train(tmp_path / "kept", max_steps=3, decay_steps=4)
    out = capfd.readouterr()
    assert "learning-rate schedule" not in out.out + out.err


def _wandb_records(path: Path):
    """The protobuf records of a wandb run file (`run-<id>.wandb`): a 7-byte header, then
    LevelDB-log blocks of 32 KiB whose chunks (crc32, length, type) carry one record whole
    (type 1) or in pieces (2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, record = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", f"{path} is not a wandb run file: it starts {data[:7]!r}"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def _wandb_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb writes either form


def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    """The offline run directory holds the run: its project and training config, and per step the
    metrics that metrics.jsonl has, loss included."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    result, _ = th.train(tmp_path, max_steps=2, wandb=True, wandb_project="phalanx-test")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, sorted(p.name for p in (tmp_path / "wandb").iterdir())
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1, sorted(p.name for p in runs[0].iterdir())
    # wandb's service process writes the file after `finish` returns: wait for the run's exit record
    deadline = time.monotonic() + 60
    while True:
        records = list(_wandb_records(files[0]))
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "exit" in kinds, f"no exit record in {files[0]} after 60 s: {kinds}"
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "phalanx-test"
    config = {_wandb_key(item): json.loads(item.value_json) for item in run.config.update}
    assert config["max_steps"] == 2 and config["output_dir"] == str(tmp_path), config
    history = {r.history.step.num: {_wandb_key(item): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"}
    metrics = {m["step"]: m for m in read_metrics(tmp_path / "metrics.jsonl") if "loss" in m}
    assert sorted(history) == sorted(metrics) == [1, 2], (sorted(history), sorted(metrics))
    for step, logged in history.items():
        for key in ("loss", "lr", "grad_norm", "tokens_seen"):
            assert logged[key] == metrics[step][key], (step, key, logged[key], metrics[step][key])
    assert [history[s]["loss"] for s in (1, 2)] == pytest.approx(result.losses, rel=1e-12)


class _NotALanguageModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": torch.zeros(4, dtype=torch.long)}


@pytest.mark.parametrize("case, error, words", [
    ("tiny_dataset", ValueError, ["has 3 samples", "micro_batch_size"]),
    ("iterable", TypeError, ["map-style dataset"]),
    ("not_lm", TypeError, ["no output (LM) head", "loss_fn="]),
    ("ragged", ValueError, ["different shapes", "'input_ids'"]),
    ("no_input_ids", ValueError, ["'input_ids'", "loss_fn="]),
    ("plugin_option", ConfigError, ["plugin_options", "bucket_size"]),
])
def test_bad_input_fails_clearly_before_touching_disk(tmp_path, case, error, words):
    model, dataset = tiny_llama(), th.ArithmeticSequences()
    if case == "tiny_dataset":
        dataset = th.ArithmeticSequences(n=3)
    elif case == "iterable":
        dataset = _Stream()
    elif case == "not_lm":
        model = _NotALanguageModel()
    elif case == "ragged":
        dataset = [{"input_ids": torch.arange(8 + i % 2)} for i in range(16)]
    elif case == "no_input_ids":
        dataset = [{"tokens": torch.arange(8)} for _ in range(16)]
    options = {"bucket_size": 3} if case == "plugin_option" else {}
    out = tmp_path / "run"
    with pytest.raises(error) as err:
        fit(th.config(out, max_steps=2, plugin_options=options), model, dataset)
    for word in words:
        assert word in str(err.value)
    assert not (out / "checkpoints").exists()


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    """A process killed while writing checkpoint 2 leaves checkpoint 1 complete; resuming
    continues from it and clears the partial directory."""
    out = tmp_path / "run"
    helper = Path(th.__file__)
    proc = subprocess.run([sys.executable, str(helper), "kill-during-save", str(out)], capture_output=True, text=True,
                          timeout=180, cwd=str(helper.parent))
    assert proc.returncode == 17, proc.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(out)] == [1]
    partial = list((out / "checkpoints").glob("step-00000002.tmp-*"))
    assert partial and not (out / "checkpoints" / "step-00000002").exists()
    verify_manifest(latest_checkpoint(out))

    resumed, _ = th.train(out, max_steps=4, save_every=1, keep_last=0)
    assert resumed.start_step == 1 and resumed.final_step == 4 and len(resumed.losses) == 3
    assert not list((out / "checkpoints").glob("*.tmp-*"))
    assert [s for s, _ in list_checkpoints(out)] == [1, 2, 3, 4]


def _noisy_loss(model, batch):
    """A loss whose gradient depends on the global RNG, as diffusion / flow losses draw noise."""
    return model(**batch).loss * (1 + torch.rand(()))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_continues_the_global_random_stream_exactly(tmp_path, num_workers):
    """A run stopped at step 2 and resumed to step 4 equals the uninterrupted 4-step run to the bit,
    with a loss that draws from the global RNG (as diffusion and flow losses draw noise): the
    checkpoint's RNG state is restored after the resumed run has built its loader (whose iterator
    takes one int64 from the global RNG), with and without loader workers."""
    def run(out, steps):  # the LR schedule of the 4-step run in every session (decay_steps)
        model = tiny_llama(seed=0)
        result = fit(th.config(out, max_steps=steps, decay_steps=4, save_every=2, warmup_steps=0,
                               num_workers=num_workers), model, th.ArithmeticSequences(n=32), loss_fn=_noisy_loss)
        return result, model

    whole, whole_model = run(tmp_path / "whole", 4)
    run(tmp_path / "split", 2)
    split, split_model = run(tmp_path / "split", 4)
    assert split.losses == whole.losses[2:]
    for (name, a), b in zip(whole_model.state_dict().items(), split_model.state_dict().values()):
        assert torch.equal(a, b), name
