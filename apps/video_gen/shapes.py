"""The generated "moving shapes" set: one coloured shape on black moving in a named direction.

Deterministic by seed; the caption comes from the generator ("a red square moving left"), so the
motion check (`motion.py`) can score samples against it. Images are single frames ("a red circle").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

COLOURS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0),
           "yellow": (1.0, 1.0, -1.0)}
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (dy, dx)
SHAPES = ("square", "circle")
# (colour, shape, direction) triples never generated for training with `data.held_out_combos` (issue 39): the
# motion check samples them to test whether the model composes words it saw only in other combinations. Each
# colour twice, each shape four times, each direction twice (once per shape); every colour x direction and
# colour x shape pair still occurs in training with the other shape / other directions.
HELD_OUT_COMBOS = tuple((c, s, d) for i, c in enumerate(COLOURS) for k, s in enumerate(SHAPES)
                        for d in [list(DIRECTIONS)[(i + k) % len(DIRECTIONS)]])


@dataclass(frozen=True)
class ShapeClip:
    video: torch.Tensor          # [3, frames, size, size] in [-1, 1]
    caption: str
    colour: str
    direction: str | None        # None for a still image
    shape: str


def caption_for(colour: str, shape: str, direction: str | None) -> str:
    return f"a {colour} {shape}" + (f" moving {direction}" if direction else "")


def draw(colour: str, shape: str, direction: str | None, frames: int, size: int, y0: float, x0: float,
         radius: float, speed: float) -> torch.Tensor:
    dy, dx = DIRECTIONS[direction] if direction else (0, 0)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    rgb = torch.tensor(COLOURS[colour]).view(3, 1, 1)
    video = torch.full((3, frames, size, size), -1.0)
    for f in range(frames):
        cy, cx = y0 + dy * speed * f, x0 + dx * speed * f
        if shape == "square":
            mask = ((yy - cy).abs() <= radius) & ((xx - cx).abs() <= radius)
        else:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= (radius + 0.5) ** 2
        video[:, f] = torch.where(mask, rgb, video[:, f])
    return video


def make_shape_clip(g: torch.Generator, frames: int, size: int, moving: bool = True,
                    exclude: tuple[tuple[str, str, str], ...] = ()) -> ShapeClip:
    """One clip; a (colour, shape, direction) in `exclude` is drawn again (still images are never excluded)."""
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    while True:
        colour, shape = pick(list(COLOURS)), pick(SHAPES)
        direction = pick(list(DIRECTIONS)) if moving else None
        if (colour, shape, direction) not in exclude:
            break
    radius = size / 8 + float(torch.rand(1, generator=g)) * size / 16          # half-side ~2-3 px at 16 px
    speed = (size / 1.8) / max(frames - 1, 1)                                  # crosses ~55% of the frame
    travel = speed * (frames - 1) if moving else 0.0
    lo, hi = radius, size - 1 - radius
    dy, dx = DIRECTIONS[direction] if direction else (0, 0)

    def start(d: int) -> float:  # leave room for the whole path inside the frame
        a, b = (lo + travel, hi) if d < 0 else (lo, hi - travel) if d > 0 else (lo, hi)
        return a + float(torch.rand(1, generator=g)) * max(b - a, 0.0)

    video = draw(colour, shape, direction, frames if moving else 1, size, start(dy), start(dx), radius, speed)
    return ShapeClip(video, caption_for(colour, shape, direction), colour, direction, shape)


def moving_shapes(count: int, frames: int, size: int, seed: int = 0, moving: bool = True,
                  exclude: tuple[tuple[str, str, str], ...] = ()) -> list[ShapeClip]:
    """`count` clips, deterministic by `seed`; none of the (colour, shape, direction) triples in `exclude`."""
    g = torch.Generator().manual_seed(seed)
    return [make_shape_clip(g, frames, size, moving, exclude) for _ in range(count)]
