"""The motion check: does a sampled clip show the prompted colour moving the prompted way?

Centroid tracking: pixels that are bright and saturated enough are the object; its colour is the
palette colour nearest to their mean; its direction is the larger component of the centroid's
displacement between the first and the last quarter of the frames (it must exceed `min_travel`
pixels). A clip passes when both match the prompt.

Two prompt sets (issue 39): "trained", the colour x shape x direction triples the training data holds,
and "held_out", the triples of `shapes.HELD_OUT_COMBOS` that `data.held_out_combos` keeps out of the
training clips, so a pass there means the model composed words it only saw in other combinations.
Each fraction comes with a 95% Wilson interval (64 clips: about +-11 points at 80%).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .shapes import COLOURS, DIRECTIONS, HELD_OUT_COMBOS, SHAPES, caption_for


def object_mask(video: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """[F, H, W] bool: pixels whose brightest channel is above `threshold` (background is -1)."""
    return video.max(dim=0).values > threshold


def track(video: torch.Tensor, threshold: float = 0.0) -> tuple[str | None, str | None, float]:
    """(colour, direction, travel in pixels) of the object in a clip [3, F, H, W] in [-1, 1]."""
    mask = object_mask(video, threshold)
    if mask.sum() == 0:
        return None, None, 0.0
    pixels = video.permute(1, 2, 3, 0)[mask]                      # [N, 3]
    mean = pixels.mean(0)
    colour = min(COLOURS, key=lambda c: float((torch.tensor(COLOURS[c]) - mean).pow(2).sum()))
    frames = video.shape[1]
    yy, xx = torch.meshgrid(torch.arange(video.shape[2], dtype=torch.float32),
                            torch.arange(video.shape[3], dtype=torch.float32), indexing="ij")
    cents = []
    for f in range(frames):
        m = mask[f].float()
        cents.append(torch.stack([(m * yy).sum(), (m * xx).sum()]) / m.sum() if m.sum() > 0 else None)
    q = max(1, frames // 4)
    first = [c for c in cents[:q] if c is not None]
    last = [c for c in cents[-q:] if c is not None]
    if not first or not last:
        return colour, None, 0.0
    dy, dx = (torch.stack(last).mean(0) - torch.stack(first).mean(0)).tolist()
    if abs(dx) >= abs(dy):
        return colour, ("right" if dx > 0 else "left"), abs(dx)
    return colour, ("down" if dy > 0 else "up"), abs(dy)


def motion_score(videos: list[torch.Tensor], colours: list[str], directions: list[str],
                 min_travel: float = 1.0) -> dict[str, float]:
    """Fractions of clips with the right colour, the right direction, and both."""
    n = len(videos)
    ok_colour = ok_dir = ok_both = 0
    for v, c, d in zip(videos, colours, directions):
        got_c, got_d, travel = track(v)
        cm = got_c == c
        dm = got_d == d and travel >= min_travel
        ok_colour += cm
        ok_dir += dm
        ok_both += cm and dm
    return {"motion_colour": ok_colour / n, "motion_direction": ok_dir / n, "motion_both": ok_both / n,
            "motion_clips": float(n)}


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial fraction (stays inside [0, 1] at 0% and 100%)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def combos_for(split: str, held_out: tuple = HELD_OUT_COMBOS) -> list[tuple[str, str, str]]:
    """(colour, shape, direction) triples of a prompt set: "all", "held_out" or "trained" (all but held_out)."""
    every = [(c, s, d) for c in COLOURS for d in DIRECTIONS for s in SHAPES]
    if split == "all":
        return every
    if split == "held_out":
        return [x for x in every if x in held_out]
    if split == "trained":
        return [x for x in every if x not in held_out]
    raise ValueError(f"motion prompt split {split!r}: use 'all', 'held_out' or 'trained'")


def motion_prompts(count: int, seed: int = 0, split: str = "all") -> list[tuple[str, str, str]]:
    """(prompt, colour, direction), cycling over the split's colour x direction x shape triples in a seeded order."""
    combos = combos_for(split)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(combos), generator=g).tolist()
    out = []
    for k in range(count):
        c, s, d = combos[order[k % len(combos)]]
        out.append((caption_for(c, s, d), c, d))
    return out


@torch.no_grad()
def motion_check(model, tokenizer, count: int, frames: int, size: int, steps: int, guidance: float, seed: int = 0,
                 sampler: str = "linear", vae=None, splits: tuple[str, ...] = ("all",),
                 out_dir: Path | None = None) -> dict[str, float]:
    """Sample `count` clips per prompt split (decoded through `vae` for a latent model), track their objects.
    Keys: "motion_<metric>" for the first split, "motion_<split>_<metric>" for every split, with
    "_lo" / "_hi" the 95% Wilson interval of `both`. A GIF of the first split's first 8 clips goes to out_dir."""
    from phalanx.diffusion import save_gif

    from .pipeline import sample_clips
    from .text import tokenize

    out: dict[str, float] = {}
    for k, split in enumerate(splits):
        prompts = motion_prompts(count, seed=seed, split=split)
        videos = []
        for start in range(0, len(prompts), 16):
            chunk = prompts[start:start + 16]
            ids = tokenize(tokenizer, [p for p, _, _ in chunk])
            videos += list(sample_clips(model, ids, frames, size, size, steps, guidance,
                                        torch.Generator().manual_seed(seed + start), vae, sampler).cpu())
        score = motion_score(videos, [c for _, c, _ in prompts], [d for _, _, d in prompts])
        lo, hi = wilson_interval(round(score["motion_both"] * count), count)
        score.update(motion_both_lo=lo, motion_both_hi=hi)
        out.update({k_.replace("motion_", f"motion_{split}_"): v for k_, v in score.items()})
        if k == 0:
            out.update(score)
            if out_dir is not None and len(videos) >= 4:
                rows = [torch.cat(videos[r * 4:(r + 1) * 4], dim=3) for r in range(min(2, len(videos) // 4))]
                save_gif(torch.cat(rows, dim=2), out_dir / "motion_samples.gif", fps=4, scale=6)
                (out_dir / "motion_prompts.txt").write_text("\n".join(p for p, _, _ in prompts[:8]) + "\n")
    return out
