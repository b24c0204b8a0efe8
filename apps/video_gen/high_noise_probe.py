"""Can the model learn what the prompt implies at high noise? (issue 16's decisive experiment)

Trains the configured model only on moving-shapes clips at t ~ U[0.9, 1] (AdamW, batch 16, the
config's lr) and then reads: the predicted clean clip at t = 0.97 for "a red square moving <dir>"
(brightness-centroid column in the first and the last frame, and the spread of the mean
prediction; the data's own conditional mean has 11.9 -> 3.1 for left, 3.1 -> 11.9 for right,
spread 0.35), the direction gap at t = 0.9 / 0.95, and how much the velocity changes with the
direction word vs the colour word.

    python -m apps.video_gen.high_noise_probe 200 model.pooled_text=false      # steps, then overrides
    DIRS="left" python -m apps.video_gen.high_noise_probe 200                  # one direction only
    FREEZE_TEXT=1 python -m apps.video_gen.high_noise_probe 200                # text encoder frozen
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from .config import load_recipe, resolve
from .diagnose import high_noise_prediction
from .pipeline import VideoPipeline, make_meta
from .sensitivity import direction_gap
from .shapes import moving_shapes
from .text import build_tokenizer, tokenize


def main(argv: list[str] | None = None) -> None:
    from .train import build_model

    argv = sys.argv[1:] if argv is None else argv
    steps, overrides = int(argv[0]), argv[1:]
    torch.set_num_threads(1)
    cfg = load_recipe(resolve("apps/video_gen/configs/tiny.yaml"), overrides)
    if cfg.vae.from_dir:
        from phalanx.config import ConfigError
        raise ConfigError("config 'vae.from_dir': this probe trains in pixel space only; leave vae.from_dir unset")
    dirs = os.environ.get("DIRS", "left right up down").split()
    clips = [c for c in moving_shapes(1024, 8, 16, seed=0) if c.direction in dirs]
    tok = build_tokenizer([c.caption for c in clips] + ["a red circle"], cfg.data.max_prompt_tokens)
    torch.manual_seed(0)
    model, _ = build_model(cfg, [], tokenizer=tok)
    if os.environ.get("FREEZE_TEXT"):
        model.text_encoder.requires_grad_(False)
    video, ids = torch.stack([c.video for c in clips]), tokenize(tok, [c.caption for c in clips])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr, weight_decay=0.0)
    g, start = torch.Generator().manual_seed(0), time.time()
    for step in range(1, steps + 1):
        idx = torch.randint(len(clips), (16,), generator=g)
        loss = model(video[idx], ids[idx], t=0.9 + 0.1 * torch.rand(16, generator=g))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
    pred = high_noise_prediction(VideoPipeline(model, tok, make_meta(cfg.flow, 3, 8, 16, 16)))
    print(json.dumps({d: {"first_col": v["first_col_row"][0], "last_col": v["last_col_row"][0], "spread": v["spread"]}
                      for d, v in pred.items()}))
    print(json.dumps({k: round(v, 4) for k, v in direction_gap(model, tok, 8, 16, timesteps=(0.9, 0.95)).items()}))
    with torch.no_grad():
        x = torch.randn(8, 3, 8, 16, 16, generator=torch.Generator().manual_seed(1))
        t = torch.full((8,), 0.95)
        v = {p: model.velocity(x, t, model.encode_prompts(tokenize(tok, [p] * 8)))
             for p in ("a red square moving left", "a red square moving right", "a blue square moving left")}
        a, b, c = v.values()
    print(json.dumps({"velocity_change_direction_word": round(float((a - b).abs().mean()), 4),
                      "velocity_change_colour_word": round(float((a - c).abs().mean()), 4)}))


if __name__ == "__main__":
    main()
