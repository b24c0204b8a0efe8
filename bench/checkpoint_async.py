"""How much checkpoint time asynchronous saving hides from training, measured in one run.

One process trains the same LLaMA with `phalanx.train.fit` twice, with a checkpoint every
`--save-every` steps: synchronous, then `async_save=True`. Measured directly on the training
thread: the time spent in `CheckpointWriter.save` and `.wait` (snapshot, waiting for the previous
save, and for a synchronous save the write itself), per checkpoint. "Hidden" is the share of the
synchronous cost that async saving takes off the training thread (wall-clock differences between
whole runs drown in noise on a shared machine; this does not). The peer, measured in the same run
on the same model and AdamW state: torch.distributed.checkpoint's `async_save` (stage to host
memory, write in a background thread), timed the same way (the call plus waiting for the
previous save before the next one, and for the last one at the end).

    python bench/checkpoint_async.py                 # ~4M parameters (50 MB checkpoints), a few minutes on 2 busy cores
    python bench/checkpoint_async.py --layers 8 --hidden 768 --vocab 32000 --steps 24

Prints a table and one `BENCH_JSON {...}` line. Timings on a shared machine vary: the load
average is printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i]}


def model(args):
    from phalanx.testing import tiny_llama

    torch.manual_seed(0)
    return tiny_llama(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8)


def run_fit(args, root: Path, name: str, async_save: bool) -> tuple[float, int]:
    """Train; return (seconds the training thread spent in checkpoint saves and waits, saves)."""
    from phalanx.checkpoint.writer import CheckpointWriter
    from phalanx.train import TrainConfig, fit

    spent = [0.0, 0]
    real_save, real_wait = CheckpointWriter.save, CheckpointWriter.wait

    def timed(method, count):
        def wrapper(self, *a, **kw):
            start = time.perf_counter()
            try:
                return method(self, *a, **kw)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += count
        return wrapper

    CheckpointWriter.save, CheckpointWriter.wait = timed(real_save, 1), timed(real_wait, 0)
    try:
        cfg = TrainConfig(output_dir=str(root / name), max_steps=args.steps, micro_batch_size=args.batch, lr=1e-4,
                          save_every=args.save_every, keep_last=1, async_save=async_save, progress_bar=False,
                          plot=False, peak_tflops=0, precision="fp32", log_every=args.steps)
        start = time.perf_counter()
        fit(cfg, model(args), RandomTokens(args.steps * args.batch, args.seq, args.vocab))
        print(f"  {name}: {time.perf_counter() - start:.2f} s, {spent[0]:.2f} s in saves", flush=True)
    finally:
        CheckpointWriter.save, CheckpointWriter.wait = real_save, real_wait
    return spent[0], spent[1]


def dcp_blocking_per_save(args, root: Path, saves: int) -> float:
    """The peer: the training thread's time in `dcp.async_save` plus waiting for the previous one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = model(args)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    batch = RandomTokens(args.batch, args.seq, args.vocab).data
    m(input_ids=batch, labels=batch).loss.backward()
    opt.step()  # AdamW state exists, as in a real checkpoint
    blocked, future = 0.0, None
    for i in range(saves):
        msd, osd = get_state_dict(m, opt)
        start = time.perf_counter()
        if future is not None:
            future.result()
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-{i}"))
        blocked += time.perf_counter() - start
        m(input_ids=batch, labels=batch).loss.backward()  # training goes on meanwhile
        opt.step()
        opt.zero_grad()
    start = time.perf_counter()
    future.result()
    blocked += time.perf_counter() - start
    return blocked / saves


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--save-every", type=int, default=3)
    args = parser.parse_args(argv)

    from phalanx.launch import launch, shutdown

    launch(seed=0)
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-ckpt-") as tmp:
        root = Path(tmp)
        sync, saves = run_fit(args, root, "sync", False)
        asyn, _ = run_fit(args, root, "async", True)
        peer = dcp_blocking_per_save(args, root, saves)
        size = sum(f.stat().st_size for f in (root / "sync" / "checkpoints").rglob("*") if f.is_file())
    shutdown()
    sync_cost, async_cost = sync / saves, asyn / saves
    hidden = 1 - async_cost / sync_cost
    params = sum(p.numel() for p in model(args).parameters())
    load = os.getloadavg()[0]
    cpu = platform.processor() or platform.machine()
    print(f"model {params / 1e6:.1f}M parameters, checkpoint {size / 2**20:.0f} MiB, {args.steps} steps, {saves} saves; "
          f"load average {load:.2f}; CPU {torch.backends.cpu.get_cpu_capability()} {cpu}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'training-thread time per checkpoint':<40}{'s':>8}")
    print(f"{'phalanx, synchronous':<40}{sync_cost:>8.3f}")
    print(f"{'phalanx, async_save=True':<40}{async_cost:>8.3f}")
    print(f"{'peer: torch DCP async_save':<40}{peer:>8.3f}")
    print(f"hidden by async saving: {hidden:.0%} of the synchronous cost; "
          f"phalanx async vs DCP async_save: {async_cost / peer:.2f}x the blocking time")
    print("BENCH_JSON " + json.dumps({"bench": "checkpoint_async", "params": params, "checkpoint_bytes": size,
                                      "steps": args.steps, "saves": saves, "sync_blocking_per_save_s": sync_cost,
                                      "async_blocking_per_save_s": async_cost, "hidden_fraction": hidden,
                                      "dcp_async_blocking_per_save_s": peer, "ratio_vs_dcp": async_cost / peer,
                                      "loadavg": load}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
