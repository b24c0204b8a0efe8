"""fp16 with the dynamic loss scaler under DDPPlugin, FSDPPlugin and GeminiPlugin on 2 gloo ranks,
against the same recipe on one process (fp16 model, fp32 masters, loss scale 2^16): losses,
gradient norms and the parameter update; and an overflow under each plugin: the step is skipped
on every rank and the scale backs off. One spawn runs everything (fp16_workers.suite).

Tolerances, in fp16 machine epsilons (eps = 2^-10 ≈ 9.8e-4, an 11-bit significand), with the
worst of the three plugins measured when they were set (the same as ZeRO's in test_zero.py):
- loss and gradient norm, relative: 1 eps. Both are sums over the 128 tokens of the batch whose
  terms were computed in fp16 by kernels that sum in another order on each rank; measured 7e-5
  (loss) and 1.4e-4 (norm; 2.6e-4 on AVX2 kernels) — 0.07 and 0.27 eps.
- update ‖Δgot − Δref‖/‖Δref‖ after 5 AdamW steps: 20 eps. Adam divides each gradient by its
  own running RMS, so an fp16 rounding difference in a near-zero gradient becomes a step of up
  to ±lr; measured 4.6e-3 (DDP, Gemini) and 7.4e-3 (FSDP), 7.8e-3 on AVX2 kernels — up to 8 eps.
  (The fp32 recipe differs from the fp16 reference by 2.9e-2: beyond the tolerance.)
"""
from __future__ import annotations

import pytest
import torch

import fp16_workers as fw
import zero_workers as zw
from phalanx.testing import assert_rel_close, assert_update_close, eps, spawn

EPS16 = eps(torch.float16)
LOSS_RTOL, NORM_RTOL, UPDATE_RTOL = 1 * EPS16, 1 * EPS16, 20 * EPS16


@pytest.fixture(scope="module")
def ranks():
    return spawn(fw.suite, 2, timeout=300)


@pytest.fixture(scope="module")
def reference():
    return zw.reference("fp16")


@pytest.mark.parametrize("plugin", fw.PLUGINS)
def test_fp16_matches_single_process(plugin, ranks, reference):
    result = ranks[0][plugin]
    assert result["logits_dtype"] == "torch.float16"  # the model really computed in fp16
    assert result["skipped"] == [False] * zw.STEPS
    assert result["scale"] == zw.FP16_SCALE  # the loss was scaled (and it never overflowed)
    assert_rel_close(result["losses"], reference["losses"], LOSS_RTOL, f"{plugin} fp16 losses")
    assert_rel_close(result["norms"], reference["norms"], NORM_RTOL, f"{plugin} fp16 grad norms")
    assert_update_close(result["params"], reference["params"], zw.initial_params("fp16"), UPDATE_RTOL,
                        f"{plugin} fp16 update")


@pytest.mark.parametrize("plugin", fw.PLUGINS)
def test_fp16_overflow_skips_the_step_and_backs_off_on_every_rank(plugin, ranks):
    for rank, per_rank in enumerate(ranks):
        result = per_rank[plugin]["overflow"]
        # a loss scale of 2^40 overflows the fp16 gradients everywhere: skipped, scale halved
        assert result["everywhere"] == {"skipped": True, "scale": 2.0**39, "norm": float("inf"),
                                        "params_unchanged": True}, (plugin, rank)
        assert result["next_step"] == {"skipped": False, "params_changed": True, "scale": zw.FP16_SCALE}, (plugin, rank)
        # an inf in rank 0's reduced gradients only: rank 1 must skip too
        assert result["one_rank"] == {"skipped": True, "scale": zw.FP16_SCALE / 2, "params_unchanged": True}, \
            (plugin, rank)
