"""train_text_to_image's held-out validation (images training never sees, a fixed noise/timestep draw)
and its augmentation (random flip from two cached views, random crop encoded in the step)."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from diffusion_tiny import EMOJI

SMALL = ["data.max_images=null", "data.exclude=[]", "validation.prompts=[]", "ema.enabled=false"]


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """12 emoji with their captions: a folder small enough to encode whole in a test."""
    folder = tmp_path_factory.mktemp("emoji12")
    (folder / "images").mkdir()
    lines = (EMOJI / "metadata.jsonl").read_text().splitlines()[:12]
    for line in lines:
        name = json.loads(line)["file_name"]
        shutil.copyfile(EMOJI / name, folder / name)
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _prepare(cfg):
    from phalanx.launch import seed_everything

    from apps.diffusion.train_text_to_image import load_components, prepare_dataset

    seed_everything(cfg.train.seed)
    parts = load_components(cfg.model, cfg.noise, cfg.data.resolution)
    return parts, prepare_dataset(cfg, parts)


def _rows(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.flatten(1))


def test_held_out_images_are_never_trained_on(tmp_path, make_config, small_folder, monkeypatch):
    """4 of 12 images are held out (seeded): the training set fit receives holds none of them, and
    eval/loss is the fixed-noise loss of the held-out batch, the same draw at every evaluation."""
    import apps.diffusion.train_text_to_image as t2i
    from apps.diffusion.data import encode_images, split_held_out
    from apps.diffusion.recipe import trained_model
    from apps.diffusion.validation import fixed_noise_loss

    cfg = make_config(tmp_path, *SMALL, f"data.root={small_folder}", "validation.held_out=4", "train.max_steps=2")
    seen = {}
    real_fit = t2i.fit_with_validation

    def spy(cfg_, parts, model, dataset, prompts, val_batch=None, collate_fn=None):
        seen.update(dataset=dataset, val_batch=val_batch)
        return real_fit(cfg_, parts, model, dataset, prompts, val_batch, collate_fn)

    monkeypatch.setattr(t2i, "fit_with_validation", spy)
    result, _ = t2i.train(cfg)

    parts, prepared = _prepare(cfg)
    held = [p for p, _ in prepared.held_out_pairs]
    assert len(held) == 4 and len(prepared.train_pairs) == 8
    assert not set(held) & {p for p, _ in prepared.train_pairs}
    assert sorted(held + [p for p, _ in prepared.train_pairs]) == sorted(small_folder.glob("images/*.png"))
    # The held-out batch is the held-out images' plain latents; no training sample fit saw is one of them.
    factor = float(parts.vae.config.scaling_factor)
    expected = encode_images(parts.vae, held, cfg.data.resolution) * factor
    torch.testing.assert_close(seen["val_batch"]["latents"], expected)
    trained_rows = [seen["dataset"][i]["latents"].flatten() for i in range(len(seen["dataset"]))]
    assert len(trained_rows) == 8
    for row in _rows(seen["val_batch"]["latents"]):
        assert not any(torch.allclose(row, t) for t in trained_rows)
    # eval/loss = the trained weights' loss on that batch at the fixed draw, reproducible call to call.
    _, model = trained_model(cfg, result.checkpoint_dir)
    model.eval()
    again = [fixed_noise_loss(model, seen["val_batch"], model.num_timesteps) for _ in range(2)]
    assert again[0] == again[1]
    assert result.last_eval["loss"] == pytest.approx(again[0], rel=1e-5)
    # The draw of held-out items is fixed by the seed, and another seed draws others.
    pairs = list(range(12))
    assert split_held_out(pairs, 4, 0) == split_held_out(pairs, 4, 0) != split_held_out(pairs, 4, 1)
    with pytest.raises(ValueError, match="leaves no training image"):
        split_held_out(pairs, 12, 0)


def test_a_validation_root_holds_out_its_own_images(tmp_path, make_config, small_folder):
    """validation.root: its images are the held-out set and all of data.root trains; a folder that
    shares an image with data.root is refused."""
    from apps.diffusion.train_text_to_image import split_images

    other = tmp_path / "other"
    (other / "images").mkdir(parents=True)
    lines = (EMOJI / "metadata.jsonl").read_text().splitlines()[20:23]
    for line in lines:
        shutil.copyfile(EMOJI / json.loads(line)["file_name"], other / json.loads(line)["file_name"])
    (other / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    train, held = split_images(make_config(tmp_path, *SMALL, f"data.root={small_folder}", f"validation.root={other}"))
    assert len(train) == 12 and [p.parent.parent for p, _ in held] == [other] * 3
    cfg = make_config(tmp_path, *SMALL, f"data.root={small_folder}", f"validation.root={small_folder}")
    with pytest.raises(ValueError, match="shares 12 image"):
        split_images(cfg)


def test_random_flip_uses_both_cached_views(tmp_path, make_config, small_folder):
    """Both views are encoded (the mirrored image's own latents, its own cache file), and the step
    takes each sample's plain or mirrored latents at random; evaluation takes the plain view."""
    from apps.diffusion.data import encode_images

    cfg = make_config(tmp_path, *SMALL, f"data.root={small_folder}", "validation.held_out=0", "data.random_flip=true")
    parts, prepared = _prepare(cfg)
    ds, factor = prepared.dataset, float(parts.vae.config.scaling_factor)
    paths = [p for p, _ in prepared.train_pairs]
    torch.testing.assert_close(ds.flipped, encode_images(parts.vae, paths, 64, flip=True) * factor)
    torch.testing.assert_close(ds.latents, encode_images(parts.vae, paths, 64) * factor)
    assert (ds.flipped - ds.latents).abs().mean() > 0.05  # the mirrored view is another input
    caches = sorted(p.name for p in (tmp_path / "cache").glob("*.safetensors"))
    assert len(caches) == 2 and sum(n.startswith("latents-64px-flip-") for n in caches) == 1

    batch = {k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ("latents", "latents_flipped")}
    torch.manual_seed(0)
    views = prepared.views(batch["latents"], batch["latents_flipped"])
    mirrored = [torch.equal(v, f) for v, f in zip(views, batch["latents_flipped"])]
    plain = [torch.equal(v, p) for v, p in zip(views, batch["latents"])]
    assert all(m != p for m, p in zip(mirrored, plain)) and any(mirrored) and any(plain)
    torch.manual_seed(1)
    assert not torch.equal(prepared.views(batch["latents"], batch["latents_flipped"]), views)
    assert torch.equal(prepared.views(batch["latents"], batch["latents_flipped"], training=False), batch["latents"])


def test_random_crop_encodes_each_steps_crops_and_caches_none(tmp_path, make_config, small_folder):
    """With random_crop the dataset serves pixels (no training latents are cached: a cached crop would
    be the same crop every epoch); the step cuts a random 64 px square of the 80 px image, equal to
    encoding that crop by hand, and another draw cuts others. Two training steps run end to end."""
    from apps.diffusion.data import load_square
    from apps.diffusion.train_text_to_image import train

    over = [*SMALL, f"data.root={small_folder}", "validation.held_out=2", "data.random_crop=true",
            "data.resize_scale=1.25", "data.random_flip=true", "model.vae_scaling_factor=0.5"]
    cfg = make_config(tmp_path, *over)
    parts, prepared = _prepare(cfg)
    sample = prepared.dataset[0]
    assert set(sample) == {"pixels", "prompt_ids"} and sample["pixels"].shape == (3, 80, 80)
    torch.testing.assert_close(sample["pixels"], load_square(prepared.train_pairs[0][0], 80))
    # only the held-out batch (plain view) was cached; the scaling factor came from the config
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1

    pixels = torch.stack([prepared.dataset[i]["pixels"] for i in range(4)])
    views = prepared.views
    torch.manual_seed(0)
    got = views(None, pixels=pixels)
    torch.manual_seed(0)
    offsets = torch.randint(0, 17, (4, 2)).tolist()
    flip = torch.rand(4) < 0.5
    crops = torch.stack([p[:, t:t + 64, l:l + 64] for p, (t, l) in zip(pixels, offsets)])
    crops = torch.where(flip.view(-1, 1, 1, 1), crops.flip(-1), crops)
    with torch.no_grad():
        expected = parts.vae.encode(crops).latent_dist.mode() * 0.5
    torch.testing.assert_close(got, expected)
    assert len({tuple(o) for o in offsets}) > 1
    assert not torch.allclose(views(None, pixels=pixels), got)
    with torch.no_grad():
        centre = parts.vae.encode(pixels[:, :, 8:72, 8:72]).latent_dist.mode() * 0.5
    torch.testing.assert_close(views(None, pixels=pixels, training=False), centre)

    result, _ = train(make_config(tmp_path / "run", *over, "train.max_steps=2"))
    assert result.final_step == 2 and all(map(math.isfinite, result.losses)) and "loss" in result.last_eval


def test_augmentation_settings_are_checked(tmp_path, make_config):
    from phalanx.config import ConfigError

    with pytest.raises(ConfigError, match="data.random_crop"):
        make_config(tmp_path, "data.random_crop=true")
    with pytest.raises(ConfigError, match="data.resize_scale"):
        make_config(tmp_path, "data.resize_scale=0.5")
