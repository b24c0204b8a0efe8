"""precision=fp8 (phalanx.amp.fp8_linear over torchao's float8 training): refused where the device
has no fp8 matmul, which layers convert, the converted model's output against bf16, and 2-rank
DDP training in fp8 against bf16 on a device that supports it (the emulated GPU in the suite:
tests/emulated/test_fp8_emulated.py runs that test there)."""
from __future__ import annotations

import pytest
import torch

from phalanx.amp.precision import FP8, fp8_device_support, host_fp8_matmul, resolve_precision
from phalanx.testing import boosted_step, spawn, tiny_llama

FP8_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def test_fp8_is_refused_on_a_device_without_fp8_matmuls():
    with pytest.raises(ValueError, match=r"compute capability 8\.9.*the CPU.*precision=bf16"):
        resolve_precision("fp8", "cpu")
    assert FP8.compute_dtype == torch.bfloat16 and FP8.mixed and FP8.fp8_linears and not FP8.loss_scaling


@pytest.mark.skipif(not host_fp8_matmul(), reason="this CPU's kernels do not multiply fp8 reliably (AVX2 oneDNN: "
                    "phalanx.amp.precision.host_fp8_matmul); the conversion is checked where they do")
def test_the_projections_convert_and_the_head_stays_in_bf16():
    from phalanx.amp.fp8_linear import convert_linears_to_fp8, fp8_layers

    model = tiny_llama(seed=0, **FP8_SIZES).to(torch.bfloat16)
    reference = tiny_llama(seed=0, **FP8_SIZES).to(torch.bfloat16)
    converted = convert_linears_to_fp8(model)
    per_layer = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert set(converted) == {f"model.layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert fp8_layers(model) == converted and "lm_head" not in converted
    assert set(model.state_dict()) == set(reference.state_dict())  # checkpoints keep their names

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits.float(), reference(input_ids=ids).logits.float()
    # fp8 rounds each matmul input to 3 mantissa bits (2^-4 relative): the logits move, by a few %
    err = ((got - want).norm() / want.norm()).item()
    assert 1e-3 < err < 0.1, err


def test_a_model_with_no_eligible_layer_is_refused():
    from phalanx.amp.fp8_linear import convert_linears_to_fp8

    with pytest.raises(ValueError, match="multiples of 16"):
        convert_linears_to_fp8(torch.nn.Sequential(torch.nn.Linear(10, 12)))


def _train(precision: str, plugin: str = "ddp") -> dict:
    import torch.distributed as dist

    from phalanx.amp.fp8_linear import fp8_layers
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin
    from phalanx.device import run_device, to_device

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama(seed=0, **FP8_SIZES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    booster = Booster(make_plugin(plugin, precision=precision))
    model, optimizer, *_ = booster.boost(model, optimizer)
    batch = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))  # learnt by heart
    losses = []
    for _ in range(6):
        loss = boosted_step(booster, model, optimizer, to_device(batch.chunk(world)[rank], run_device()))
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "fp8_layers": len(fp8_layers(booster.unwrap(model)))}


def _train_each(runs: list[tuple[str, str]]) -> dict:
    """One set of ranks trains each (precision, plugin) in turn (one spawn: ranks start once)."""
    return {f"{precision}-{plugin}": _train(precision, plugin) for precision, plugin in runs}


@pytest.mark.skipif(not fp8_device_support()[0], reason="no fp8-capable device here (the emulated GPU runs this test: "
                    "tests/emulated/test_fp8_emulated.py)")
def test_fp8_training_follows_bf16_on_two_ranks():
    """2 ranks (DDP, ZeRO-2, FSDP2), 6 AdamW steps of the tiny LLaMA on one batch: precision=fp8
    starts within 1% of bf16's loss (the forward's fp8 rounding alone) and tracks it within 3% as
    both learn the batch (measured under the emulated GPU: 0.01% at the start, at most 1.0%), with
    every projection running in fp8. bf16's reference is DDP's (the plugins agree in bf16 to
    rounding: test_plugins)."""
    plugins = ("ddp", "zero2", "fsdp")
    out = spawn(_train_each, 2, [("bf16", "ddp"), *[("fp8", p) for p in plugins]], timeout=900)[0]
    want = torch.tensor(out["bf16-ddp"]["losses"])
    assert out["bf16-ddp"]["fp8_layers"] == 0 and want[-1] < 0.75 * want[0]
    for plugin in plugins:
        run = out[f"fp8-{plugin}"]
        got = torch.tensor(run["losses"])
        assert run["fp8_layers"] == 14, plugin
        relative = (got - want).abs() / want
        assert relative[0] < 0.01 and torch.all(relative < 0.03), (plugin, got, want)
        assert not torch.equal(got, want)
        assert got[-1] < 0.75 * got[0], plugin  # it learns the batch


def test_plugins_that_place_linears_themselves_refuse_fp8(monkeypatch):
    """Gemini and the hybrid plugin are refused with the plugins that work named (checked before
    any conversion, on a device that would otherwise take fp8)."""
    import phalanx.amp.precision as precision
    from phalanx.booster import Booster
    from phalanx.booster.plugins import make_plugin

    monkeypatch.setattr(precision, "fp8_device_support", lambda device=None: (True, "a test device"))
    booster = Booster(make_plugin("gemini", precision=FP8))
    model = tiny_llama(seed=0, **FP8_SIZES)
    with pytest.raises(ValueError, match="ddp, zero1, zero2, fsdp plugins; gemini"):
        booster.boost(model, torch.optim.AdamW(model.parameters()))
    assert not any("Float8" in type(m).__name__ for m in model.modules())
