"""LoRA on a lazy base (phalanx.booster.lora + phalanx.lazy): `enable_lora` on a model built on the
meta device makes only the adapters real, and each plugin reads this rank's pieces of the base
from its checkpoint when it boosts — so a base larger than one rank's memory can take adapters.

Compared with plain peft on the eagerly loaded model in one process (lora_workers.single_process_
reference, the same seed): losses within rounding_rtol(fp32, tokens of a batch), adapter weights by
the update measure within ADAMW_UPDATE_RTOL, the base equal to the checkpoint bit for bit after
training. How much of the base each rank read is counted (CheckpointSource.elements_read).
"""
from __future__ import annotations

import pytest
import torch

import lora_workers as lw
import plugin_cases as cases
from phalanx.testing import ADAMW_UPDATE_RTOL, check, rel_diff, rounding_rtol, tiny_llama, update_diff
from spawn_batch import spawn_suites

pytest.importorskip("peft")

FP32_LOSS_RTOL = rounding_rtol(torch.float32, cases.GLOBAL_BATCH * cases.SEQ)
# fsdp: each rank reads its rows of every tensor; hybrid tp2: its tensor-parallel slices (the norms
# and the key/value projections whole); ddp / zero2 keep the whole base on every rank by design.
LAYOUTS = {"ddp": ("ddp", {}), "zero2": ("zero2", {}), "fsdp": ("fsdp", {}), "tp2": ("hybrid", {"tp_size": 2})}
READ_AT_MOST = {"ddp": 1.0, "zero2": 1.0, "fsdp": 0.55, "tp2": 0.55}  # of the base's elements, per rank
SUITE = "test_lazy_base_lora_matches_single_process"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lazy-lora") / "base"
    tiny_llama(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def spawned(request, checkpoint):
    suites = {f"{SUITE}[{layout}]": (lw.run_lazy_lora, (plugin, checkpoint), kwargs)
              for layout, (plugin, kwargs) in LAYOUTS.items()}
    return spawn_suites(request, 2, suites, timeout=600)


def test_lazy_base_takes_the_adapters_of_an_eager_one(checkpoint):
    """One process: the adapters drawn on a lazy base are those of the eager base (same seed: peft
    draws on the host and moves them to the meta device, so they are drawn again into real
    storage), the base stays on the meta device until materialised, then equals the checkpoint."""
    from phalanx import lazy

    model = lw.lazy_lora_model(checkpoint)
    base = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(p.is_meta for n, p in model.named_parameters() if n in base)
    assert not any(p.is_meta for p in model.parameters() if p.requires_grad)
    assert {n: p for n, p in model.named_parameters() if p.requires_grad}.keys() == lw.initial_adapter_state().keys()
    for n, want in lw.initial_adapter_state().items():
        assert torch.equal(dict(model.named_parameters())[n], want), n
    lazy.materialize(model)
    eager = lw.lora_model()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=lw.PROBE).logits, eager(input_ids=lw.PROBE).logits,
                                   rtol=0, atol=0)


def test_lazy_random_base_draws_what_it_draws_without_adapters():
    """Random initialisation of a lazy LoRA model: the base gets the values the same lazy model
    without adapters gets (the adapters' layers draw nothing from the base's streams)."""
    from phalanx import lazy
    from phalanx.booster.lora import enable_lora
    from phalanx.lazy.sources import RandomInitSource
    from phalanx.shard.tensor_parallel import materialise_params

    def materialised(model):
        source = RandomInitSource(model, seed=7)
        materialise_params(model, source)
        lazy.materialise_buffers(model, source)
        return model

    config = tiny_llama(seed=0).config
    plain = materialised(lazy.from_config(config))
    adapted = materialised(enable_lora(lazy.from_config(config), lw.lora_config()))
    want = dict(plain.named_parameters())
    for name, p in adapted.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, want[name.replace("base_model.model.", "").replace(".base_layer.", ".")]), name


def test_lazy_base_refuses_adapters_that_read_the_base():
    import peft

    from phalanx import lazy
    from phalanx.booster.lora import enable_lora

    model = lazy.from_config(tiny_llama(seed=0).config)
    with pytest.raises(ValueError, match="DoRA.*materialise the base first"):
        enable_lora(model, peft.LoraConfig(r=4, target_modules=lw.TARGETS, use_dora=True))
    with pytest.raises(ValueError, match="init_lora_weights='pissa'"):
        enable_lora(lazy.from_config(tiny_llama(seed=0).config),
                    peft.LoraConfig(r=4, target_modules=lw.TARGETS, init_lora_weights="pissa"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lazy_base_lora_matches_single_process(layout, spawned):
    ranks = spawned.get(f"{SUITE}[{layout}]")
    ref_losses, ref_state, _ = lw.single_process_reference()
    base_numel = sum(p.numel() for p in tiny_llama(seed=0).parameters())
    for got in ranks:
        assert got["meta_before"] > 0, "the base was not lazy when boosted"
        check(rel_diff(got["losses"], ref_losses), FP32_LOSS_RTOL, f"{layout}, lazy base + LoRA: losses")
        check(update_diff(got["adapters"], ref_state, lw.initial_adapter_state()), ADAMW_UPDATE_RTOL,
              f"{layout}, lazy base + LoRA: adapter weights")
        assert got["frozen_moved"] == 0.0, f"{layout}: the base differs from its checkpoint by {got['frozen_moved']}"
        assert 0 < got["elements_read"] <= READ_AT_MOST[layout] * base_numel, (got["elements_read"], base_numel)
    print(f"{layout}: each rank read {[g['elements_read'] for g in ranks]} of the base's {base_numel} elements")


def test_gemini_refuses_a_lazy_lora_base(checkpoint):
    """Gemini's chunks hold the adapters only; the frozen lazy base would never be read: refused
    before anything is placed, naming the fixes."""
    from phalanx.booster import Booster
    from phalanx.booster.plugins import GeminiPlugin

    booster = Booster(plugin=GeminiPlugin())
    model = lw.lazy_lora_model(checkpoint, booster.enable_lora)
    with pytest.raises(ValueError, match="lazy.*materialize.*FSDPPlugin"):
        booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
