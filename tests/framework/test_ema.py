"""phalanx.train.EMA under GeminiPlugin on 2 gloo ranks: the average is exactly the running
average (lerp for lerp) of the fp32 master weights seen at bind and after each step, it is the
same on both ranks, `swapped()` really runs the model on it and restores the trained weights, and
it survives a save/load. (DDP/ZeRO/FSDP2 are checked the same way in
tests/apps/diffusion/test_diffusion_ema.py.)

Gemini keeps every parameter in chunks sharded over the ranks; between steps a parameter is a
one-element placeholder, so the average has to follow this rank's part of the fp32 masters.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.testing import spawn, tiny_llama

STEPS, DECAY = 3, 0.5
CHUNK_MB = 0.01  # ~2.6k fp32 elements: the tiny model (~27k parameters) spreads over ~12 chunks


def _gemini_ema(directory: str, shard_param_frac: float) -> dict:
    import torch.distributed as dist

    from phalanx.booster import Booster
    from phalanx.booster.plugins.gemini import GeminiPlugin
    from phalanx.train import EMA

    rank, world = dist.get_rank(), dist.get_world_size()
    booster = Booster(GeminiPlugin(precision="fp32", placement_policy="static", chunk_size_mb=CHUNK_MB,
                                   shard_param_frac=shard_param_frac))
    model = tiny_llama(seed=0)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    names = [n for n, _ in model.unwrapped.named_parameters()]

    def weights() -> dict[str, torch.Tensor]:
        state = booster.plugin.full_model_state_dict(model)  # the fp32 masters, gathered
        return {n: state[n].float().clone() for n in names}

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (4, 16), generator=g) for _ in range(STEPS)]
    ema = EMA(decay=DECAY, warmup=True).bind(model)
    seen, decays = [weights()], []
    for batch in batches:
        local = batch.chunk(world)[rank]
        booster.backward(model(input_ids=local, labels=local).loss, opt)
        opt.step()
        opt.zero_grad()
        decays.append(ema.current_decay())
        ema.update()
        seen.append(weights())
    average = ema.full_state_dict()
    probe = batches[0][:2]
    with torch.no_grad():
        trained_logits = model(input_ids=probe).logits
        with ema.swapped():
            swapped_logits = model(input_ids=probe).logits
            weights_inside = weights()
        after_logits = model(input_ids=probe).logits
    ema.save(Path(directory))
    dist.barrier()
    other = EMA(decay=DECAY).bind(model)
    other.load(Path(directory))
    return {"seen": seen, "decays": decays, "average": average, "trained_logits": trained_logits,
            "swapped_logits": swapped_logits, "after_logits": after_logits, "weights_inside": weights_inside,
            "weights_after": weights(), "reloaded": other.full_state_dict(), "reloaded_updates": other.num_updates,
            "chunks": len(booster.plugin.manager.chunks)}


def _averaged_model_logits(average: dict, probe: torch.Tensor) -> torch.Tensor:
    model = tiny_llama(seed=0)
    model.load_state_dict(average, strict=False)
    with torch.no_grad():
        return model(input_ids=probe).logits


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemini-ema")
    return spawn(_gemini_sweep, 2, str(root), timeout=300)


def _gemini_sweep(root: str) -> dict:
    # all chunks sharded; and half of them replicated on every rank (shard_param_frac=0.5)
    return {frac: _gemini_ema(f"{root}/frac{frac}", frac) for frac in (1.0, 0.5)}


@pytest.mark.parametrize("frac", [1.0, 0.5])
def test_ema_under_gemini_is_the_running_average_of_the_masters(ranks, frac):
    for r in ranks:
        result = r[frac]
        seen, decays, average = result["seen"], result["decays"], result["average"]
        assert result["chunks"] > 4 and len(seen) == STEPS + 1 and len(decays) == STEPS
        assert set(average) == set(seen[0])
        assert all(not torch.equal(seen[-1][k], seen[0][k]) for k in average), "training left a weight unchanged"
        for k in average:  # lerp for lerp, on the weights this rank saw
            expected = seen[0][k]
            for decay, w in zip(decays, seen[1:], strict=True):
                expected = expected.lerp(w[k], 1.0 - decay)
            assert torch.equal(average[k], expected), f"EMA of {k} is not the running average of the weights"
    for k in ranks[0][frac]["average"]:  # the ranks hold one average (each rank its shards of it)
        assert torch.equal(ranks[0][frac]["average"][k], ranks[1][frac]["average"][k]), k


@pytest.mark.parametrize("frac", [1.0, 0.5])
def test_ema_swapped_and_reload_under_gemini(ranks, frac):
    for r in ranks:
        result = r[frac]
        average = result["average"]
        # inside swapped() the model computes with the average, then the trained weights return
        for k, v in result["weights_inside"].items():
            assert torch.equal(v, average[k]), k
        for k, v in result["weights_after"].items():
            assert torch.equal(v, result["seen"][-1][k]), k
        g = torch.Generator().manual_seed(5)
        probe = torch.randint(0, 128, (4, 16), generator=g)[:2]
        torch.testing.assert_close(result["swapped_logits"], _averaged_model_logits(average, probe),
                                   rtol=1e-5, atol=1e-5)
        assert not torch.allclose(result["swapped_logits"], result["trained_logits"], atol=1e-3)
        assert torch.equal(result["after_logits"], result["trained_logits"])
        assert result["reloaded_updates"] == STEPS
        for k, v in result["reloaded"].items():
            assert torch.equal(v, average[k]), k
