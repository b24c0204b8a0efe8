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


def load_image(path: Path, resolution: int, background: tuple[int, int, int] = (255, 255, 255)) -> torch.Tensor:
    """RGB in [-1, 1], [3, resolution, resolution]: transparent pixels over `background`, centre
    crop to a square, bicubic resize."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGBA")
        canvas = Image.new("RGBA", im.size, (*background, 255))
        im = Image.alpha_composite(canvas, im).convert("RGB")
    side = min(im.size)
    left, top = (im.width - side) // 2, (im.height - side) // 2
    im = im.crop((left, top, left + side, top + side)).resize((resolution, resolution), Image.BICUBIC)
    return pixels(im)


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
def encode_images(vae, paths: list[Path], resolution: int, background=(255, 255, 255), batch_size: int = 32) -> torch.Tensor:
    """Raw (unscaled) latents of the images, [N, C, resolution/8, resolution/8], fp32."""
    return torch.cat([encode_pixels(vae, torch.stack([load_image(p, resolution, background) for p in paths[i:i + batch_size]]))
                      for i in range(0, len(paths), batch_size)])


@torch.no_grad()
def encode_pixels(vae, images: torch.Tensor) -> torch.Tensor:
    """Raw latents of [N, 3, H, W] images in [-1, 1] (the mode of the VAE's posterior), fp32 on the CPU."""
    return vae.encode(images.to(vae.device, vae.dtype)).latent_dist.mode().float().cpu()


def cached_latents(vae, paths: list[Path], resolution: int, cache_dir: Path, background=(255, 255, 255)) -> torch.Tensor:
    """`encode_images`, cached in cache_dir by a key of (files, resolution, background, VAE weights)."""
    from safetensors.torch import load_file, save_file

    from .components import on_device

    key = hashlib.sha256(json.dumps([[str(p) for p in paths], resolution, list(background),
                                     type(vae).__name__, _weights_fingerprint(vae)]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"latents-{resolution}px-{key}.safetensors"
    rank0 = is_main_process()
    if rank0 and not path.is_file():
        latents = encode_images(on_device(vae, current_device()), paths, resolution, background)  # on the accelerator
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


class LatentCaptionDataset(Dataset):
    """Samples {"latents": [C,h,w] scaled latents, "prompt_ids": [T]} (no "input_ids" key, so fit's
    throughput meter counts images, not tokens)."""

    def __init__(self, latents: torch.Tensor, prompt_ids: torch.Tensor, scaling_factor: float):
        if len(latents) != len(prompt_ids):
            raise ValueError(f"{len(latents)} latents but {len(prompt_ids)} prompts")
        self.latents = latents * scaling_factor
        self.prompt_ids = prompt_ids

    def __len__(self) -> int:
        return len(self.latents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"latents": self.latents[i], "prompt_ids": self.prompt_ids[i]}


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
