"""Equivalence of DDPPlugin and FSDPPlugin with single-process training, on 2 and 4 gloo ranks,
plus checkpoints that move between plugins and world sizes.

Measures of phalanx.testing (rel errors of losses; the update measure of the weights after the
5 AdamW steps, Δ from the initial weights). fp32, the same computation in another order: losses
within rounding_rtol (8·eps·√128 = 1.1e-5), weights within ADAMW_UPDATE_RTOL (1e-4). bf16 (fp32
master weights) against the same recipe on one process: LOW_PRECISION_RTOL, in units of bf16's
eps. docs/booster.md has the measured values.
"""
from __future__ import annotations

import pytest
import torch

import plugin_cases as cases
from phalanx.testing import ADAMW_UPDATE_RTOL, LOW_PRECISION_RTOL, check, rel_diff, rounding_rtol, update_diff
from spawn_batch import spawn_suites

TOKENS = cases.GLOBAL_BATCH * cases.SEQ  # the longest reduction behind a loss or a weight gradient
FP32_LOSS_RTOL = rounding_rtol(torch.float32, TOKENS)
BF16_LOSS_RTOL, _, BF16_UPDATE_RTOL = LOW_PRECISION_RTOL[torch.bfloat16]


@pytest.fixture(scope="module")
def reference():
    return cases.single_process_reference()


@pytest.fixture(scope="module")
def bf16_reference():
    return cases.single_process_reference(precision="bf16")


PLUGINS, WORLDS = ("ddp", "fsdp"), (2, 4)
EQUIVALENCE, CHECKPOINT = "test_plugin_matches_single_process", "test_checkpoint_moves_between_plugins_and_world_sizes"
CLIPPING = "test_clipping_matches_single_process"
MAX_NORM = 0.05  # below every step's gradient norm here: every step clips


@pytest.fixture(scope="module")
def clipped_reference():
    return cases.single_process_reference(max_norm=MAX_NORM)


@pytest.fixture(scope="module")
def spawned(request, tmp_path_factory):
    """The rank bodies of every test, one spawn per world size (spawn_batch: rank start-up costs
    seconds), in order: 2 ranks save the checkpoint that 1 and 4 ranks then resume."""
    root = tmp_path_factory.mktemp("plugins")
    ckpt = str(root / "step-5")
    by_world: dict[int, dict] = {2: {}, 1: {}, 4: {}}
    for world in WORLDS:
        for name in PLUGINS:
            precisions = ("fp32", "bf16") if world == 2 else ("fp32",)
            by_world[world][f"{EQUIVALENCE}[{world}-{name}]"] = (cases.equivalence_suite,
                                                                 (name, precisions, world == 2), {})
    for name in PLUGINS:
        by_world[2][f"{CLIPPING}[{name}]"] = (cases.equivalence_suite, (name, ("fp32",), False, MAX_NORM), {})
    by_world[2][f"{CHECKPOINT}:save"] = (cases.train_and_checkpoint, ("fsdp", ckpt), {})
    by_world[1][f"{CHECKPOINT}:ddp1"] = (cases.resume_and_continue, ("ddp", ckpt), {})
    by_world[4][f"{CHECKPOINT}:fsdp4"] = (cases.resume_and_continue, ("fsdp", ckpt), {})
    return root, {world: spawn_suites(request, world, suites, timeout=720) for world, suites in by_world.items()}


def _assert_close(got: tuple, want: tuple, loss_rtol: float, update_rtol: float, what: str) -> None:
    (losses, state), (ref_losses, ref_state) = got, want
    check(rel_diff(losses, ref_losses), loss_rtol, f"{what}: losses")
    check(update_diff(state, ref_state, cases.initial_state()), update_rtol, f"{what}: weights")


@pytest.mark.parametrize("name", PLUGINS)
@pytest.mark.parametrize("world", WORLDS)
def test_plugin_matches_single_process(name, world, reference, bf16_reference, spawned):
    result = spawned[1][world].get(f"{EQUIVALENCE}[{world}-{name}]")[0]
    assert set(result) == ({"fp32", "bf16", "accumulate"} if world == 2 else {"fp32"})
    where = f"{name} on {world} ranks"
    _assert_close(result["fp32"], reference, FP32_LOSS_RTOL, ADAMW_UPDATE_RTOL, f"{where}, fp32")
    if "bf16" in result:
        _assert_close(result["bf16"], bf16_reference, BF16_LOSS_RTOL, BF16_UPDATE_RTOL, f"{where}, bf16")
    if "accumulate" in result:  # 2 micro-batches with no_sync == the big batch
        _assert_close(result["accumulate"], reference, FP32_LOSS_RTOL, ADAMW_UPDATE_RTOL, f"{where}, accumulation")


@pytest.mark.parametrize("name", PLUGINS)
def test_clipping_matches_single_process(name, clipped_reference, spawned):
    """Clipping by the global norm (the factor applied inside torch's fused AdamW kernel,
    `phalanx.amp.fused_step`) against torch's clip_grad_norm_ before a plain AdamW step."""
    result = spawned[1][2].get(f"{CLIPPING}[{name}]")[0]
    _assert_close(result["fp32"], clipped_reference, FP32_LOSS_RTOL, ADAMW_UPDATE_RTOL, f"{name}, clipped")


def test_checkpoint_moves_between_plugins_and_world_sizes(spawned):
    """FSDP on 2 ranks saves; DDP on 1 rank and FSDP on 4 ranks resume: every continuation
    reproduces uninterrupted single-process training."""
    from transformers import AutoModelForCausalLM

    tmp_path, by_world = spawned
    by_world[2].get(f"{CHECKPOINT}:save")
    ref_losses, _ = cases.single_process_reference(steps=cases.STEPS + 2)
    one = by_world[1].get(f"{CHECKPOINT}:ddp1")[0]
    check(rel_diff(one, ref_losses[cases.STEPS:]), FP32_LOSS_RTOL, "fsdp on 2 ranks -> ddp on 1 rank: losses")
    four = by_world[4].get(f"{CHECKPOINT}:fsdp4")[0]
    check(rel_diff(four, ref_losses[cases.STEPS:]), FP32_LOSS_RTOL, "fsdp on 2 ranks -> fsdp on 4 ranks: losses")

    # The exported model is a plain Hugging Face directory with sharded safetensors.
    hf_dir = tmp_path / "step-5-hf"
    assert (hf_dir / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(hf_dir)
    _, ref_state = cases.single_process_reference(steps=cases.STEPS)
    initial_model = cases.tiny_llama(seed=0)
    reference_model = cases.tiny_llama(seed=0)
    reference_model.load_state_dict(ref_state)
    ids = cases.make_batches(1)[0]
    with torch.no_grad():  # logits after 5 AdamW steps: their update measure
        logits = {name: m(input_ids=ids).logits for name, m in
                  (("got", loaded), ("want", reference_model), ("start", initial_model))}
    check(update_diff(logits["got"], logits["want"], logits["start"]), ADAMW_UPDATE_RTOL,
          "exported Hugging Face model: logits")


def test_ranks_per_replica_is_validated():
    from phalanx.booster.plugins.ddp import DDPPlugin

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="ranks_per_replica"):
            DDPPlugin(ranks_per_replica=bad)
    assert DDPPlugin(ranks_per_replica=2).ranks_per_replica == 2  # the split itself: tests/apps/protein (DAP through fit)
