"""phalanx.train.EMA: the update formula, warm-up, swapping, checkpoints, and data parallelism."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.train import EMA


def test_ema_update_follows_the_formula_with_warmup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    model[1].weight.requires_grad_(False)  # frozen parameters are not averaged
    ema = EMA(decay=0.9, warmup=True).bind(model)
    expected = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for n_update in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = min(0.9, (1 + n_update) / (10 + n_update))
        assert ema.current_decay() == pytest.approx(d)
        ema.update()
        for n, p in model.named_parameters():
            if n in expected:
                expected[n] = d * expected[n] + (1 - d) * p.detach()
    got = ema.full_state_dict()
    assert set(got) == set(expected) and "1.weight" not in got
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-6)


def test_swapped_uses_the_average_and_restores_the_weights(tmp_path):
    model = nn.Linear(3, 2)
    ema = EMA(decay=0.5, warmup=False).bind(model)
    trained = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()  # average = 0.5 * old + 0.5 * (old + 1) = old + 0.5
    now = model.weight.detach().clone()
    with ema.swapped():
        torch.testing.assert_close(model.weight.detach(), trained + 0.5)
    torch.testing.assert_close(model.weight.detach(), now)

    ema.save(tmp_path / "ema")
    other = EMA(decay=0.5, warmup=False).bind(model)
    other.load(tmp_path / "ema")
    assert other.num_updates == 1
    torch.testing.assert_close(other.full_state_dict()["weight"], trained + 0.5)


def test_bad_decay_and_unbound_use_fail_clearly():
    with pytest.raises(ValueError, match="decay"):
        EMA(decay=1.0)
    with pytest.raises(RuntimeError, match="bind"):
        EMA().update()



def _ema_ranks(config: str, overrides: list[str]) -> dict:
    """One rank: 2 steps of the tiny recipe with EMA; this rank's EMA and the weights it tracks."""
    import torch.distributed as dist

    from apps.diffusion.config import load_recipe
    from apps.diffusion.train_text_to_image import train

    cfg = load_recipe(config, overrides)
    result, _ = train(cfg)
    ema_file = result.checkpoint_dir / "ema" / "ema.safetensors"
    from safetensors.torch import load_file
    return {"rank": dist.get_rank(), "ema": load_file(str(ema_file)),
            "model": load_file(str(result.checkpoint_dir / "model" / "model.safetensors"))}


@pytest.mark.parametrize("plugin", ["zero2", "fsdp"])
def test_ema_under_data_parallelism_tracks_the_synchronised_weights(tmp_path, plugin):
    """2 ranks: after each step every rank holds the same weights, so the EMA (updated from them,
    with no communication) is the same on both and follows the saved weights."""
    from phalanx.testing import spawn

    from diffusion_tiny import TINY, TINY_MODEL, TINY_RUN

    overrides = [*TINY_MODEL, *TINY_RUN, "train.max_steps=2", "train.micro_batch_size=2", f"train.plugin={plugin}",
                 "validation.prompts=[]", "ema.decay=0.5", "model.train_text_encoder=false",
                 f"train.output_dir={tmp_path}"]
    ranks = spawn(_ema_ranks, 2, str(TINY), overrides, timeout=300)
    ema0, ema1 = ranks[0]["ema"], ranks[1]["ema"]
    assert ema0.keys() == ema1.keys() and len(ema0) > 10
    for k in ema0:
        assert torch.equal(ema0[k], ema1[k]), f"EMA of {k} differs between ranks"
    # EMA params are the trainable ones (the UNet); the frozen text encoder is not averaged.
    assert all(k.startswith("unet.") for k in ema0)
    model = ranks[0]["model"]
    moved = [k for k in ema0 if not torch.equal(ema0[k], model[k])]
    assert moved, "with decay 0.5 after 2 steps the average must lag the weights"
