"""Images -> cached VAE latents + tokenized prompts, as map-style datasets for `phalanx.train.fit`.

The VAE is frozen, so every image is encoded once (rank 0 writes a safetensors cache under the
run's output directory; the other ranks wait and read it) and training runs on latents only.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from phalanx.device import current_device
from phalanx.launch import barrier
from phalanx.observe import is_main_process

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def load_image(path: Path, resolution: int, background: tuple[int, int, int] = (255, 255, 255),
               flip: bool = False, resize_scale: float = 1.0) -> torch.Tensor:
    """RGB in [-1, 1], [3, resolution, resolution]: transparent pixels over `background`, the centre
    square resized (bicubic) to resolution x resize_scale, its centre resolution-square cut, mirrored
    left-right with `flip` (the plain view of `data.resize_scale` / `data.random_flip`)."""
    image = load_square(path, round(resolution * resize_scale), background)
    return center_crop(image.flip(-1) if flip else image, resolution)


def load_square(path: Path, size: int, background: tuple[int, int, int] = (255, 255, 255)) -> torch.Tensor:
    """The image's centre square resized to size x size, [3, size, size] in [-1, 1]."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGBA")
        canvas = Image.new("RGBA", im.size, (*background, 255))
        im = Image.alpha_composite(canvas, im).convert("RGB")
    side = min(im.size)
    left, top = (im.width - side) // 2, (im.height - side) // 2
    im = im.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)
    return pixels(im)


def center_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    """The centre size x size window of [..., H, W] (rounding the offset down, as random_crops' range)."""
    top, left = (image.shape[-2] - size) // 2, (image.shape[-1] - size) // 2
    return image[..., top:top + size, left:left + size]


def random_crops(images: torch.Tensor, size: int, flip: bool) -> torch.Tensor:
    """Per image of [B, C, S, S]: a size x size window at a random place and, with `flip`, a mirror
    with probability 1/2 (on the default generator of the images' device: the training RNG stream)."""
    return random_crops_where(images, size, flip)[0]


def random_crops_where(images: torch.Tensor, size: int, flip: bool):
    """`random_crops` and where they were cut: (crops, offsets [B, 2] (top, left) inside the square,
    mirrored [B] bool or None without `flip`)."""
    b, room = images.shape[0], images.shape[-1] - size + 1
    offsets = torch.randint(0, room, (b, 2), device=images.device)
    crops = torch.stack([img[:, top:top + size, left:left + size]
                         for img, (top, left) in zip(images, offsets.tolist())])
    if not flip:
        return crops, offsets, None
    pick = flip_draw(crops)
    return mirror_some(crops, pick=pick), offsets, pick


def flip_draw(images: torch.Tensor) -> torch.Tensor:
    """Which samples are mirrored: [B] bool, each True with probability 1/2."""
    return torch.rand(images.shape[0], device=images.device) < 0.5


def mirror_some(images: torch.Tensor, mirrored: torch.Tensor | None = None,
                pick: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample of `images` or, with probability 1/2 (or where `pick`), its mirror (`mirrored`,
    default the left-right flip of `images`: pass the cached latents of the mirrored image where they exist)."""
    pick = flip_draw(images) if pick is None else pick
    other = images.flip(-1) if mirrored is None else mirrored
    return torch.where(pick.view(-1, *([1] * (images.dim() - 1))), other, images)


def view_time_ids(time_ids: torch.Tensor, square: int, resolution: int, offsets: torch.Tensor | None = None,
                  mirrored: torch.Tensor | None = None) -> torch.Tensor:
    """SDXL's time_ids of a training view, from the centre view's ([B, 6], `size_crop_table`): the
    crop at `offsets` inside the square (None: the centre crop) and, where `mirrored`, the crop of
    the mirrored image, whose left offset is W' - left - resolution (W': the width of the image
    resized so its shorter side is `square`), as SDXL's training crops a flipped image."""
    h, w, top, left = time_ids[:, 0], time_ids[:, 1], time_ids[:, 2], time_ids[:, 3]
    if offsets is not None:
        inner = (square - resolution) // 2
        top, left = top - inner + offsets[:, 0].to(top.dtype), left - inner + offsets[:, 1].to(left.dtype)
    if mirrored is not None:
        resized_w = torch.round(w * square / torch.minimum(h, w))
        left = torch.where(mirrored, resized_w - left - resolution, left)
    return torch.stack([h, w, top, left, time_ids[:, 4], time_ids[:, 5]], dim=1)


def pixels(image) -> torch.Tensor:
    """A PIL RGB image as [3, H, W] in [-1, 1]."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)


def read_captioned_folder(root: Path, max_images: int | None = None,
                          exclude: list[str] | tuple[str, ...] = ()) -> list[tuple[Path, str]]:
    """(image path, caption) pairs from `root/metadata.jsonl` ({"file_name", "text"} per line),
    without the lines that an `exclude` filter "field=value" matches (e.g. "subcategory=cat-face":
    a subject held out of the base model for DreamBooth)."""
    meta = root / "metadata.jsonl"
    if not meta.is_file():
        raise FileNotFoundError(f"{meta} not found: data.root must hold metadata.jsonl with "
                                '{"file_name": ..., "text": ...} lines next to the images')
    filters = [_exclude_filter(f) for f in exclude]
    hits = [0] * len(filters)
    pairs = []
    for n, line in enumerate(meta.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pair = (root / row["file_name"], str(row["text"]))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{meta} line {n}: {exc!r}; each line must be a JSON object with file_name and text") from exc
        matched = [i for i, (key, value) in enumerate(filters) if str(row.get(key)) == value]
        for i in matched:
            hits[i] += 1
        if not matched:
            pairs.append(pair)
    unused = [f for f, hit in zip(exclude, hits, strict=True) if not hit]
    if unused:
        raise ValueError(f"data.exclude {unused} matches no line of {meta}: check the field names and values")
    missing = [str(p) for p, _ in pairs if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} image(s) named in {meta} are missing, e.g. {missing[:2]}")
    if not pairs:
        raise ValueError(f"{meta} lists no images" + (" once data.exclude is applied" if exclude else ""))
    return pairs[:max_images] if max_images else pairs


def _exclude_filter(spec: str) -> tuple[str, str]:
    key, sep, value = str(spec).partition("=")
    if not sep or not key.strip():
        raise ValueError(f"data.exclude entry {spec!r}: write it as field=value, e.g. subcategory=cat-face or "
                         "file_name=images/1f431.png")
    return key.strip(), value.strip()


def image_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


@torch.no_grad()
def encode_images(vae, paths: list[Path], resolution: int, background=(255, 255, 255), batch_size: int = 32,
                  flip: bool = False, resize_scale: float = 1.0) -> torch.Tensor:
    """Raw (unscaled) latents of the images' view, [N, C, resolution/8, resolution/8], fp32."""
    def view(p: Path) -> torch.Tensor:
        return load_image(p, resolution, background, flip=flip, resize_scale=resize_scale)

    return torch.cat([encode_pixels(vae, torch.stack([view(p) for p in paths[i:i + batch_size]]))
                      for i in range(0, len(paths), batch_size)])


@torch.no_grad()
def encode_pixels(vae, images: torch.Tensor) -> torch.Tensor:
    """Raw latents of [N, 3, H, W] images in [-1, 1] (the mode of the VAE's posterior), fp32 on the CPU."""
    return vae.encode(images.to(vae.device, vae.dtype)).latent_dist.mode().float().cpu()


def cached_latents(vae, paths: list[Path], resolution: int, cache_dir: Path, background=(255, 255, 255),
                   flip: bool = False, resize_scale: float = 1.0) -> torch.Tensor:
    """`encode_images` of one view (plain, or mirrored with `flip`), cached in cache_dir by a key of
    (files, resolution, background, view, VAE weights): each view has its own file."""
    from safetensors.torch import load_file, save_file

    from .components import on_device

    view = [] if not flip and resize_scale == 1.0 else [flip, resize_scale]  # the plain view keeps its old key
    key = hashlib.sha256(json.dumps([[str(p) for p in paths], resolution, list(background), *view,
                                     type(vae).__name__, _weights_fingerprint(vae)]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"latents-{resolution}px-{'flip-' if flip else ''}{key}.safetensors"
    rank0 = is_main_process()
    if rank0 and not path.is_file():
        latents = encode_images(on_device(vae, current_device()), paths, resolution, background,  # on the accelerator
                                flip=flip, resize_scale=resize_scale)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"latents": latents.contiguous()}, str(tmp))
        tmp.replace(path)
    barrier()
    return load_file(str(path))["latents"]


def _weights_fingerprint(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def tokenize(tokenizer, prompts: list[str]) -> torch.Tensor:
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def tokenize_all(tokenizers: list, prompts: list[str]) -> torch.Tensor:
    """`prompt_ids` [N, T1 + T2 + ...]: each tokenizer's ids of the prompts side by side (SDXL: the
    first and the second text encoder's), so datasets and caption dropout handle one tensor."""
    return torch.cat([tokenize(t, prompts) for t in tokenizers], dim=1)


def size_crop_ids(path: Path, resolution: int, resize_scale: float = 1.0) -> list[int]:
    """SDXL's size / crop conditioning of the plain (centre) view `load_image` makes of `path`:
    [original height, original width, crop top, crop left, target height, target width]. The crop's
    top-left is in the coordinates of the original image resized so its shorter side is
    S = resolution x resize_scale (SDXL's convention): the centre square's offset scaled to S,
    plus the centre crop's offset inside the S x S square."""
    from PIL import Image

    with Image.open(path) as im:
        width, height = im.size
    side, size = min(width, height), round(resolution * resize_scale)
    inner = (size - resolution) // 2  # center_crop's offset
    top = round((height - side) // 2 * size / side) + inner
    left = round((width - side) // 2 * size / side) + inner
    return [height, width, top, left, resolution, resolution]


def size_crop_table(paths: list[Path], resolution: int, resize_scale: float = 1.0) -> torch.Tensor:
    """`size_crop_ids` of every image, [N, 6] float32 (the dtype of SDXL's `time_ids`)."""
    return torch.tensor([size_crop_ids(p, resolution, resize_scale) for p in paths], dtype=torch.float32)


class LatentCaptionDataset(Dataset):
    """Samples {"latents": [C,h,w] scaled latents, "prompt_ids": [T]} and, given `flipped` (the
    mirrored images' latents, for `data.random_flip`), "latents_flipped": the training step picks
    one of the two views; given `time_ids` (SDXL, [N, 6] from `size_crop_table`), "time_ids".
    No "input_ids" key, so fit's throughput meter counts images, not tokens."""

    def __init__(self, latents: torch.Tensor, prompt_ids: torch.Tensor, scaling_factor: float,
                 flipped: torch.Tensor | None = None, time_ids: torch.Tensor | None = None):
        if len(latents) != len(prompt_ids) or (time_ids is not None and len(time_ids) != len(latents)):
            raise ValueError(f"{len(latents)} latents but {len(prompt_ids)} prompts"
                             + (f" and {len(time_ids)} time_ids" if time_ids is not None else ""))
        self.latents = latents * scaling_factor
        self.prompt_ids = prompt_ids
        self.flipped = flipped * scaling_factor if flipped is not None else None
        self.time_ids = time_ids

    def __len__(self) -> int:
        return len(self.latents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = {"latents": self.latents[i], "prompt_ids": self.prompt_ids[i]}
        if self.flipped is not None:
            sample["latents_flipped"] = self.flipped[i]
        if self.time_ids is not None:
            sample["time_ids"] = self.time_ids[i]
        return sample


class PixelCaptionDataset(Dataset):
    """Samples {"pixels": [3, S, S] (the image's centre square at S = resolution x resize_scale, read
    from disk each time), "prompt_ids": [T]} (+ "time_ids" for SDXL): for `data.random_crop`, whose
    views are cut and encoded inside the training step (no latent cache could hold them)."""

    def __init__(self, paths: list[Path], prompt_ids: torch.Tensor, size: int, background=(255, 255, 255),
                 time_ids: torch.Tensor | None = None):
        if len(paths) != len(prompt_ids):
            raise ValueError(f"{len(paths)} images but {len(prompt_ids)} prompts")
        self.paths, self.prompt_ids, self.size, self.background = list(paths), prompt_ids, size, tuple(background)
        self.time_ids = time_ids  # SDXL: the centre view's (size_crop_table); the step moves them to its crop

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = {"pixels": load_square(self.paths[i], self.size, self.background), "prompt_ids": self.prompt_ids[i]}
        if self.time_ids is not None:
            sample["time_ids"] = self.time_ids[i]
        return sample


def split_held_out(pairs: list, count: int, seed: int) -> tuple[list, list]:
    """(training, held-out): `count` items drawn without replacement by `seed`, both in file order."""
    import random

    if count >= len(pairs):
        raise ValueError(f"validation.held_out={count} leaves no training image of {len(pairs)}: hold out fewer")
    held = set(random.Random(seed).sample(range(len(pairs)), count))
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


class PriorPreservationDataset(Dataset):
    """DreamBooth pairs: sample i = instance i mod N and class image i mod M. The collate function
    stacks instances first, then the class images, and marks which is which (`is_prior`), so every
    micro-batch holds equally many of each and the loss can weigh the two halves."""

    def __init__(self, instance: LatentCaptionDataset, prior: LatentCaptionDataset | None):
        self.instance, self.prior = instance, prior

    def __len__(self) -> int:
        return max(len(self.instance), len(self.prior) if self.prior is not None else 0)

    def __getitem__(self, i: int) -> dict:
        sample = {"instance": self.instance[i % len(self.instance)]}
        if self.prior is not None:
            sample["prior"] = self.prior[i % len(self.prior)]
        return sample


def collate_prior(samples: list[dict]) -> dict[str, torch.Tensor]:
    parts = [s["instance"] for s in samples] + [s["prior"] for s in samples if "prior" in s]
    batch = {"latents": torch.stack([p["latents"] for p in parts]),
             "prompt_ids": torch.stack([p["prompt_ids"] for p in parts])}
    if len(parts) > len(samples):  # no `is_prior` without class images: the loss then needs no split
        batch["is_prior"] = torch.tensor([False] * len(samples) + [True] * (len(parts) - len(samples)))
    return batch


class TrainingViews:
    """What a training step trains on (data.random_flip / data.random_crop), drawn on the training
    RNG stream of the batch's device, so exact resume covers it:

    - cached latents only: themselves;
    - with "latents_flipped" (random_flip, cached): each sample's plain or mirrored view, 1/2 each;
    - with "pixels" (random_crop): a random `resolution` square of each image (mirrored 1/2 of the
      time with random_flip) encoded by the frozen VAE and scaled by `scaling_factor`.

    For SDXL, `draw` also returns the views' time_ids (`view_time_ids`: the crop offsets actually
    used and, for mirrored samples, the mirrored image's). Not an nn.Module: the VAE stays out of
    the trained model's parameters, checkpoints and shards."""

    def __init__(self, resolution: int, random_flip: bool, vae=None, scaling_factor: float = 1.0,
                 square: int | None = None):
        self.resolution, self.random_flip, self.vae, self.scaling_factor = resolution, random_flip, vae, scaling_factor
        self.square = square or resolution  # the resized square the cached views were cut from

    def __call__(self, latents: torch.Tensor | None, latents_flipped: torch.Tensor | None = None,
                 pixels: torch.Tensor | None = None, training: bool = True) -> torch.Tensor:
        return self.draw(latents, latents_flipped, pixels, None, training)[0]

    @torch.no_grad()
    def draw(self, latents: torch.Tensor | None, latents_flipped: torch.Tensor | None = None,
             pixels: torch.Tensor | None = None, time_ids: torch.Tensor | None = None,
             training: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the step's latents, their time_ids; None when `time_ids` is None)."""
        if pixels is not None:
            if self.vae is None:
                raise ValueError("a batch of pixels needs TrainingViews(vae=...): data.random_crop encodes in the step")
            from .components import on_device

            if training:
                crops, offsets, mirrored = random_crops_where(pixels, self.resolution, self.random_flip)
                if time_ids is not None:
                    time_ids = view_time_ids(time_ids, pixels.shape[-1], self.resolution, offsets, mirrored)
            else:
                crops = center_crop(pixels, self.resolution)
            vae = on_device(self.vae, pixels.device)
            return vae.encode(crops.to(vae.dtype)).latent_dist.mode().float() * self.scaling_factor, time_ids
        if latents_flipped is not None and training:
            pick = flip_draw(latents)
            if time_ids is not None:
                time_ids = view_time_ids(time_ids, self.square, self.resolution, mirrored=pick)
            return mirror_some(latents, latents_flipped, pick=pick), time_ids
        return latents, time_ids
