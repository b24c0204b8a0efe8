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
    """One rank: 2 steps of the tiny recipe with EMA. Returns this rank's own average (gathered
    from its shards under FSDP) and the full weights it was updated from: at bind, then after each
    step (recorded by the hook itself, on this rank, before anything is saved)."""
    import apps.diffusion.recipe as recipe
    from apps.diffusion.config import load_recipe
    from apps.diffusion.train_text_to_image import train
    from phalanx.train import EMA

    seen: dict = {}

    def full_weights(ema):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
                for n, p in zip(ema._names, ema._params, strict=True)}

    class RecordingEMA(EMA):
        def bind(self, model):
            out = super().bind(model)
            seen["weights"], seen["decays"] = [full_weights(self)], []
            return out

        def update(self):
            seen["decays"].append(self.current_decay())
            super().update()
            seen["weights"].append(full_weights(self))
            seen["average"] = self.full_state_dict()  # a collective under FSDP: every rank updates

    make_ema = recipe.make_ema
    recipe.make_ema = lambda cfg: RecordingEMA(decay=cfg.ema.decay, warmup=cfg.ema.warmup)
    try:
        train(load_recipe(config, overrides))
    finally:
        recipe.make_ema = make_ema
    return seen


@pytest.mark.parametrize("plugin", ["zero2", "fsdp"])
def test_ema_under_data_parallelism_tracks_the_synchronised_weights(tmp_path, plugin):
    """2 ranks: each rank's own average (FSDP: its shards, gathered) is exactly the running average
    of the weights it saw at bind and after each step, and after each step every rank holds the
    same weights, so the same average."""
    from phalanx.testing import spawn

    from diffusion_tiny import TINY, TINY_MODEL, TINY_RUN

    overrides = [*TINY_MODEL, *TINY_RUN, "train.max_steps=2", "train.micro_batch_size=2", f"train.plugin={plugin}",
                 "validation.prompts=[]", "ema.decay=0.5", "model.train_text_encoder=false",
                 f"train.output_dir={tmp_path}"]
    ranks = spawn(_ema_ranks, 2, str(TINY), overrides, timeout=300)
    for r in ranks:
        weights, decays, average = r["weights"], r["decays"], r["average"]
        assert len(weights) == 3 and len(decays) == 2 and len(average) > 10
        # EMA params are the trainable ones (the UNet); the frozen text encoder is not averaged.
        assert all(k.startswith("unet.") for k in average)
        assert any(not torch.equal(weights[2][k], weights[0][k]) for k in average), "training moved no weight"
        for k in average:  # the running average of the weights this rank saw, lerp for lerp
            expected = weights[0][k]
            for decay, w in zip(decays, weights[1:], strict=True):
                expected = expected.lerp(w[k], 1.0 - decay)
            assert torch.equal(average[k], expected), f"EMA of {k} is not the average of the weights"
    # every rank saw the same (synchronised) weights, so every rank holds the same average
    for k in ranks[0]["average"]:
        assert torch.equal(ranks[0]["average"][k], ranks[1]["average"][k]), f"EMA of {k} differs between ranks"
        assert torch.equal(ranks[0]["weights"][2][k], ranks[1]["weights"][2][k]), k
