"""Does the direction word reach the model? Cheap probes behind the default run's motion figure (issue 39 item 3).

    python -m apps.video_gen.motion_probe words runs/video_tiny/pipeline          # a trained pipeline
    python -m apps.video_gen.motion_probe train 600                               # tiny.yaml, moving shapes only
    python -m apps.video_gen.motion_probe train 600 model.patch_size=[2,4,4] data.buckets=[[8,16,16,16]]

`words`: how different the text encoder's states are for the direction words (at the direction token) and the
colour words (at the colour token), relative to the state's norm, and how much the transformer's velocity
changes when the prompt's direction word, its colour word or the whole prompt (empty prompt) is swapped, relative
to the velocity's norm, at several t (fixed noise). A model that ignores the direction word shows a distinct
text state but no velocity change.

`train`: the config's model (tiny.yaml plus overrides) trained on moving-shapes clips only (no images or real
clips; the held-out triples of `shapes.HELD_OUT_COMBOS` left out), with the recipe's timestep sampler, AdamW at
train.lr with warm-up and linear decay, gradient clipping and an EMA (eval.ema_decay); every `--every` steps the
direction gap (sensitivity.py) of the EMA weights, at the end the motion check on held-out and trained triples.
Far cheaper than the recipe's run (no evaluation loss, no export), for trying a change before a full run.
`LR_XATTN=<x>` multiplies the learning rate of the cross-attention weights.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch

from phalanx.device import current_device

from .motion import motion_check
from .sensitivity import OPPOSITE, direction_gap
from .shapes import HELD_OUT_COMBOS, moving_shapes
from .text import build_tokenizer, tokenize

PROMPT = ("red", "square", "left")


@torch.no_grad()
def word_sensitivity(model, tokenizer, frames: int, size: int, timesteps=(0.5, 0.8, 0.95), clips: int = 8,
                     seed: int = 0) -> dict[str, float]:
    """Text-state and velocity changes for "a red square moving left" when one word changes (see the module doc)."""
    colour, shape, direction = PROMPT
    prompts = [f"a {colour} {shape} moving {direction}", f"a {colour} {shape} moving {OPPOSITE[direction]}",
               f"a blue {shape} moving {direction}", ""]
    ids = tokenize(tokenizer, prompts).to(model.device)
    words = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    at_dir, at_colour = words.index(direction), words.index(colour)
    mask = (ids != model.pad_token_id).long()
    raw = model.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    out = {"text_state_change/direction": float((raw[0, at_dir] - raw[1, at_dir]).norm() / raw[0, at_dir].norm()),
           "text_state_change/colour": float((raw[0, at_colour] - raw[2, at_colour]).norm() / raw[0, at_colour].norm())}
    text = model.encode_prompts(ids)
    x = torch.randn(clips, model.transformer.config.out_channels, frames, size, size,
                    generator=torch.Generator().manual_seed(seed)).to(model.device)
    for t in timesteps:
        tt = torch.full((clips,), float(t), device=model.device)
        v = [model.velocity(x, tt, text[k:k + 1].expand(clips, -1, -1)).float() for k in range(len(prompts))]
        norm = v[0].norm()
        for k, name in ((1, "direction"), (2, "colour"), (3, "prompt")):
            out[f"velocity_change/{name}/t={t}"] = float((v[0] - v[k]).norm() / norm)
    return out


def train_probe(cfg, steps: int, batch: int = 16, every: int = 100, motion_samples: int = 32,
                clips: int = 1024, log=print) -> dict:
    """{"gaps": [(step, {direction_gap...})], "motion": {...}, "seconds": s}: see the module doc."""
    from .train import build_model

    frames, size = cfg.data.shapes_frames, cfg.data.shapes_size
    data = moving_shapes(clips, frames, size, seed=cfg.data.shapes_seed, exclude=HELD_OUT_COMBOS)
    captions = [c.caption for c in data]
    tokenizer = build_tokenizer(captions + ["a red circle"], cfg.data.max_prompt_tokens)
    torch.manual_seed(0)
    model, _ = build_model(cfg, [], tokenizer=tokenizer)
    model.to(current_device())                              # the accelerator when there is one
    video, ids = torch.stack([c.video for c in data]).to(model.device), tokenize(tokenizer, captions).to(model.device)
    scale = float(os.environ.get("LR_XATTN", "1"))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if "attn2" not in n]},
              {"params": [p for n, p in named if "attn2" in n], "lr": cfg.train.lr * scale}]
    opt = torch.optim.AdamW(groups, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup, floor = max(cfg.train.warmup_steps, 1), cfg.train.min_lr_ratio
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * max(floor, 1 - s / steps))
    ema, decay = copy.deepcopy(model).eval(), cfg.eval.ema_decay or 0.995
    g, start, gaps = torch.Generator().manual_seed(0), time.time(), []
    for step in range(1, steps + 1):
        idx = torch.randint(len(data), (batch,), generator=g).to(video.device)
        loss = model(video[idx], ids[idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        opt.step()
        sched.step()
        with torch.no_grad():
            for averaged, p in zip(ema.parameters(), model.parameters()):
                averaged.lerp_(p, 1 - decay)
        if step % every == 0 or step == steps:
            gap = direction_gap(ema, tokenizer, frames, size, timesteps=(0.8, 0.95))
            gaps.append((step, gap))
            log(f"step {step} loss {loss.item():.4f} " + " ".join(f"{k} {v:.4f}" for k, v in gap.items())
                + f" ({time.time() - start:.0f} s)")
    motion = motion_check(ema, tokenizer, motion_samples, frames, size, cfg.eval.sample_steps,
                          cfg.eval.guidance_scale, sampler=cfg.eval.sampler, splits=("held_out", "trained")) \
        if motion_samples else {}
    return {"gaps": gaps, "motion": motion, "words": word_sensitivity(ema, tokenizer, frames, size),
            "trained_captions": sorted(set(captions)), "seconds": time.time() - start}


def main(argv: list[str] | None = None) -> dict:
    from .config import load_recipe, resolve
    from .pipeline import VideoPipeline

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("words", "train"):
        raise SystemExit("usage: python -m apps.video_gen.motion_probe words <pipeline> | train <steps> [key=value ...]")
    if argv[0] == "words":
        pipe = VideoPipeline.from_pretrained(argv[1]).to(current_device())
        m = pipe.meta
        result = word_sensitivity(pipe.model, pipe.tokenizer, m["frames"], m["height"])
    else:
        cfg = load_recipe(resolve("apps/video_gen/configs/tiny.yaml"), argv[2:])
        if cfg.vae.from_dir:
            from phalanx.config import ConfigError
            raise ConfigError("config 'vae.from_dir': this probe trains in pixel space only; leave vae.from_dir unset")
        out = train_probe(cfg, int(argv[1]), motion_samples=int(os.environ.get("MOTION", "32")))
        result = {"gaps": out["gaps"], "motion": out["motion"], "words": out["words"], "seconds": out["seconds"]}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
