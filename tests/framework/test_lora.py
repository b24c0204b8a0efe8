"""LoRA through the Booster (phalanx.booster.lora): `booster.enable_lora` + each plugin on 2 gloo
ranks against plain peft on one process, and the saved adapter / merged model.

Tolerances as tests/framework/test_plugins.py (fp32, the same computation in another order):
losses within rounding_rtol(fp32, tokens of a batch), adapter weights by the update measure (Δ from
the initial adapters) within ADAMW_UPDATE_RTOL. The frozen base must come back bit-identical, and
only the adapters may hold optimizer state (ZeRO: only they are in its flat partitions).
"""
from __future__ import annotations

import pytest
import torch

import lora_workers as lw
import plugin_cases as cases
from phalanx.testing import ADAMW_UPDATE_RTOL, check, rel_diff, rounding_rtol, update_diff, tiny_llama
from spawn_batch import spawn_suites

pytest.importorskip("peft")

FP32_LOSS_RTOL = rounding_rtol(torch.float32, cases.GLOBAL_BATCH * cases.SEQ)
PLUGINS = ("ddp", "zero1", "zero2", "fsdp", "gemini", "hybrid")
PLUGIN_KWARGS = {"hybrid": {"zero_stage": 2}}  # data parallel + ZeRO-2 inside HybridParallelPlugin
SUITE, RESUME = "test_lora_plugin_matches_single_process", "test_lora_checkpoint_resumes_exactly"
RESUMED = ("zero2", "fsdp", "gemini")
# Tensor parallelism splits the adapters with their base layers (phalanx.shard.lora_tp): on 2 ranks
# tp2 (key/value heads split: 2 over 2 ranks) and tp2 with split-gather sequence parallelism; on 4
# ranks tp4 (2 key/value heads replicated over 4 ranks) and tp2 x dp2 under ZeRO-2.
TP_LAYOUTS = {"tp2": {"tp_size": 2}, "tp2_split_gather": {"tp_size": 2, "sequence_parallelism": "split_gather"},
              "pp2": {"pp_size": 2, "num_microbatches": 2}}
TP_LAYOUTS_4 = {"tp4": {"tp_size": 4}, "tp2_dp2_zero2": {"tp_size": 2, "zero_stage": 2}}
TP_SUITE = "test_lora_tensor_parallel_matches_single_process"


@pytest.fixture(scope="module")
def reference():
    return lw.single_process_reference()


@pytest.fixture(scope="module")
def spawned(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    suites = {f"{SUITE}[{name}]": (lw.run_lora, (name, str(root / name)), PLUGIN_KWARGS.get(name, {})) for name in PLUGINS}
    for layout, kwargs in TP_LAYOUTS.items():
        suites[f"{TP_SUITE}[{layout}]"] = (lw.run_lora, ("hybrid", str(root / layout)), kwargs)
    suites["test_lora_adapters_split_with_their_base_layers"] = (lw.lora_split_pieces, ("hybrid",), {"tp_size": 2})
    suites["test_every_rank_starts_from_rank_0s_adapters"] = (lw.adapters_after_unequal_seeds, (), {})
    for name in RESUMED:
        suites[f"{RESUME}[{name}]"] = (lw.resume_lora, (name, str(root / f"resume-{name}")), {})
    return root, spawn_suites(request, 2, suites, timeout=600)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=lw.PROBE).logits


@pytest.fixture(scope="module")
def spawned_4(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora4")
    suites = {f"{TP_SUITE}_on_4_ranks[{layout}]": (lw.run_lora, ("hybrid", str(root / layout)), kwargs)
              for layout, kwargs in TP_LAYOUTS_4.items()}
    return root, spawn_suites(request, 4, suites, timeout=600)


def _check_trained(what: str, got: dict, reference) -> None:
    """Losses, trained adapters and the untouched base against plain peft on one process."""
    ref_losses, ref_state, _ = reference
    check(rel_diff(got["losses"], ref_losses), FP32_LOSS_RTOL, f"{what} + LoRA: losses")
    check(update_diff(got["adapters"], ref_state, lw.initial_adapter_state()), ADAMW_UPDATE_RTOL,
          f"{what} + LoRA: adapter weights")
    assert got["frozen_moved"] == 0.0, f"{what}: the frozen base changed by {got['frozen_moved']}"


def _check_saved(directory, reference) -> None:
    """The adapter in PEFT's format (opened by peft on a fresh base) and the merged model (opened by
    transformers) give the trained reference's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    want = _logits(reference[2])
    assert (directory / "adapter" / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0), str(directory / "adapter"))
    torch.testing.assert_close(_logits(loaded), want, rtol=1e-4, atol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(str(directory / "merged"), dtype=torch.float32)
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", PLUGINS)
def test_lora_plugin_matches_single_process(name, reference, spawned):
    root, results = spawned
    got = results.get(f"{SUITE}[{name}]")[0]
    ref_state = reference[1]
    _check_trained(name, got, reference)
    adapter_numel = sum(v.numel() for v in ref_state.values())
    # Only the adapters have optimizer state: whole on each DDP rank, split over the ranks otherwise.
    states = [r["state_numel"] for r in results.get(f"{SUITE}[{name}]")]
    if name == "ddp":
        assert states == [adapter_numel] * 2
    elif name == "gemini":  # its chunks (fp32 masters, Adam moments, gradients) hold the adapters alone
        assert got["chunked"] == got["adapter_names"]
    else:
        assert adapter_numel <= sum(states) <= adapter_numel + 64 * len(ref_state), states
    if name in ("ddp", "fsdp"):
        assert got["in_optimizer"] == len(ref_state)
    if name.startswith("zero") or name == "hybrid":
        assert got["zero_params"] == got["adapter_names"]

    _check_saved(root / name, reference)


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_lora_tensor_parallel_matches_single_process(layout, reference, spawned):
    """Adapters split with their base layers over tp ranks train as one process does, and save
    whole (PEFT format and merged)."""
    root, results = spawned
    ranks = results.get(f"{TP_SUITE}[{layout}]")
    assert ranks[0].get("complete", True)
    for got in ranks:  # every rank that gathered the full model holds the same result
        if got.get("complete", True):
            _check_trained(layout, got, reference)
        else:  # a later pipeline stage: its losses only
            check(rel_diff(got["losses"], reference[0]), FP32_LOSS_RTOL, f"{layout} + LoRA: losses on a later stage")
    _check_saved(root / layout, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", TP_LAYOUTS_4)
def test_lora_tensor_parallel_matches_single_process_on_4_ranks(layout, reference, spawned_4):
    root, results = spawned_4
    for got in results.get(f"{TP_SUITE}_on_4_ranks[{layout}]"):
        _check_trained(layout, got, reference)
    _check_saved(root / layout, reference)


def test_lora_adapters_split_with_their_base_layers(spawned):
    """tp2: q_proj's B [out, r] is split by output features and its A [r, in] kept whole with a
    partial gradient; down_proj's A is split by input features and its B kept whole."""
    rank0 = spawned[1].get("test_lora_adapters_split_with_their_base_layers")[0]
    shapes = {n.split("layers.0.", 1)[1]: s for n, s in rank0["shapes"].items()}
    cfg = tiny_llama(seed=0).config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert shapes["self_attn.q_proj.lora_A.default.weight"] == (lw.LORA_R, cfg.hidden_size)
    assert shapes["self_attn.q_proj.lora_B.default.weight"] == (cfg.num_attention_heads * head_dim // 2, lw.LORA_R)
    assert shapes["mlp.down_proj.lora_A.default.weight"] == (lw.LORA_R, cfg.intermediate_size // 2)
    assert shapes["mlp.down_proj.lora_B.default.weight"] == (cfg.hidden_size, lw.LORA_R)
    partial = {n.split("layers.", 1)[1] for n in rank0["partial"]}
    assert partial == {f"{i}.self_attn.{p}.lora_A.default.weight" for i in range(cfg.num_hidden_layers)
                       for p in ("q_proj", "v_proj")}


@pytest.mark.parametrize("name", RESUMED)
def test_lora_checkpoint_resumes_exactly(name, spawned):
    """save_checkpoint after 3 steps, load into a LoRA model from another seed: the next 2 steps'
    losses are those of the run that never stopped."""
    got = spawned[1].get(f"{RESUME}[{name}]")[0]
    check(rel_diff(got["resumed"], got["straight"]), FP32_LOSS_RTOL, f"{name} + LoRA resumed: losses")


def test_every_rank_starts_from_rank_0s_adapters(spawned):
    """Ranks seeded differently still start alike (FSDP2 would otherwise stitch its shards
    together from different initial adapters): rank 0's, which are what the seed gives on one process."""
    rank0, rank1 = spawned[1].get("test_every_rank_starts_from_rank_0s_adapters")
    single = lw.initial_adapter_state()  # seed 1, as rank 0
    assert set(rank0) == set(rank1) == set(single)
    for name in single:
        assert torch.equal(rank1[name], rank0[name]) and torch.equal(rank0[name], single[name]), name


def test_optimizer_built_before_enable_lora_is_refused():
    """An optimizer over the base model alone holds no adapter: boost says to build it after."""
    from phalanx.booster import Booster

    booster = Booster()
    base = tiny_llama(seed=0)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = booster.enable_lora(base, lw.lora_config())
    with pytest.raises(ValueError, match="build the optimizer after enable_lora"):
        booster.boost(model, opt)


def test_enable_lora_refuses_a_boosted_model_and_a_wrong_config():
    from phalanx.booster import Booster

    booster = Booster()
    model = tiny_llama(seed=0)
    with pytest.raises(TypeError, match="peft.LoraConfig"):
        booster.enable_lora(model, {"r": 4})
    boosted, *_ = booster.boost(model)
    with pytest.raises(ValueError, match="before booster.boost|on the original"):
        booster.enable_lora(boosted, lw.lora_config())


def test_merge_matches_peft_merge_and_unload():
    """The streamed merge (W + scaling·B@A per layer) equals peft's own merge_and_unload."""
    from phalanx.booster.lora import merged_pairs

    model = lw.lora_model()
    with torch.no_grad():  # non-zero B, so the merge changes the weights
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ours = dict(merged_pairs(model, model.state_dict().items()))
    want = model.merge_and_unload().state_dict()
    assert set(ours) == set(want)
    for k in want:
        torch.testing.assert_close(ours[k], want[k], rtol=1e-6, atol=1e-6)
