"""The video recipe resumes exactly: N steps straight against N-1 steps, stopped, then resumed to N
(`train.resume=true`), the resumed step's loss and the final weights equal to the bit (same
processes, same reduction order, nothing legitimately different).

The first session stops at N-1 with `train.decay_steps=N`, so both runs share one cosine: without it
the stopped session decays its learning rate to step N-1 and the resumed step starts from other
weights, which is where the gaps first recorded in docs/video.md came from (no random stream).

The cause found here: a manifest clip's random offset, crop and caption were drawn from the
DataLoader worker's own RNG, which no checkpoint holds and which a resumed run restarts mid-epoch,
so the resumed step trained on another view of its clip (loss 1.0156 against 0.9810 before the
fix). Each item now draws from `manifest.item_generator(seed, epoch, index)` (fit tells the
dataset the epoch through `set_epoch`)."""
from __future__ import annotations

import pytest
import torch

from phalanx.testing import spawn

from video_tiny import TINY_MODEL, tiny_config


def _run(cfg):
    """One session of the recipe as `main` starts it (the launch seeds every RNG with train.seed)."""
    from apps.video_gen.train import train
    from phalanx.launch import seed_everything

    seed_everything(cfg.train.seed)
    return train(cfg)


def _final(result) -> dict[str, torch.Tensor]:
    from phalanx.checkpoint.hf import load_hf_state_dict

    state = load_hf_state_dict(result.checkpoint_dir / "model")
    ema = result.checkpoint_dir / "ema" / "ema.safetensors"
    if ema.exists():
        from safetensors.torch import load_file

        state.update({f"ema/{k}": v for k, v in load_file(str(ema)).items()})
    return state


def straight_and_resumed(make_cfg, out, steps: int) -> tuple:
    """(straight run, resumed run): `steps` steps in one session, and steps - 1 then a resumed one
    (both with decay_steps=steps: one learning-rate schedule)."""
    pinned = (f"train.decay_steps={steps}", "train.save_every=1", "train.resume=true")
    straight = _run(make_cfg(f"{out}/straight", f"train.max_steps={steps}", *pinned))
    _run(make_cfg(f"{out}/resumed", f"train.max_steps={steps - 1}", *pinned))
    resumed = _run(make_cfg(f"{out}/resumed", f"train.max_steps={steps}", *pinned))
    return straight, resumed


def check_resumed(straight, resumed, steps: int) -> None:
    assert resumed.start_step == steps - 1 and resumed.final_step == steps
    assert resumed.losses == straight.losses[-1:], (resumed.losses, straight.losses)
    want, got = _final(straight), _final(resumed)
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(value, got[name]), (name, float((value - got[name]).abs().max()))


def _real_clips(out, *overrides: str):
    from apps.video_gen.config import load_recipe, resolve

    return load_recipe(resolve("apps/video_gen/configs/real_clips.yaml"), [
        *TINY_MODEL, "train.log_every=1", "train.progress_bar=false", "train.plot=false", "train.warmup_steps=0",
        "eval.every=0", "eval.timesteps=2", f"train.output_dir={out}", *overrides])


def test_manifest_clips_resume_mid_epoch_exactly(tmp_path):
    """configs/real_clips.yaml (clips decoded on one DataLoader worker, random offset and crop, two
    captions per video): 2 batches an epoch, so the resume after step 1 is mid-epoch, where the
    resumed run starts a fresh worker."""
    straight, resumed = straight_and_resumed(_real_clips, tmp_path, 2)
    assert straight.final_step == 2
    check_resumed(straight, resumed, 2)


def test_manifest_items_are_a_function_of_seed_epoch_and_index(tmp_path):
    """An item draws the same offset, crop and caption whatever the global RNG (on a worker: whatever
    the worker drew before), and another epoch draws anew."""
    from apps.video_gen.train import prepare

    cfg = _real_clips(tmp_path, "data.buckets=[[4,16,28,1]]")   # 4 of 48 frames: many offsets
    batches = prepare(cfg)[2]
    draws = {}
    for epoch, rng in [(0, 1), (0, 2), (1, 3)]:
        batches.set_epoch(epoch)
        torch.manual_seed(rng)
        draws[epoch, rng] = [batches[k] for k in range(len(batches))]
    for a, b in zip(draws[0, 1], draws[0, 2]):
        assert torch.equal(a["video"], b["video"]) and torch.equal(a["prompt_ids"], b["prompt_ids"])
    assert any(not torch.equal(a["video"], b["video"]) for a, b in zip(draws[0, 1], draws[1, 3]))


def test_fit_tells_the_manifest_batches_their_epoch(tmp_path, monkeypatch):
    """`fit` calls the dataset's `set_epoch` before each pass (phalanx.train.data.MicroBatches), so
    the third step (epoch 1 of 2 batches an epoch) draws new views; loader in-process here."""
    import apps.video_gen.manifest as manifest

    seen, draw = [], manifest.item_generator

    def spy(seed, epoch, index):
        seen.append(epoch)
        return draw(seed, epoch, index)

    monkeypatch.setattr(manifest, "item_generator", spy)
    _run(_real_clips(tmp_path, "train.max_steps=3", "train.num_workers=0"))
    assert seen == [0, 0, 0, 1], seen     # fit's look at item 0 (check_first_sample), then the 3 steps


def _two_ranks(out: str) -> tuple:
    def make(output_dir, *overrides):
        return tiny_config(output_dir, "parallel.sp_size=2", "eval.ema_decay=0.9", "train.eval_every=1", *overrides)

    straight, resumed = straight_and_resumed(make, out, 3)
    check_resumed(straight, resumed, 3)   # raises on the rank that differs
    return straight.losses, resumed.losses


@pytest.mark.slow
def test_recipe_with_sequence_parallel_and_ema_resumes_exactly(tmp_path):
    """The shapes recipe on 2 ranks (sp_size=2: both ranks one replica, drawing the same timesteps,
    noise and caption dropout), with EMA and an evaluation every step: the third step resumed equals
    the straight run's, weights and EMA average too."""
    got = spawn(_two_ranks, 2, str(tmp_path), timeout=600)
    assert got[0] == got[1]
