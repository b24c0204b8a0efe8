"""Real clips: short videos decoded with PyAV, cut into fixed-length clips, with captions.

The folder holds `captions.jsonl`, one {"file": "name.mp4", "text": "..."} per video. Each video
is decoded once, every `stride`-th frame kept, resized to `height` (aspect kept, width rounded to
an even number), and cut into up to `per_video` clips of `frames` frames spread over the video.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CAPTIONS = "captions.jsonl"


class VideoDataError(ValueError):
    """A video or caption file that cannot be used, with the fix in the message."""


def read_captions(folder: Path) -> list[dict]:
    path = folder / CAPTIONS
    if not path.is_file():
        raise VideoDataError(f"{path} not found: a clips folder needs {CAPTIONS} with one "
                             '{"file": "video.mp4", "text": "caption"} per line (or set data.clips_dir=null)')
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise VideoDataError(f"{path} line {n} is not JSON ({exc.msg}): write one "
                                 '{"file": ..., "text": ...} object per line') from exc
        if not isinstance(row, dict) or not isinstance(row.get("file"), str) or not isinstance(row.get("text"), str) \
                or not row["text"].strip():
            raise VideoDataError(f"{path} line {n}: each line needs a string 'file' and a non-empty string 'text', "
                                 f"got {str(row)[:80]}")
        if not (folder / row["file"]).is_file():
            raise VideoDataError(f"{path} line {n} names {row['file']!r}, which is not in {folder}")
        rows.append(row)
    if not rows:
        raise VideoDataError(f"{path} has no captions: add lines or set data.clips_dir=null")
    return rows


def decode_video(path: Path, stride: int = 1) -> np.ndarray:
    """Every `stride`-th frame as uint8 [frames, H, W, 3]."""
    import av

    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(video=0)) if i % stride == 0]
    except (av.error.FFmpegError, UnicodeDecodeError, IndexError, ValueError) as exc:
        raise VideoDataError(f"cannot decode video {path}: {exc}. Re-encode it (e.g. ffmpeg -i in -c:v libx264 "
                             "out.mp4) or remove it from captions.jsonl") from exc
    if not frames:
        raise VideoDataError(f"video {path} has no frames: re-encode it or remove it from captions.jsonl")
    return np.stack(frames)


def resize_video(frames: np.ndarray, height: int) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float [3, F, height, width] in [-1, 1] (area resampling, even width)."""
    f, h, w, _ = frames.shape
    width = max(2, int(round(w * height / h / 2)) * 2)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1
    x = F.interpolate(x, size=(height, width), mode="area")
    return x.permute(1, 0, 2, 3).contiguous()


def load_clips(folder: str | Path, frames: int, stride: int, height: int, per_video: int) -> list[tuple[torch.Tensor, str]]:
    """[(video [3, frames, height, width], caption)] from every video in the folder."""
    folder = Path(folder)
    out = []
    for row in read_captions(folder):
        video = resize_video(decode_video(folder / row["file"], stride), height)
        total = video.shape[1]
        if total < frames:
            raise VideoDataError(f"{folder / row['file']} has {total} frames at stride {stride}, fewer than "
                                 f"data.clip_frames={frames}: lower clip_frames / clip_stride or use a longer video")
        starts = np.linspace(0, total - frames, num=min(per_video, total - frames + 1)).round().astype(int)
        out += [(video[:, s:s + frames].clone(), row["text"]) for s in sorted(set(starts.tolist()))]
    return out
