"""A small recipe in the shape of the RLHF ones (policy + frozen reference, a held-out evaluation,
a metric summed over ranks), with one device bug switched on by --bug:

  batch_on_cpu       the evaluation batch is built on the host and never moved
  reference_on_cpu   the reference model is deep-copied and left on the host
  collective_on_cpu  the metric is all-reduced as a CPU tensor

On a CPU run every variant works (everything is on the CPU); on a GPU each one crashes. Under
PHALANX_EMULATE_GPU=1 each one must crash as on a GPU, naming the device (test_mutants.py).
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

from phalanx.device import run_device, to_device
from phalanx.launch import launched
from phalanx.testing import tiny_llama


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=("none", "batch_on_cpu", "reference_on_cpu", "collective_on_cpu"),
                        default="none")
    args = parser.parse_args(argv)
    with launched(seed=0) as ctx:
        device = run_device()
        policy = tiny_llama(seed=0).to(device)
        reference = copy.deepcopy(policy)
        if args.bug == "reference_on_cpu":
            reference = reference.cpu()
        reference.requires_grad_(False)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(ctx.rank)
        for _ in range(2):
            batch = to_device({"input_ids": torch.randint(0, 128, (2, 8), generator=g)}, device)
            logits = policy(**batch).logits
            with torch.no_grad():
                ref_logits = reference(**batch).logits
            loss = torch.nn.functional.mse_loss(logits, ref_logits) + logits.float().pow(2).mean() * 1e-3
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        held_out = {"input_ids": torch.randint(0, 128, (2, 8), generator=g)}
        if args.bug != "batch_on_cpu":
            held_out = to_device(held_out, device)
        with torch.no_grad():
            metric = policy(**held_out).logits.float().mean().reshape(1)
        if args.bug == "collective_on_cpu":
            metric = metric.cpu()
        if dist.is_initialized():
            dist.all_reduce(metric)
        if ctx.rank == 0:
            print(f"held-out metric {metric.item():.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
