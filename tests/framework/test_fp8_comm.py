"""FP8-compressed communication (phalanx.amp.fp8_comm): the quantisation error bound, the
reduce-scatter and all-reduce against exact fp32 sums on 2 and 4 gloo ranks, the bytes counted,
and DDP / ZeRO-2 training with `fp8_communication` against one process."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.amp import fp8_comm
from phalanx.testing import spawn


def _values(seed: int, n: int) -> torch.Tensor:
    """Values over six orders of magnitude (gradients are like that), a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 2, (n,), generator=g).float()
    x[::17] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantisation_error_stays_within_half_an_ulp(fmt):
    x = _values(0, 4096)
    scale = fp8_comm.scales_for(x.reshape(1, -1), fmt)[0]
    back = fp8_comm.dequantize(fp8_comm.quantize(x, scale, fmt), scale, fmt)
    err = (back - x).abs()
    bound = fp8_comm.error_bound(x, scale, fmt)
    assert torch.all(err <= bound), f"worst excess {(err - bound).max():.3g}"
    # the bound is the format's: half an ulp (2^-4 relative for e4m3, 2^-3 for e5m2) is reached
    big = x.abs() > x.abs().max() / 16
    relative = (err[big] / x[big].abs()).max().item()
    assert {"e4m3": 2 ** -5, "e5m2": 2 ** -4}[fmt] < relative <= {"e4m3": 2 ** -4, "e5m2": 2 ** -3}[fmt]
    assert torch.equal(back[x == 0], x[x == 0])


def test_an_all_zero_piece_and_bad_formats():
    zeros = torch.zeros(8)
    scale = fp8_comm.scales_for(zeros.reshape(1, -1), "e4m3")[0]
    assert scale == 1.0
    assert torch.equal(fp8_comm.dequantize(fp8_comm.quantize(zeros, scale, "e4m3"), scale, "e4m3"), zeros)
    assert fp8_comm.check_format(True, "X") == "e4m3" and fp8_comm.check_format(False, "X") is None
    with pytest.raises(ValueError, match="fp8_communication='e3m4'.*e4m3"):
        fp8_comm.check_format("e3m4", "DDPPlugin")


def _collectives(fmt: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = [_values(10 + r, 1001) for r in range(world)]  # every rank knows every input
    mine = everyone[rank].clone()

    traffic = fp8_comm.Fp8Traffic()
    fp8_comm.all_reduce_fp8(mine, fmt=fmt, traffic=traffic)
    sizes = [0, 700, 1, 300][:world] if world == 4 else [600, 401]
    part = fp8_comm.reduce_scatter_fp8(everyone[rank].clone(), sizes, None, fmt)
    averaged = everyone[rank].clone()
    fp8_comm.all_reduce_fp8(averaged, fmt=fmt, average=True)
    return {"all_reduce": mine, "part": part, "sizes": sizes, "averaged": averaged,
            "sent": traffic.sent, "uncompressed": traffic.uncompressed}


def _stage_bound(pieces: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """The bound on the error of summing `pieces` after quantising each with its own scale."""
    bound = torch.zeros_like(pieces[0])
    for p in pieces:
        bound += fp8_comm.error_bound(p, fp8_comm.scales_for(p.reshape(1, -1), fmt)[0], fmt)
    return bound


def _requantised_bound(pieces: list[torch.Tensor], exact: torch.Tensor, fmt: str) -> torch.Tensor:
    """The bound after the all-reduce's second quantisation: the partial sum S' (within `first` of
    the exact sum) rounded again with the scale of its own largest magnitude."""
    first = _stage_bound(pieces, fmt)
    relative = 2.0 ** -(fp8_comm._MANTISSA_BITS[fmt] + 1)
    largest = (exact.abs() + first).max()
    return first + (exact.abs() + first) * relative + fp8_comm._SMALLEST_SUBNORMAL[fmt] / 2 * largest / fp8_comm.fp8_max(fmt)


@pytest.mark.parametrize("world,fmt", [(2, "e4m3"), (4, "e5m2")])
def test_fp8_collectives_stay_within_the_bound_of_their_quantisations(world, fmt):
    ranks = spawn(_collectives, world, fmt, timeout=120)
    inputs = [_values(10 + r, 1001) for r in range(world)]
    exact = torch.stack(inputs).sum(0)
    chunk = -(-1001 // world)
    for r, out in enumerate(ranks):
        # reduce-scatter: one quantisation per input copy of this rank's part
        lo = sum(out["sizes"][:r])
        piece = slice(lo, lo + out["sizes"][r])
        bound = _stage_bound([x[piece] for x in inputs], fmt)
        err = (out["part"] - exact[piece]).abs()
        assert torch.all(err <= bound), f"rank {r}: reduce-scatter off by {(err - bound).max():.3g} beyond the bound"
        # all-reduce: the same on equal chunks, then each chunk's sum quantised once more
        bound = torch.cat([_requantised_bound([x[c * chunk:(c + 1) * chunk] for x in inputs],
                                              exact[c * chunk:(c + 1) * chunk], fmt) for c in range(world)])
        err = (out["all_reduce"] - exact).abs()
        assert torch.all(err <= bound), f"rank {r}: all-reduce off by {(err - bound).max():.3g} beyond the bound"
        assert torch.equal(out["all_reduce"], ranks[0]["all_reduce"]), "ranks disagree after the all-reduce"
        torch.testing.assert_close(out["averaged"], out["all_reduce"] / world, rtol=2 ** -3, atol=1e-6)
        # bytes: each phase sends the other ranks' chunks as one byte per value plus one fp32 scale each
        assert out["sent"] == 2 * chunk * (world - 1) + 8 * (world - 1)
        assert out["uncompressed"] == 4 * 2 * chunk * (world - 1)


def _train_with_fp8(name: str, fmt: str | bool) -> dict:
    from plugin_cases import run_plugin

    from phalanx.booster.plugins import make_plugin

    plugin = make_plugin(name, fp8_communication=fmt)
    losses, state = run_plugin(lambda: plugin, steps=5)
    return {"losses": losses, "state": state, "sent": plugin.fp8_traffic.sent,
            "uncompressed": plugin.fp8_traffic.uncompressed}


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_training_with_fp8_communication_follows_one_process(name):
    """2 ranks, 5 AdamW steps of the tiny LLaMA with fp8 gradient traffic against one process on
    the whole batch: the losses agree to 1% and the weight updates to 25%, while the gradients
    moved a quarter of fp32's bytes (plus the scales). fp32 communication matches to ~1e-6
    (test_plugins). Why 25% for updates when one value is off by at most 2^-4: where the two
    ranks' gradients nearly cancel, each copy's rounding (relative to that copy) is large against
    the small sum, and Adam divides every element by its own magnitude, so those elements' updates
    move by much more than 2^-4 (measured 0.14 on the tiny LLaMA after 5 steps)."""
    from plugin_cases import initial_state, single_process_reference

    from phalanx.testing import assert_rel_close, assert_update_close

    ref_losses, ref_state = single_process_reference(steps=5)
    ranks = spawn(_train_with_fp8, 2, name, "e4m3", timeout=300)
    start = initial_state()
    for out in ranks:
        assert_rel_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), 1e-2, "losses")
        assert_update_close(out["state"], ref_state, start, 0.25, "weight updates")
        assert out["sent"] > 0 and 0.25 <= out["sent"] / out["uncompressed"] < 0.26
    assert out["losses"] != ref_losses  # the fp8 path really ran (fp32 would agree to ~1e-6)
