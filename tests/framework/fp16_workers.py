"""What test_fp16_plugins.py runs on 2 spawned ranks: fp16 training with DDPPlugin, FSDPPlugin and
GeminiPlugin, and an fp16 overflow under each, in one spawn.

The runs reuse zero_workers' recipe (tiny Llama, two AdamW param groups, a LinearLR schedule, the
same global batches), so `zero_workers.reference("fp16")` — an fp16 model with fp32 masters and a
constant loss scale of 2^16 on one process — is the reference for every plugin.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import zero_workers as zw

PLUGINS = ("ddp", "fsdp", "gemini")
GEMINI_CHUNK_MB = 0.01  # ~5k fp16 elements: the tiny model spreads over several chunks


def make(name: str, precision: str = "fp16"):
    from phalanx.booster.plugins.ddp import DDPPlugin
    from phalanx.booster.plugins.fsdp import FSDPPlugin
    from phalanx.booster.plugins.gemini import GeminiPlugin

    if name == "ddp":
        return DDPPlugin(precision=precision)
    if name == "fsdp":
        return FSDPPlugin(precision=precision)
    if name == "gemini":
        return GeminiPlugin(precision=precision, placement_policy="static", chunk_size_mb=GEMINI_CHUNK_MB)
    raise ValueError(name)


def fp16_run(name: str) -> zw.Run:
    """A boosted run that starts from the reference's values. DDP and Gemini cast the whole model
    to fp16; FSDP2's MixedPrecisionPolicy casts only the parameters, so its fp32 masters and the
    RoPE buffers (inv_freq) would start unrounded: round them through fp16 as the others are.
    (Left unrounded, FSDP computes a slightly more accurate RoPE than the reference: measured
    grad-norm difference 1.1e-3 instead of 1.4e-4.)"""
    run = zw.Run(make(name))
    run.booster.plugin.load_full_model_state_dict(run.model, zw.initial_params("fp16"))
    with torch.no_grad():
        for buf in run.model.unwrapped.buffers():
            if buf.is_floating_point():
                buf.copy_(buf.half())
    return run


def _local_grads(name: str, run: zw.Run) -> list[torch.Tensor]:
    """This rank's reduced gradients as the plugin's optimizer will read them (after backward)."""
    opt = run.optimizer
    if name == "ddp":
        return [p.grad for p in opt.model_params if p.grad is not None]
    if name == "fsdp":
        return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in opt.params()
                if p.grad is not None]
    opt.manager.finish_backward()
    return [c.master_grad for c in opt.manager.chunks]


def _snapshot(run: zw.Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in run.booster.plugin.full_model_state_dict(run.model).items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def overflow(name: str) -> dict:
    """(1) A loss scale so large that every rank's fp16 gradients overflow; (2) a normal step;
    (3) an inf written into rank 0's reduced gradients only, after backward: every rank must skip
    and back off together."""
    run = fp16_run(name)
    opt = run.optimizer
    before = _snapshot(run)
    opt.scaler.scale = 2.0**40
    run.step(0)
    out = {"everywhere": {"skipped": run.skipped[-1], "scale": opt.scaler.scale, "norm": run.norms[-1],
                          "params_unchanged": _same(before, _snapshot(run))}}
    opt.scaler.scale = zw.FP16_SCALE
    run.step(1)
    out["next_step"] = {"skipped": run.skipped[-1], "params_changed": not _same(before, _snapshot(run)),
                        "scale": opt.scaler.scale}
    before = _snapshot(run)
    run.backward(2)
    grads = _local_grads(name, run)
    if dist.get_rank() == 0:
        grads[0].view(-1)[0] = float("inf")
    opt.step()
    opt.zero_grad()
    out["one_rank"] = {"skipped": opt.skipped, "scale": opt.scaler.scale,
                       "params_unchanged": _same(before, _snapshot(run))}
    return out


def suite() -> dict:
    out = {}
    for name in PLUGINS:
        run = fp16_run(name).train()
        out[name] = run.result()
        with torch.no_grad():
            out[name]["logits_dtype"] = str(run.model(input_ids=run.batches[0][:1]).logits.dtype)
        out[name]["scale"] = run.optimizer.scaler.scale
        out[name]["overflow"] = overflow(name)
    return out
