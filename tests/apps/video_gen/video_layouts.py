"""The video model trained through `fit` in one parallel layout, and the same steps by hand on one
process: what test_video_dp_sp.py and test_video_fsdp_gemini.py compare (importable by spawned ranks).

The batches carry their own timesteps and noise, so every layout computes the same losses; the
reference takes fit's sampler order (the seeded permutation, `dp` whole batches per step)."""
from __future__ import annotations

import functools
import traceback

import torch

from video_tiny import tiny_config

CAPTIONS = ["a red square moving left", "a blue circle moving up", "a green square", "a yellow circle"]
STEPS = 2


def batches(tokenizer, n: int = 8) -> list[dict[str, torch.Tensor]]:
    """`n` whole batches of two shapes (buckets: 4 frames and single images of 8 x 8), each with its t and noise."""
    from apps.video_gen.text import tokenize

    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        b, frames = [(2, 4), (4, 1)][k % 2]
        shape = (b, 3, frames, 8, 8)
        out.append({"video": torch.rand(shape, generator=g) * 2 - 1,
                    "prompt_ids": tokenize(tokenizer, [CAPTIONS[(k + i) % 4] for i in range(b)]),
                    "t": torch.rand(b, generator=g), "noise": torch.randn(shape, generator=g)})
    return out


def build(output_dir, *overrides: str):
    """(cfg, model, tokenizer): the tiny model, patch 1x2x2 (16 / 64 tokens per clip), 2 heads."""
    from apps.video_gen.train import build_model

    cfg = tiny_config(output_dir, "model.patch_size=[1,2,2]", "data.caption_dropout=0.0", f"train.max_steps={STEPS}",
                      "train.lr=1e-2", "model.gradient_checkpointing=true", *overrides)
    torch.manual_seed(0)
    model, tokenizer = build_model(cfg, CAPTIONS)
    return cfg, model, tokenizer


@functools.cache
def reference(output_dir, dp: int, *overrides: str) -> dict:
    """fit's optimizer, schedule and clipping by hand on one process: step k averages the losses of
    the `dp` batches fit deals to the data replicas (its sampler's permutation, items k dp ... k dp + dp - 1).
    Returns the start and final weights, the step losses and the names whose gradient is rounding only."""
    from phalanx.train import build_lr_scheduler, build_optimizer

    cfg, model, tokenizer = build(output_dir, *overrides)
    data = batches(tokenizer)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(model, cfg.train)
    sched = build_lr_scheduler(opt, cfg.train)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.train.seed)).tolist()
    losses, dead = [], []
    for step in range(cfg.train.max_steps):
        loss = sum(model(**data[i]) for i in order[dp * step:dp * step + dp]) / dp
        loss.backward()
        if step == 0:
            # A key projection's bias has no effect under softmax: its gradient is rounding only, which AdamW
            # turns into a full-size step. Those weights are left out of the comparison.
            scale = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
            dead = [n for n, p in model.named_parameters() if p.grad is not None
                    and p.grad.abs().max().item() <= 1e-6 * scale]
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"start": start, "final": final, "losses": losses, "dead": dead,
            "tokens": max(model.tokens(tuple(b["video"].shape)) * len(b["video"]) for b in data)}


def fit_layout(output_dir: str, plugin: str, sp: int, *overrides: str) -> dict:
    """One rank of `fit` with `train.plugin=plugin` and `parallel.sp_size=sp`: the step losses, the
    final weights (rank 0, read back from the final checkpoint), the tokens each block forward saw and a
    random number drawn per step (ranks of an SP group must draw alike, replicas differently)."""
    import torch.distributed as dist

    from phalanx.checkpoint.hf import load_hf_state_dict
    from phalanx.data.buckets import unwrap_single

    from apps.video_gen.sequence_parallel import sequence_layout
    from apps.video_gen.sequence_replicas import fit_data_sequence

    cfg, model, tokenizer = build(output_dir, f"train.plugin={plugin}", f"parallel.sp_size={sp}", *overrides)
    if sp > 1:
        model.sp_group = sequence_layout(sp).group
    seen, draws = [], []
    model.transformer.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))

    def loss_fn(m, b):
        draws.append(torch.rand(()).item())
        return m(**b)

    result = fit_data_sequence(cfg.train, sp, model, batches(tokenizer), collate_fn=unwrap_single, loss_fn=loss_fn)
    state = load_hf_state_dict(result.checkpoint_dir / "model") if dist.get_rank() == 0 else None
    return {"losses": result.losses, "state": state, "seen": seen, "draws": draws}


def fit_layouts(output_dir: str, layouts: list[tuple]) -> dict:
    """Several layouts in one spawn, each in its own output folder; a layout that raises gives its
    traceback (its test fails with it) and the next one still runs."""
    out = {}
    for plugin, sp, *overrides in layouts:
        key = f"{plugin}-sp{sp}"
        try:
            out[key] = fit_layout(f"{output_dir}/{key}", plugin, sp, *overrides)
        except Exception:  # noqa: BLE001 - handed to the test that reads this layout
            out[key] = {"error": traceback.format_exc()}
    return out


def recipe_outcome(output_dir: str, *overrides: str) -> dict:
    """The whole recipe (`apps.video_gen.train`) on tiny_config with these overrides: its final step
    and last evaluation, or the traceback (handed to the test that reads it)."""
    from apps.video_gen.train import train

    try:
        result = train(tiny_config(output_dir, *overrides))
        return {"final_step": result.final_step, "last_eval": result.last_eval}
    except Exception:  # noqa: BLE001 - handed to the test
        return {"error": traceback.format_exc()}
