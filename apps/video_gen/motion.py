"""The motion check: does a sampled clip show the prompted colour moving the prompted way?

Centroid tracking: pixels that are bright and saturated enough are the object; its colour is the
palette colour nearest to their mean; its direction is the larger component of the centroid's
displacement between the first and the last quarter of the frames (it must exceed `min_travel`
pixels). A clip passes when both match the prompt.
"""
from __future__ import annotations

import torch

from .shapes import COLOURS, DIRECTIONS


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


def motion_prompts(count: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(prompt, colour, direction), cycling over every colour x direction x shape."""
    from .shapes import SHAPES, caption_for

    combos = [(c, s, d) for c in COLOURS for d in DIRECTIONS for s in SHAPES]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(combos), generator=g).tolist()
    out = []
    for k in range(count):
        c, s, d = combos[order[k % len(combos)]]
        out.append((caption_for(c, s, d), c, d))
    return out


