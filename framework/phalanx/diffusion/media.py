"""Validation media: image grids (PNG), and videos as MP4 (through imageio's ffmpeg / PyAV) and GIF."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def image_grid(images: list, captions: list[str] | None = None, columns: int | None = None):
    """PIL images (equal size) in a grid, each with its caption underneath when given."""
    from PIL import Image, ImageDraw

    columns = columns or min(len(images), 4)
    rows = (len(images) + columns - 1) // columns
    w, h = images[0].size
    label = 14 if captions else 0
    grid = Image.new("RGB", (columns * w, rows * (h + label)), "white")
    draw = ImageDraw.Draw(grid)
    for i, im in enumerate(images):
        x, y = (i % columns) * w, (i // columns) * (h + label)
        grid.paste(im, (x, y))
        if captions:
            draw.text((x + 2, y + h + 1), captions[i][: w // 6], fill="black")
    return grid


def save_grid(images: list, captions: list[str] | None, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, captions).save(path)
    return path


def video_to_uint8(video: torch.Tensor | np.ndarray) -> np.ndarray:
    """A clip [C, F, H, W] in [-1, 1] (torch) or [F, H, W, C] uint8 (numpy) -> [F, H, W, C] uint8."""
    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8 or video.ndim != 4:
            raise ValueError(f"a numpy video must be uint8 [frames, H, W, C], got {video.dtype} {video.shape}")
        return video
    if video.dim() != 4:
        raise ValueError(f"a video tensor must be [channels, frames, H, W], got shape {tuple(video.shape)}")
    x = ((video.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).numpy()


def _upscale(frames: np.ndarray, scale: int) -> np.ndarray:
    return frames.repeat(scale, axis=1).repeat(scale, axis=2) if scale > 1 else frames


def save_gif(video, path: str | Path, fps: int = 8, scale: int = 1) -> Path:
    """An animated GIF that loops (nearest-neighbour upscaled by `scale` for tiny clips)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [Image.fromarray(f) for f in _upscale(video_to_uint8(video), scale)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path


def save_video(video, path: str | Path, fps: int = 8, scale: int = 1) -> Path:
    """An H.264 MP4 (yuv420p, what players open) written with PyAV; sides are padded to even sizes."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = _upscale(video_to_uint8(video), scale)
    f, h, w, _ = frames.shape
    ph, pw = h + h % 2, w + w % 2
    if (ph, pw) != (h, w):
        frames = np.pad(frames, ((0, 0), (0, ph - h), (0, pw - w), (0, 0)), mode="edge")
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = pw, ph, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
