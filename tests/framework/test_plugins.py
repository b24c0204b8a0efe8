"""Equivalence of DDPPlugin and FSDPPlugin with single-process training, on 2 and 4 gloo ranks,
plus checkpoints that move between plugins and world sizes.

Tolerances: fp32 losses within 1e-5 relative and parameters within 1e-5 absolute; bf16 losses
within 2e-2 relative (bf16 has an 8-bit mantissa: ~4e-3 per rounding, and the reduction order
differs from one process); the bf16 runs must still track the fp32 reference.
"""
from __future__ import annotations

import pytest
import torch

import plugin_cases as cases
from phalanx.testing import spawn


@pytest.fixture(scope="module")
def reference():
    return cases.single_process_reference()


def _assert_close_losses(got, want, rtol):
    for g, w in zip(got, want):
        assert abs(g - w) <= rtol * abs(w), f"loss {g} vs reference {w} (rtol {rtol})"


def _assert_close_state(got, want, atol):
    for key, value in want.items():
        diff = (got[key].float() - value.float()).abs().max().item()
        assert diff <= atol, f"{key} differs by {diff} (atol {atol})"


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
@pytest.mark.parametrize("world", [2, 4])
def test_plugin_matches_single_process(name, world, reference):
    precisions = ("fp32", "bf16") if world == 2 else ("fp32",)
    result = spawn(cases.equivalence_suite, world, name, precisions, world == 2)[0]
    ref_losses, ref_state = reference
    losses, state = result["fp32"]
    _assert_close_losses(losses, ref_losses, 1e-5)
    _assert_close_state(state, ref_state, 1e-5)
    if "bf16" in result:
        bf_losses, bf_state = result["bf16"]
        _assert_close_losses(bf_losses, ref_losses, 2e-2)
        _assert_close_state(bf_state, ref_state, 5e-2)
    if "accumulate" in result:  # 2 micro-batches with no_sync == the big batch
        acc_losses, acc_state = result["accumulate"]
        _assert_close_losses(acc_losses, ref_losses, 1e-5)
        _assert_close_state(acc_state, ref_state, 1e-5)


def test_checkpoint_moves_between_plugins_and_world_sizes(tmp_path):
    """FSDP on 2 ranks saves; DDP on 1 rank and FSDP on 4 ranks resume: every continuation
    reproduces uninterrupted single-process training."""
    from transformers import AutoModelForCausalLM

    ckpt = str(tmp_path / "step-5")
    spawn(cases.train_and_checkpoint, 2, "fsdp", ckpt)
    ref_losses, _ = cases.single_process_reference(steps=cases.STEPS + 2)
    one = spawn(cases.resume_and_continue, 1, "ddp", ckpt)[0]
    _assert_close_losses(one, ref_losses[cases.STEPS:], 1e-5)
    four = spawn(cases.resume_and_continue, 4, "fsdp", ckpt)[0]
    _assert_close_losses(four, ref_losses[cases.STEPS:], 1e-5)

    # The exported model is a plain Hugging Face directory with sharded safetensors.
    hf_dir = tmp_path / "step-5-hf"
    assert (hf_dir / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
    _, ref_state = cases.single_process_reference(steps=cases.STEPS)
    reference_model = cases.tiny_llama(seed=0)
    reference_model.load_state_dict(ref_state)
    ids = cases.make_batches(1)[0]
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - reference_model(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4
