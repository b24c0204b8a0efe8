"""Shared pieces of the training-loop tests: a learnable toy dataset, configs, and per-rank
routines that `phalanx.testing.spawn` can import in fresh processes (so they live at module level).

Run as a script it is the "killed in the middle of a save" victim:
    python train_helpers.py kill-during-save OUTPUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

from phalanx.testing import tiny_llama

VOCAB, SEQ = 128, 16


class ArithmeticSequences(Dataset):
    """Sequences start, start+d, start+2d, ... (mod vocab) with d in {1, 2, 3}: after two tokens the
    rest is predictable, so a tiny model's loss falls fast. With `pad=True` each sample ends in a
    random amount of padding (labels -100, attention_mask 0), so micro-batches hold different
    numbers of target tokens."""

    def __init__(self, n: int = 64, seq_len: int = SEQ, vocab: int = VOCAB, seed: int = 0, pad: bool = False):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.input_ids = (start + stride * torch.arange(seq_len)) % vocab
        self.labels = self.input_ids.clone()
        self.attention_mask = torch.ones_like(self.input_ids)
        if pad:
            lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
            for i, length in enumerate(lengths.tolist()):
                self.labels[i, length:] = -100
                self.attention_mask[i, length:] = 0
                self.input_ids[i, length:] = 0
        self.pad = pad

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = {"input_ids": self.input_ids[i], "labels": self.labels[i]}
        if self.pad:
            sample["attention_mask"] = self.attention_mask[i]
        return sample


def config(output_dir, **overrides):
    """A fast TrainConfig for tests: no progress bar, no plot, no GEMM measurement."""
    from phalanx.train import TrainConfig

    kwargs = dict(output_dir=str(output_dir), max_steps=10, micro_batch_size=4, grad_accum_steps=1, lr=1e-2,
                  warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.01, max_grad_norm=1.0, plugin="ddp",
                  precision="fp32", save_every=0, keep_last=0, log_every=1, resume=True, seed=7,
                  progress_bar=False, plot=False, peak_tflops=0)
    kwargs.update(overrides)
    return TrainConfig(**kwargs)


def train(output_dir, dataset_kwargs=None, model_seed: int = 0, **overrides):
    """fit() on a fresh tiny Llama; returns (result, model)."""
    from phalanx.train import fit

    model = tiny_llama(seed=model_seed)
    result = fit(config(output_dir, **overrides), model, ArithmeticSequences(**(dataset_kwargs or {})))
    return result, model


# ---- per-rank routines for spawn -------------------------------------------------------------

def rank_first_session(root: str, steps: int, plugins: tuple[str, ...]):
    """Everything the 2-rank tests need from one set of processes (starting ranks is the slow
    part): an uninterrupted run of `steps`; a run stopped at steps // 2 with the same LR schedule
    (decay_steps=steps) that leaves a checkpoint for the restart; and a short run per plugin."""
    straight, _ = train(Path(root) / "straight", max_steps=steps, micro_batch_size=2, save_every=steps // 2)
    half, _ = train(Path(root) / "half", max_steps=steps // 2, decay_steps=steps, micro_batch_size=2)
    return {"straight": straight.losses, "half": half.losses, "half_ckpt": str(half.checkpoint_dir),
            "straight_ckpt": str(straight.checkpoint_dir),
            "plugins": rank_each_plugin(str(Path(root) / "plugins"), plugins)}


def rank_resume(half_dir: str, steps: int = 10):
    """A fresh process continuing the half run to `steps`."""
    resumed, _ = train(half_dir, max_steps=steps, micro_batch_size=2)
    return {"losses": resumed.losses, "start_step": resumed.start_step, "ckpt": str(resumed.checkpoint_dir)}


def rank_each_plugin(output_root: str, plugins: tuple[str, ...], steps: int = 4):
    """The same short run through every plugin, with a held-out eval at the end (for FSDP this
    calls the user's model while its root parameters are sharded)."""
    from phalanx.train import causal_lm_eval, fit

    out = {}
    for name in plugins:
        model = tiny_llama(seed=0)
        cfg = config(Path(output_root) / name, max_steps=steps, micro_batch_size=2, grad_accum_steps=2,
                     plugin=name, save_every=2)
        result = fit(cfg, model, ArithmeticSequences(pad=True),
                     eval_fn=causal_lm_eval(ArithmeticSequences(n=8, seed=3), batch_size=4))
        out[name] = {"losses": result.losses, "eval": result.last_eval["loss"], "ckpt": str(result.checkpoint_dir)}
    return out


def rank_async_spread(output_root: str, plugins: tuple[str, ...], steps: int = 4):
    """Per plugin, the same run saved synchronously and asynchronously; records what each rank's
    spread copy of the model held (`phalanx.checkpoint.hf.spread_model_copy`)."""
    import phalanx.checkpoint.writer as writer
    from phalanx.train import fit

    real = writer.spread_model_copy
    held: list[dict] = []

    def recording(model, pairs, rank, world):
        biggest = [0]

        def measured():
            for name, tensor in pairs:
                biggest[0] = max(biggest[0], tensor.numel() * tensor.element_size())
                yield name, tensor
        spread = real(model, measured(), rank, world)
        held.append({"kept": sum(t.numel() * t.element_size() for t in spread.tensors.values()),
                     "total": spread.total_bytes, "biggest": biggest[0], "files": sorted(set(spread.files.values()))})
        return spread

    writer.spread_model_copy = recording
    out = {}
    try:
        for name in plugins:
            runs = {}
            for mode in ("sync", "async"):
                held.clear()
                cfg = config(Path(output_root) / name / mode, max_steps=steps, micro_batch_size=2, plugin=name,
                             save_every=2, async_save=mode == "async")
                result = fit(cfg, tiny_llama(seed=0), ArithmeticSequences())
                runs[mode] = {"losses": result.losses, "root": str(Path(output_root) / name / mode),
                              "held": list(held)}
            out[name] = runs
    finally:
        writer.spread_model_copy = real
    return out


HYBRID_LAYOUTS = {  # name: (plugin options, padded data?)
    "tp2": (dict(tp_size=2), True),
    "pp2": (dict(pp_size=2, num_microbatches=2, pp_schedule="1f1b"), True),
    "dp2-zero1": (dict(zero_stage=1), True),
    # Ulysses refuses a padding attention_mask (it would have to be split with the sequence)
    "sp2-ulysses": (dict(sp_size=2, sequence_parallelism="ulysses"), False),
}


def rank_hybrid_layouts(output_root: str, layouts: dict, steps: int = 4):
    """fit through HybridParallelPlugin layouts on 2 ranks, and DDP on the same global batch of 8
    (padded data has uneven target tokens, so the weighting across ranks and microbatches matters),
    with a held-out eval of 10 samples in batches of 3 (uneven: 3, 3, 3, 1 rows, none a multiple of
    the pipeline's 2 microbatches) at steps 2 and 4."""
    from phalanx.train import causal_lm_eval, fit

    out = {}
    runs = {"ddp-padded": (None, True), "ddp-packed": (None, False), **layouts}
    for name, (options, pad) in runs.items():
        dp = 2 if options is None or name.startswith("dp2") else 1
        overrides = dict(plugin="ddp") if options is None else dict(plugin="hybrid", plugin_options=options)
        cfg = config(Path(output_root) / name, max_steps=steps, micro_batch_size=8 // dp, save_every=steps,
                     eval_every=2, **overrides)
        result = fit(cfg, tiny_llama(seed=0), ArithmeticSequences(pad=pad),
                     eval_fn=causal_lm_eval(ArithmeticSequences(n=10, seed=3, pad=pad), batch_size=3))
        records = list(map(json.loads, Path(result.metrics_path).read_text().splitlines()))
        norms = [r["grad_norm"] for r in records if r.get("grad_norm") is not None]
        evals = [r["eval/loss"] for r in records if "eval/loss" in r]
        out[name] = {"losses": result.losses, "grad_norms": norms, "ckpt": str(result.checkpoint_dir), "padded": pad,
                     "evals": evals}
    return out


# ---- the victim of the interrupted-save test ---------------------------------------------------

def kill_during_save(output_dir: str) -> None:
    """Train with a checkpoint every step and die (no cleanup, like SIGKILL) while the second
    checkpoint's files are being written."""
    from phalanx.checkpoint.writer import CheckpointWriter

    real_write_files = CheckpointWriter._write_files
    calls = []

    def dying_write_files(self, snapshot):
        calls.append(snapshot.tmp)
        if len(calls) == 2:
            (snapshot.tmp / "partial.bin").write_bytes(b"half-written")
            os._exit(17)
        return real_write_files(self, snapshot)

    CheckpointWriter._write_files = dying_write_files
    train(output_dir, max_steps=4, save_every=1, keep_last=0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "kill-during-save":
        kill_during_save(sys.argv[2])
        sys.exit(0)
    sys.exit(f"usage: {sys.argv[0]} kill-during-save OUTPUT_DIR")
