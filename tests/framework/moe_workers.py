"""What tests/framework/test_moe_training.py runs on each rank: one SGD step of a tiny random
Mixtral / Qwen2-MoE under HybridParallelPlugin (tensor parallel: attention split, the expert
block whole on every rank) against the same step in one process; returns the differences."""
from __future__ import annotations

import torch

import moe_models
from phalanx.device import run_device, to_device
from phalanx.testing import rel_diff, update_diff

SMALL = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)


def _build(family: str):
    from transformers import AutoModelForCausalLM
    width = {"intermediate_size": 16} if family == "mixtral" else {"moe_intermediate_size": 16}
    torch.manual_seed(0)
    config = moe_models.moe_config(family, **SMALL, **width)
    return AutoModelForCausalLM.from_config(config).float()


def tp_step(families: list[str], layouts: dict[str, dict]) -> dict:
    """{layout name: {family: differences}}."""
    return {name: {family: _step(family, layout) for family in families} for name, layout in layouts.items()}


def _step(family: str, layout: dict) -> dict:
    from phalanx.booster import Booster
    from phalanx.booster.plugins.hybrid import HybridParallelPlugin

    batch = torch.randint(5, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = _build(family)
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = ref(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    opt.step()
    booster = Booster(HybridParallelPlugin(**layout))
    model = _build(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, *_ = booster.boost(model, optimizer)
    local = to_device(batch, run_device())
    loss = model(input_ids=local, labels=local).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    state = booster.plugin.full_model_state_dict(model)
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    return {"loss": rel_diff(loss.item(), ref_loss.item()),
            "update": update_diff({k: v.cpu().float() for k, v in state.items()}, want, start),
            "names": sorted(set(want) ^ set(state))}
