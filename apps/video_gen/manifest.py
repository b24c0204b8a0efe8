"""Real video datasets from a manifest: CSV, JSONL or parquet, one clip per row, decoded lazily.

The columns follow the layout Open-Sora's data tools write (`path,text,num_frames,height,width,
aspect_ratio,resolution,fps`, plus scores such as `aes`):

    path        the video file; relative paths are relative to the manifest's folder (or data.manifest_root)
    text        the caption (also `caption` / `captions`): a string, or several (a list in JSONL / parquet,
                a JSON list string in CSV); each draw picks one at random
    num_frames  (or `frames`), height, width, fps: optional; missing ones are read from the file's header
    aes         (or `aesthetic`) and `score`: optional, for the data.min_aesthetic / data.min_score filters

Only the metadata is kept (paths and captions packed into two byte buffers, sizes in numpy
arrays): no decoded video, so memory stays flat in the number of clips. A training item is one
bucket's batch: its clips are decoded on the DataLoader's workers with PyAV when the item is drawn,
only up to the last frame the bucket needs, every `stride`-th frame from a random offset, cropped
to the bucket's aspect ratio (centre or random) and then resized (no aspect distortion). Those
random draws (offset, crop, caption) come from the item's own generator, seeded by (train.seed,
epoch, item) (`item_generator`; `fit` tells the dataset the epoch through `set_epoch`), not from
the workers' RNG: the same item draws alike with any number of workers and after a resume. The
held-out split is a share of the manifest's videos (by a seeded hash of the path, so every row of
one video falls on the same side); its clips are decoded once, deterministically (centre offset,
centre crop, first caption).
"""
from __future__ import annotations

import csv
import json
import math
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from phalanx.data.buckets import Bucket, BucketBatchSampler, assign_bucket

from .clips import VideoDataError

SUFFIXES = (".csv", ".jsonl", ".parquet")
CAPTION_COLUMNS = ("text", "caption", "captions")
SIZE_COLUMNS = {"frames": ("num_frames", "frames"), "height": ("height",), "width": ("width",), "fps": ("fps",)}
SEP = "\x1f"  # between a row's captions in the packed column


class StringColumn:
    """Strings packed into one UTF-8 buffer plus offsets: no Python object per row (a list of str
    would cost ~60 bytes of headers per row, and DataLoader workers touching their refcounts copy
    the pages)."""

    def __init__(self):
        self._data, self._offsets = bytearray(), array("q", [0])

    def append(self, value: str) -> None:
        self._data += value.encode("utf-8")
        self._offsets.append(len(self._data))

    def freeze(self) -> "StringColumn":
        self._data, self._offsets = np.frombuffer(bytes(self._data), np.uint8), np.frombuffer(self._offsets, np.int64)
        return self

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:
        return bytes(self._data[self._offsets[i]:self._offsets[i + 1]]).decode("utf-8")

    def nbytes(self) -> int:
        return len(self._data) + 8 * len(self._offsets)


@dataclass
class Manifest:
    """The rows kept after filtering: paths, captions (SEP-joined), sizes (-1 / nan: unknown until probed)."""
    source: Path
    paths: StringColumn
    captions: StringColumn
    frames: np.ndarray
    height: np.ndarray
    width: np.ndarray
    fps: np.ndarray
    dropped: int = 0                    # rows left out by the score filters

    def __len__(self) -> int:
        return len(self.paths)

    def captions_of(self, i: int) -> list[str]:
        return self.captions[i].split(SEP)

    def all_captions(self) -> Iterator[str]:
        for i in range(len(self)):
            yield from self.captions_of(i)


# -- reading --------------------------------------------------------------------------------------
def _records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line or row number, record) from a CSV, JSONL or parquet manifest, streamed."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            for n, row in enumerate(csv.DictReader(f), 2):
                yield n, row
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise VideoDataError(f"{path} line {n} is not JSON ({exc.msg}): write one object per line such "
                                         'as {"path": "clip.mp4", "text": "a caption"}') from exc
                if not isinstance(row, dict):
                    raise VideoDataError(f"{path} line {n}: expected a JSON object, got {str(row)[:80]}")
                yield n, row
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise VideoDataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or write the "
                                 "manifest as CSV / JSONL") from exc
        n = 0
        for batch in pq.ParquetFile(str(path)).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield n, row


def _captions(value, where: str) -> list[str]:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    texts = [t.replace(SEP, " ").strip() for t in texts if isinstance(t, str)]
    if not texts or not all(texts):
        raise VideoDataError(f"{where}: the caption is {str(value)[:80]!r}; give a non-empty string or a list of "
                             "non-empty strings in 'text' (or 'caption'), or remove the row")
    return texts


def _number(row: dict, names: tuple[str, ...], where: str) -> float | None:
    for name in names:
        value = row.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        try:
            out = float(value)
        except (TypeError, ValueError) as exc:
            raise VideoDataError(f"{where}: column '{name}' is {value!r}, not a number; fix or blank it") from exc
        return None if math.isnan(out) else out
    return None


def _passes(row: dict, where: str, min_aesthetic: float | None, min_score: float | None) -> bool:
    for threshold, names, key in ((min_aesthetic, ("aes", "aesthetic"), "data.min_aesthetic"),
                                  (min_score, ("score",), "data.min_score")):
        if threshold is None:
            continue
        value = _number(row, names, where)
        if value is None:
            raise VideoDataError(f"{where}: {key}={threshold} filters on column {' / '.join(names)}, which this row "
                                 f"lacks; score every row or set {key}=null")
        if value < threshold:
            return False
    return True


def read_manifest(path: str | Path, root: str | Path | None = None, min_aesthetic: float | None = None,
                  min_score: float | None = None) -> Manifest:
    """The manifest's rows that pass the filters, checked: one VideoDataError naming the row and the fix."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise VideoDataError(f"data.manifest={str(path)!r}: write the manifest as one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise VideoDataError(f"data.manifest={str(path)!r} not found: give a CSV / JSONL / parquet file with columns "
                             "path, text (and optionally num_frames, height, width, fps, aes)")
    root = Path(root) if root is not None else path.parent
    paths, captions = StringColumn(), StringColumn()
    sizes = {k: array("d") for k in SIZE_COLUMNS}
    dropped = 0
    for n, row in _records(path):
        where = f"{path} {'line' if path.suffix != '.parquet' else 'row'} {n}"
        if not isinstance(row.get("path"), str) or not row["path"].strip():
            raise VideoDataError(f"{where}: no 'path' (columns {sorted(row)[:12]}); each row needs the video's path "
                                 "and its caption ('text')")
        caption = next((row[c] for c in CAPTION_COLUMNS if row.get(c) not in (None, "")), None)
        texts = _captions(caption, where)
        if not _passes(row, where, min_aesthetic, min_score):
            dropped += 1
            continue
        file = Path(row["path"].strip())
        paths.append(str(file if file.is_absolute() else root / file))
        captions.append(SEP.join(texts))
        for key, names in SIZE_COLUMNS.items():
            value = _number(row, names, where)
            sizes[key].append(float("nan") if value is None else value)
    if not len(paths):
        raise VideoDataError(f"{path} has no usable rows ({dropped} left out by data.min_aesthetic / data.min_score): "
                             "add rows or lower the thresholds")
    as_int = {k: np.nan_to_num(np.frombuffer(sizes[k], np.float64), nan=-1).round().astype(np.int32)
              for k in ("frames", "height", "width")}
    return Manifest(path, paths.freeze(), captions.freeze(), as_int["frames"], as_int["height"], as_int["width"],
                    np.frombuffer(sizes["fps"], np.float64).astype(np.float32), dropped)


# -- probing and decoding -----------------------------------------------------------------------------
def probe_video(path: str) -> tuple[int, int, int, float]:
    """(frames, height, width, fps) from the container's header (no decoding; frames counted by
    decoding only when the header lacks the count)."""
    import av

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            frames = stream.frames or sum(1 for _ in container.decode(video=0))
            return int(frames), stream.codec_context.height, stream.codec_context.width, fps
    except (av.error.FFmpegError, IndexError, ValueError, UnicodeDecodeError) as exc:
        what = "not found" if not Path(path).is_file() else f"cannot be opened ({exc})"
        raise VideoDataError(f"video {path} {what}: fix its row's path in the manifest (relative paths start at the "
                             "manifest's folder or data.manifest_root), re-encode the file (ffmpeg -i in -c:v libx264 "
                             "out.mp4) or remove its row") from exc


def fill_sizes(m: Manifest) -> int:
    """Probe the videos whose frames / height / width / fps the manifest lacks; each distinct file once,
    and under torch.distributed each rank probes its share and the answers are gathered. Returns
    the number of files probed."""
    import torch.distributed as dist

    unknown = np.flatnonzero((m.frames < 0) | (m.height < 0) | (m.width < 0) | np.isnan(m.fps))
    files = sorted({m.paths[i] for i in unknown})
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    found = {f: probe_video(f) for f in files[rank::world]}
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, found)
        found = {k: v for part in parts for k, v in part.items()}
    for i in unknown:
        frames, height, width, fps = found[m.paths[i]]
        m.frames[i] = frames if m.frames[i] < 0 else m.frames[i]
        m.height[i] = height if m.height[i] < 0 else m.height[i]
        m.width[i] = width if m.width[i] < 0 else m.width[i]
        m.fps[i] = fps if np.isnan(m.fps[i]) else m.fps[i]
    return len(files)


def decode_frames(path: str, indices: list[int]) -> np.ndarray:
    """uint8 [len(indices), H, W, 3]: the listed frames (increasing), decoding stops after the last."""
    import av

    wanted, out, decoded = set(indices), {}, 0
    try:
        with av.open(path) as container:
            for i, frame in enumerate(container.decode(video=0)):
                decoded = i + 1
                if i in wanted:
                    out[i] = frame.to_ndarray(format="rgb24")
                if i >= indices[-1]:
                    break
    except (av.error.FFmpegError, IndexError, ValueError, UnicodeDecodeError) as exc:
        if not Path(path).is_file():
            raise VideoDataError(f"video {path} not found: fix its row's path in the manifest (relative paths start "
                                 "at the manifest's folder or data.manifest_root) or remove the row") from exc
        raise VideoDataError(f"cannot decode video {path}: {exc}. Re-encode it (ffmpeg -i in -c:v libx264 out.mp4) "
                             "or remove its row from the manifest") from exc
    if len(out) < len(wanted):
        raise VideoDataError(f"video {path} has {decoded} decodable frames, but frame {indices[-1]} "
                             "was asked for: its num_frames in the manifest is wrong; fix or blank it")
    return np.stack([out[i] for i in indices])


def frame_indices(total: int, frames: int, stride: int, offset: int) -> list[int]:
    """The `frames` frame numbers read for a clip: every `stride`-th from `offset`."""
    if offset < 0 or offset + (frames - 1) * stride >= total:
        raise ValueError(f"{frames} frames at stride {stride} from frame {offset} do not fit in {total}")
    return [offset + k * stride for k in range(frames)]


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The random stream of training item `index` in `epoch`: a function of the three numbers only.
    A DataLoader worker's own RNG depends on which worker draws the item and on how many items that
    worker drew since its iterator started (a resumed run starts a fresh one mid-epoch), and no
    checkpoint holds it."""
    state = np.random.SeedSequence([seed % 2 ** 64, epoch, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def temporal_offset(total: int, frames: int, stride: int, rand: bool, generator: torch.Generator | None = None) -> int:
    """The first frame: uniform over the starts that fit (rand, drawn from `generator`), else the centred start."""
    free = total - (frames - 1) * stride - 1
    return int(torch.randint(free + 1, (), generator=generator).item()) if rand else free // 2


def crop_box(height: int, width: int, bucket_height: int, bucket_width: int, rand: bool,
             generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width): the largest window with the bucket's aspect ratio,
    centred or at a random place."""
    if width * bucket_height > height * bucket_width:          # wider than the bucket: cut the sides
        ch, cw = height, max(1, min(width, round(height * bucket_width / bucket_height)))
    else:                                                      # taller: cut top and bottom
        ch, cw = max(1, min(height, round(width * bucket_height / bucket_width))), width
    if rand:
        top, left = (int(torch.randint(n + 1, (), generator=generator).item()) for n in (height - ch, width - cw))
    else:
        top, left = (height - ch) // 2, (width - cw) // 2
    return top, left, ch, cw


def clip_stride(fps: float, stride: int, target_fps: float | None) -> int:
    """Frames between two kept ones: data.clip_stride, or with data.clip_fps the source fps / target."""
    if target_fps and fps > 0:
        return max(1, round(fps / target_fps))
    return stride


def load_clip(path: str, total: int, bucket: Bucket, stride: int, random_offset: bool,
              random_crop: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """[3, bucket.frames, bucket.height, bucket.width] in [-1, 1]: sampled in time (every `stride`-th
    frame from a random or the centred offset), cropped to the bucket's aspect, then resized (area);
    the random offset and crop are drawn from `generator`."""
    frames = decode_frames(path, frame_indices(total, bucket.frames, stride,
                                               temporal_offset(total, bucket.frames, stride, random_offset,
                                                               generator)))
    top, left, ch, cw = crop_box(frames.shape[1], frames.shape[2], bucket.height, bucket.width, random_crop,
                                 generator)
    x = torch.from_numpy(np.ascontiguousarray(frames[:, top:top + ch, left:left + cw])).permute(0, 3, 1, 2)
    x = x.float() / 127.5 - 1
    if (ch, cw) != (bucket.height, bucket.width):
        x = F.interpolate(x, size=(bucket.height, bucket.width), mode="area")
    return x.transpose(0, 1).contiguous()


# -- splitting, buckets and the datasets ------------------------------------------------------------------
def held_out_rows(m: Manifest, share: float, seed: int) -> np.ndarray:
    """A boolean mask: the rows of about `share` of the videos (seeded hash of the path; at least
    one video, and at least one left for training)."""
    h = np.array([zlib.crc32(f"{seed}:{m.paths[i]}".encode()) for i in range(len(m))], dtype=np.uint64)
    held = h < share * 2 ** 32
    if not held.any():
        held = h == h.min()
    if held.all():
        raise VideoDataError(f"{m.source}: its rows name {'one video' if (h == h[0]).all() else 'too few videos'}, "
                             "so none is left to train on after holding out data.held_out of the videos; add videos")
    return held


def assign_rows(m: Manifest, rows: np.ndarray, buckets: list[Bucket], stride: int,
                target_fps: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(bucket index per row, -1: fits none; frame stride per row): a row's bucket is the nearest
    by aspect among those with at most as many frames as the video has at its stride."""
    bucket_of, strides = np.full(len(rows), -1, np.int32), np.ones(len(rows), np.int32)
    for k, i in enumerate(rows):
        s = clip_stride(float(m.fps[i]), stride, target_fps)
        available = (int(m.frames[i]) - 1) // s + 1 if m.frames[i] > 0 else 0
        b = assign_bucket(available, int(m.height[i]), int(m.width[i]), buckets) if available else None
        bucket_of[k], strides[k] = -1 if b is None else b, s
    return bucket_of, strides


class ManifestBatches(Dataset):
    """Training items: whole bucket batches of manifest rows, decoded when drawn (on the DataLoader's
    workers). {"video": [B, 3, F, H, W], "prompt_ids": [B, tokens]}; load with micro_batch_size=1.
    Item k's offsets, crops and captions are drawn from `item_generator(seed, epoch, k)`."""

    def __init__(self, m: Manifest, rows: np.ndarray, buckets: list[Bucket], tokenizer, stride: int = 1,
                 target_fps: float | None = None, crop: str = "center", seed: int = 0):
        from .text import tokenize

        self.manifest, self.buckets, self.tokenizer, self.tokenize = m, buckets, tokenizer, tokenize
        self.random_crop = crop == "random"
        self.rows = np.asarray(rows, dtype=np.int64)
        self.bucket_of, self.strides = assign_rows(m, self.rows, buckets, stride, target_fps)
        grouping = BucketBatchSampler([None if b < 0 else int(b) for b in self.bucket_of], buckets, seed=seed)
        batches = grouping.epoch_batches(0)
        self.starts = np.cumsum([0] + [len(b) for b in batches])
        self.members = np.fromiter((i for b in batches for i in b), np.int64)  # positions in self.rows
        self.unassigned = int((self.bucket_of < 0).sum())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Called by `fit` before each pass over the data (and on resume): the epoch of the draws."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        m, videos, texts = self.manifest, [], []
        g = item_generator(self.seed, self.epoch, k)
        for pos in self.members[self.starts[k]:self.starts[k + 1]]:
            i = int(self.rows[pos])
            bucket = self.buckets[int(self.bucket_of[pos])]
            videos.append(load_clip(m.paths[i], int(m.frames[i]), bucket, int(self.strides[pos]), True,
                                    self.random_crop, g))
            options = m.captions_of(i)
            texts.append(options[int(torch.randint(len(options), (), generator=g).item())])
        return {"video": torch.stack(videos), "prompt_ids": self.tokenize(self.tokenizer, texts)}


def held_out_clips(m: Manifest, rows: np.ndarray, buckets: list[Bucket], stride: int, target_fps: float | None,
                   max_per_bucket: int) -> list[tuple[torch.Tensor, str]]:
    """[(clip at its bucket's shape, first caption)] for up to `max_per_bucket` held-out rows per
    bucket, decoded deterministically (centred in time and space)."""
    bucket_of, strides = assign_rows(m, rows, buckets, stride, target_fps)
    out, count = [], {}
    for pos, i in enumerate(rows):
        b = int(bucket_of[pos])
        if b < 0 or count.get(b, 0) >= max_per_bucket:
            continue
        count[b] = count.get(b, 0) + 1
        out.append((load_clip(m.paths[i], int(m.frames[i]), buckets[b], int(strides[pos]), False, False),
                    m.captions_of(i)[0]))
    return out
