"""Subject fidelity of a DreamBooth model, measured in the VAE's latent space.

    before = draw(parts, cfg, cfg.dreambooth.instance_prompt)        # the base model, before training
    ...train...
    after = draw(trained_parts, cfg, cfg.dreambooth.instance_prompt)
    fidelity_report(cfg, vae, factor, before, after, after_class, instance_latents, class_latents, ...)

The instance prompt's samples (fixed seeds, so "before" and "after" start from the same noise)
are encoded by the VAE like the training images; for each sample we take the RMS latent distance
to the nearest instance image and to the nearest class image. A model that learned the subject
draws samples nearer the instance images than the class images (`nearer_instance` near 1); the
base model draws the class. The class prompt's samples after training show whether the prior was
kept (they should stay nearer the class images).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import RecipeConfig
from .data import encode_pixels, pixels
from .validation import generate

REPORT = "fidelity.json"
FIGURE = "fidelity.png"


@dataclass
class Samples:
    prompt: str
    images: list  # PIL


def draw(parts, cfg: RecipeConfig, prompt: str) -> Samples:
    """`dreambooth.fidelity_samples` images of `prompt` at the validation settings, in one batch."""
    n = cfg.dreambooth.fidelity_samples
    return Samples(prompt, generate(parts, [prompt] * n, cfg.validation))


def nearest_distance(samples: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """Per sample, the RMS (per latent element) distance to the nearest reference, [N]."""
    a, b = samples.flatten(1).double(), refs.flatten(1).double()
    return (torch.cdist(a, b) / a.shape[1] ** 0.5).min(dim=1).values.float()


def fidelity(sample_latents: torch.Tensor, instance: torch.Tensor, prior: torch.Tensor | None) -> dict[str, float]:
    """Mean nearest distance to the instance images (and to the class images, with the share of
    samples nearer an instance image than any class image)."""
    to_instance = nearest_distance(sample_latents, instance)
    out = {"to_instance": float(to_instance.mean())}
    if prior is not None:
        to_class = nearest_distance(sample_latents, prior)
        out |= {"to_class": float(to_class.mean()), "nearer_instance": float((to_instance < to_class).float().mean())}
    return out


def encode(vae, factor: float, samples: Samples) -> torch.Tensor:
    """Samples -> scaled latents, as the training images were encoded."""
    return encode_pixels(vae, torch.stack([pixels(im) for im in samples.images])) * factor


def fidelity_report(cfg: RecipeConfig, vae, factor: float, before: Samples, after: Samples, after_class: Samples,
                    instance: torch.Tensor, prior: torch.Tensor | None, instance_images: list,
                    class_images: list) -> dict:
    """Writes <output_dir>/fidelity.json and fidelity.png (rows: instance images, class images,
    the instance prompt before and after, the class prompt after); returns the numbers."""
    report = {"samples": cfg.dreambooth.fidelity_samples, "instance_prompt": before.prompt,
              "class_prompt": after_class.prompt,
              "before": fidelity(encode(vae, factor, before), instance, prior),
              "after": fidelity(encode(vae, factor, after), instance, prior),
              "class_prompt_after": fidelity(encode(vae, factor, after_class), instance, prior)}
    if prior is not None:  # the scale: how far apart the two reference sets are
        report["instance_to_class"] = fidelity(instance, instance, prior)["to_class"]
    out = Path(cfg.train.output_dir)
    (out / REPORT).write_text(json.dumps(report, indent=2))
    rows = [("instance images", instance_images), ("class images (base)", class_images),
            (f"{before.prompt!r} before", before.images), (f"{after.prompt!r} after", after.images),
            (f"{after_class.prompt!r} after", after_class.images)]
    labels = [_label(report, key) for key in (None, None, "before", "after", "class_prompt_after")]
    figure([(f"{name}\n{label}" if label else name, images) for (name, images), label in zip(rows, labels, strict=True)],
           out / FIGURE)
    return report


def _label(report: dict, key: str | None) -> str:
    if key is None:
        return ""
    r = report[key]
    text = f"d_inst {r['to_instance']:.3f}"
    if "to_class" in r:
        text += f"\nd_class {r['to_class']:.3f}\nnearer inst {r['nearer_instance']:.0%}"
    return text


def to_image(image: torch.Tensor):
    """[3, H, W] in [-1, 1] -> PIL RGB."""
    from PIL import Image

    return Image.fromarray(((image.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy())


def figure(rows: list[tuple[str, list]], path: Path, scale: int = 2, label_width: int = 150) -> Path:
    """Rows of images (shown `scale`x, nearest neighbour) with a text label on the left of each."""
    from PIL import Image, ImageDraw

    w, h = rows[0][1][0].size
    w, h = w * scale, h * scale
    columns = max(len(images) for _, images in rows)
    grid = Image.new("RGB", (label_width + columns * w, len(rows) * h), "white")
    draw_ = ImageDraw.Draw(grid)
    rows = [(label, images) for label, images in rows if images]
    for r, (label, images) in enumerate(rows):
        draw_.multiline_text((4, r * h + 4), label, fill="black")
        for c, im in enumerate(images):
            grid.paste(im.convert("RGB").resize((w, h), Image.NEAREST), (label_width + c * w, r * h))
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path

