"""LoRA with expert parallelism: HybridParallelPlugin(ep_size=2) on a LoRA Mixtral / Qwen2-MoE
(adapters on q/v_proj and on the fused expert tensors, peft's `target_parameters`), alone and with
dp2, tp2 or pp2 (4 ranks) and ZeRO-1/2, and on a LoRA DeepSeek-V3 / V2 (adapters on every
multi-head latent attention projection, the routed experts and the shared experts; ep2 and, slow,
ep2 x dp2), against plain peft on one process over the whole batch
(AdamW, 5 steps; test_lora.py's tolerances, and the gradient norms, which AdamW's updates hide).
Each rank holds the adapter rows of its own experts; only adapters train and sit in the
optimizers; the adapter saved from the EP layout (gathered to full expert dims) opens in peft on
the un-split base, and the merged model in transformers, with the trained logits (its weights
those of peft's merge_and_unload of the saved adapter).
Runs as well with PHALANX_EMULATE_GPU=1 (device tensors, NCCL-path collectives)."""
from __future__ import annotations

import pytest
import torch

import lora_workers as lw
import plugin_cases as cases
from phalanx.testing import ADAMW_UPDATE_RTOL, LOW_PRECISION_RTOL, check, rel_diff, rounding_rtol, update_diff
from spawn_batch import spawn_suites

pytest.importorskip("peft")

FP32_LOSS_RTOL = rounding_rtol(torch.float32, cases.GLOBAL_BATCH * cases.SEQ)
LOGITS_RTOL = 1e-4  # test_lora_moe.py's, for a saved adapter / merged model against the trained one
EP = 2
SUITE, SUITE4 = "test_ep_lora_matches_single_process", "test_four_rank_ep_lora_layouts_match_single_process"
# name: (family, B drawn at random (else zero, peft's default), plugin options)
TWO_RANKS = {"mixtral-ep2": ("mixtral", False, {"ep_size": 2}),
             "mixtral-randomB-ep2-zero2": ("mixtral", True, {"ep_size": 2, "zero_stage": 2}),
             "qwen2_moe-ep2-zero1": ("qwen2_moe", False, {"ep_size": 2, "zero_stage": 1}),
             # DeepSeek with B at zero: with B drawn at random, the tiny DeepSeeks amplify rounding over
             # the 5 AdamW steps (one process, the batch summed in 4 parts instead of 1: gradient norms
             # 2.1e-5 apart at step 5, V2 1.5e-5; with B at zero 1.5e-7): see docs/lora.md
             "deepseek_v3-ep2": ("deepseek_v3", False, {"ep_size": 2}),
             "deepseek_v2-ep2-zero1": ("deepseek_v2", False, {"ep_size": 2, "zero_stage": 1})}
FOUR_RANKS = {"mixtral-randomB-ep2-dp2-zero1": ("mixtral", True, {"ep_size": 2, "zero_stage": 1}),
              "qwen2_moe-ep2-dp2": ("qwen2_moe", False, {"ep_size": 2}),
              "mixtral-randomB-ep2-tp2-zero2": ("mixtral", True, {"ep_size": 2, "tp_size": 2, "zero_stage": 2}),
              "mixtral-randomB-ep2-pp2-zero1": ("mixtral", True, {"ep_size": 2, "pp_size": 2, "zero_stage": 1,
                                                                  "num_microbatches": 2})}
SUITE4_DEEPSEEK = "test_four_rank_deepseek_ep_lora_matches_single_process"
FOUR_RANKS_DEEPSEEK = {"deepseek_v3-ep2-dp2-zero2": ("deepseek_v3", False, {"ep_size": 2, "zero_stage": 2}),
                       "deepseek_v3-ep2-tp2-zero1": ("deepseek_v3", False, {"ep_size": 2, "tp_size": 2, "zero_stage": 1}),
                       "deepseek_v2-ep2-tp2": ("deepseek_v2", False, {"ep_size": 2, "tp_size": 2})}
SPLIT = "test_deepseek_expert_adapters_split_with_their_experts"
RESUME = "test_lora_checkpoint_moves_between_ep_and_other_layouts"
EP2_ZERO1, EP2 = ("hybrid", {"ep_size": 2, "zero_stage": 1}), ("hybrid", {"ep_size": 2})
FP16 = "test_fp16_zero_ep_shares_one_loss_scaler"
FP16_LAYOUTS = {"ep2-zero2": ("hybrid", {"ep_size": 2, "zero_stage": 2}), "ep2-zero1": ("hybrid", {"ep_size": 2,
                "zero_stage": 1}), "zero2 (no EP)": ("zero2", {})}
# saved under -> {loaded into}: the expert adapters' Adam moments in full coordinates both ways
RESUMES = {"ep2-zero1": (EP2_ZERO1, {"ep2-zero0": EP2, "zero2": ("zero2", {})}),
           "ddp": (("ddp", {}), {"ep2-zero2": ("hybrid", {"ep_size": 2, "zero_stage": 2})})}
RESUMES4 = {"ep2-dp2-zero1": (EP2_ZERO1, {"zero2": ("zero2", {})})}  # B's state assembled over 2 replicas


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(family, random_b):
        if (family, random_b) not in cache:
            cache[family, random_b] = lw.single_process_reference(family=family, random_b=random_b)
        return cache[family, random_b]
    return get


def _suites(suite, root, cases_):
    return {f"{suite}[{name}]": (lw.run_lora_ep, (str(root / name), family, random_b), layout)
            for name, (family, random_b, layout) in cases_.items()}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ep2")
    suites = _suites(SUITE, root, TWO_RANKS)
    for saved, (layout, loads) in RESUMES.items():
        suites[f"{RESUME}:{saved}"] = (lw.resume_lora_ep, (str(root / f"ckpt-{saved}"), "mixtral", layout, loads), {})
    suites[FP16] = (lw.fp16_overflow_runs, (FP16_LAYOUTS,), {})
    for family in lw.DEEPSEEK:
        suites[f"{SPLIT}[{family}]"] = (lw.ep_split_only, (family, True), {"ep_size": 2})
    return root, spawn_suites(request, 2, suites, timeout=600)


@pytest.fixture(scope="module")
def four_ranks(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ep4")
    suites = {**_suites(SUITE4, root, FOUR_RANKS), **_suites(SUITE4_DEEPSEEK, root, FOUR_RANKS_DEEPSEEK)}
    for saved, (layout, loads) in RESUMES4.items():
        suites[f"{RESUME}:{saved}"] = (lw.resume_lora_ep, (str(root / f"ckpt-{saved}"), "mixtral", layout, loads), {})
    return root, spawn_suites(request, 4, suites, timeout=600)


def _local_rows(name: str, full: torch.Tensor, ep_rank: int, experts: int) -> torch.Tensor:
    """This EP rank's experts of a full expert adapter, written out here (not the plugin's helper):
    A [r·E, in] is expert-major, B [out, r·E] expert-minor (peft's ParamWrapper layout)."""
    mine = list(range(ep_rank * experts // EP, (ep_rank + 1) * experts // EP))
    r = lw.LORA_R
    if ".lora_A." in name:
        return full.view(experts, r, -1)[mine].reshape(-1, full.shape[-1])
    return full.view(full.shape[0], r, experts)[:, :, mine].reshape(full.shape[0], -1)


def _check_case(suite, name, case, results, root, references):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    family, random_b, _ = case
    ref_losses, ref_state, ref_model = references(family, random_b)
    initial = lw.initial_adapter_state(family, random_b)
    ranks = results.get(f"{suite}[{name}]")
    experts = [n for n in ref_state if ".mlp.experts." in n]
    assert len(experts) == 2 * 2 * 2, experts  # 2 layers x (gate_up, down) x (A, B)
    shared = [n for n in ref_state if ".shared_experts." in n]
    if family in lw.DEEPSEEK:  # and 2 layers x (gate, up, down) x (A, B) on the shared experts, 5 or 4 on MLA
        assert len(shared) == 2 * 3 * 2, shared
        mla = {n.split(".self_attn.")[1].split(".")[0] for n in ref_state if ".self_attn." in n}
        assert mla == set(lw.MLA_TARGETS[family]), mla
    ref_norms = lw.reference_grad_norms(family, random_b)
    pipeline = case[2].get("pp_size", 1) > 1  # each rank holds its stage's layers only
    ep_ranks, held = set(), set()
    for rank, got in enumerate(ranks):
        what = f"{name} rank {rank}"
        check(rel_diff(got["losses"], ref_losses), FP32_LOSS_RTOL, f"{what}: losses")
        check(rel_diff(got["grad_norms"], ref_norms), FP32_LOSS_RTOL, f"{what}: gradient norms")
        # only adapters train, and every one of them is in the optimizers (the experts' twin under ZeRO)
        assert got["trainable"] == got["in_optimizer"] and all("lora_" in n for n in got["trainable"]), what
        held |= set(got["expert_adapters"])
        assert set(got["expert_adapters"]) <= set(experts), (what, got["expert_adapters"])
        # every expert block's router found above peft's wrappers (the router losses read them)
        assert len(got["routers"]) == (1 if pipeline else 2) and all(
            r.endswith(".mlp.experts.base_layer.base_layer") for r in got["routers"]), (what, got["routers"])
        ep_ranks.add(got["ep_rank"])
        for n, local in got["local_adapters"].items():  # this rank's experts' rows, before any step
            assert torch.equal(local, _local_rows(n, initial[n], got["ep_rank"], lw.num_experts(family))), \
                f"{what}: {n}: not its experts'"
        if pipeline:  # refused on every rank before the gather (each stage holds other experts)
            assert "under pipeline parallelism" in got["merge_refused"], (what, got["merge_refused"])
        else:
            assert got["merge_refused"] is None, (what, got["merge_refused"])
    assert ep_ranks == set(range(EP)) and held == set(experts), (ep_ranks, held)
    got = ranks[0]
    assert got["frozen_moved"] == 0.0
    check(update_diff(got["adapters"], ref_state, initial), ADAMW_UPDATE_RTOL, f"{name}: adapter weights (gathered)")
    for n in experts + shared:  # the expert adapters trained
        assert not torch.equal(got["adapters"][n], initial[n]), n
    with torch.no_grad():
        want = ref_model(input_ids=lw.PROBE).logits
        # the adapter, saved from the EP layout, on a fresh un-split base in peft
        loaded = PeftModel.from_pretrained(lw.base_model(family), str(root / name / "adapter"))
        check(rel_diff(loaded(input_ids=lw.PROBE).logits, want), LOGITS_RTOL, f"{name}: logits of the saved adapter")
        if pipeline:
            return
        merged = AutoModelForCausalLM.from_pretrained(str(root / name / "merged"), dtype=torch.float32)
        assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
        check(rel_diff(merged(input_ids=lw.PROBE).logits, want), LOGITS_RTOL, f"{name}: logits of the merged model")
        # merge=True writes what peft's merge_and_unload makes of the same adapter (W + s·B·A, r terms)
        peft_merged = loaded.merge_and_unload().state_dict()
        ours = merged.state_dict()
        assert set(ours) == set(peft_merged), set(ours) ^ set(peft_merged)
        check(rel_diff(ours, peft_merged), rounding_rtol(torch.float32, lw.LORA_R), f"{name}: merged weights")


@pytest.mark.parametrize("family", list(lw.DEEPSEEK))
def test_merged_pairs_equal_peft_merge_and_unload_on_deepseek(family):
    """One process: the merge that save_lora_as_pretrained(merge=True) streams (`merged_pairs`)
    gives peft's merge_and_unload state dict, names and values, for adapters on MLA, the routed
    experts (3-D target_parameters) and the shared experts (2-D target_parameters; V2's with their
    biases, which sit below peft's wrapper as `base_layer.bias` and keep their own names)."""
    from phalanx.booster.lora import merged_pairs

    model = lw.lora_model(family=family, random_b=True)
    ours = dict(merged_pairs(model, list(model.state_dict().items())))
    want = model.merge_and_unload().state_dict()
    assert set(ours) == set(want), sorted(set(ours) ^ set(want))[:4]
    check(rel_diff(ours, want), rounding_rtol(torch.float32, lw.LORA_R), f"{family}: merged weights")


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_ep_lora_matches_single_process(name, references, two_ranks):
    root, results = two_ranks
    _check_case(SUITE, name, TWO_RANKS[name], results, root, references)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_ep_lora_layouts_match_single_process(name, references, four_ranks):
    """4 ranks. ep2 x dp2: expert adapters averaged over their 2 replicas, attention adapters over 4.
    ep2 x tp2 (ZeRO-2): attention and its adapters split over tp as without EP, the experts and
    their adapters over the EP group (dp 2 = ep 2). ep2 x pp2 (ZeRO-1, 2 microbatches): each stage's
    expert adapters over its EP group; the adapter saved from the stages (merge=True is refused
    for expert adapters under pp, on every rank before the gather)."""
    root, results = four_ranks
    _check_case(SUITE4, name, FOUR_RANKS[name], results, root, references)


@pytest.mark.parametrize("family", list(lw.DEEPSEEK))
def test_deepseek_expert_adapters_split_with_their_experts(family, two_ranks):
    """DeepSeek's equivalence cases start B at zero (see TWO_RANKS), where a split that gives a rank
    another rank's B columns starts the same: here B is drawn at random and each rank's routed
    expert adapters, right after boost under ep2, are its 4 of the 8 experts' rows of A and columns
    of B; the shared experts' adapters are not split (they are not expert adapters)."""
    initial = lw.initial_adapter_state(family, random_b=True)
    ranks = two_ranks[1].get(f"{SPLIT}[{family}]")
    assert {got["ep_rank"] for got in ranks} == set(range(EP))
    for got in ranks:
        routed = {n for n in initial if ".mlp.experts." in n}
        assert set(got["local"]) == routed, sorted(set(got["local"]) ^ routed)[:4]
        for n, local in got["local"].items():
            assert torch.equal(local, _local_rows(n, initial[n], got["ep_rank"], lw.num_experts(family))), \
                f"{family} ep rank {got['ep_rank']}: {n}: not its experts'"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANKS_DEEPSEEK))
def test_four_rank_deepseek_ep_lora_matches_single_process(name, references, four_ranks):
    """4 ranks, ep2 x dp2 with ZeRO-2 on DeepSeek-V3: the routed experts' adapters averaged over
    their 2 replicas (in the experts' ZeRO optimizer), the MLA and shared-expert adapters over 4; and
    ep2 x tp2 (V3, V2): the adapters of the low-rank projections tp replicates (q_a_proj,
    kv_a_proj_with_mqa) and B of the shared experts' row-parallel down_proj weight adapter get
    their partial gradients summed over tp, as their base weights do."""
    root, results = four_ranks
    _check_case(SUITE4_DEEPSEEK, name, FOUR_RANKS_DEEPSEEK[name], results, root, references)


@pytest.mark.slow
def test_lora_checkpoint_moves_between_ep_and_other_layouts(references, two_ranks, four_ranks):
    """3 AdamW steps, save_checkpoint, a fresh boost (adapters from another seed) loads it and
    trains 2 more: the same losses and adapters as 5 steps in one process. Saved under ep2 ZeRO-1
    (each expert adapter's state gathered to full expert dims; B, whose experts are its innermost
    dimension, joined over the EP group) and loaded under ep2 ZeRO-0 and under ZeRO-2 without EP;
    saved under DDP and loaded under ep2 ZeRO-2 (cut to each rank's experts); on 4 ranks saved under
    ep2 x dp2 ZeRO-1 (B's state assembled over its 2 replicas first) and loaded under ZeRO-2."""
    ref_losses, ref_state, _ = references("mixtral", True)
    initial = lw.initial_adapter_state("mixtral", True)
    first = 3
    runs = [(two_ranks, saved, loads) for saved, (_, loads) in RESUMES.items()]
    runs += [(four_ranks, saved, loads) for saved, (_, loads) in RESUMES4.items()]
    for spawned, saved, loads in runs:
        for rank, got in enumerate(spawned[1].get(f"{RESUME}:{saved}")):
            for loaded in loads:
                what = f"saved under {saved}, loaded under {loaded}, rank {rank}"
                check(rel_diff(got[loaded]["losses"], ref_losses[first:]), FP32_LOSS_RTOL, f"{what}: losses")
                check(update_diff(got[loaded]["adapters"], ref_state, initial), ADAMW_UPDATE_RTOL,
                      f"{what}: adapter weights")


@pytest.mark.slow
def test_fp16_zero_ep_shares_one_loss_scaler(two_ranks):
    """fp16 + ZeRO-1/2 + ep2 (the experts' adapters in their own ZeRO optimizer): an overflow in one
    expert adapter of rank 1 alone, in step 2 of 4, skips that step on both ranks in both optimizers
    and halves the one loss scale; the steps after it unscale the experts' gradients by the halved
    scale: the losses and adapters (SGD, so a wrong scale shows in the update) equal ZeRO-2 without
    EP within the fp16 tolerances of the suite (LOW_PRECISION_RTOL)."""
    loss_rtol, _, update_rtol = LOW_PRECISION_RTOL[torch.float16]
    initial = lw.initial_adapter_state("mixtral")
    for rank, runs in enumerate(two_ranks[1].get(FP16)):
        want = runs["zero2 (no EP)"]
        assert [s for s, _ in want["skipped"]] == [False, True, False, False], want["skipped"]
        for name in ("ep2-zero2", "ep2-zero1"):
            got, what = runs[name], f"fp16 {name} rank {rank}"
            assert got["skipped"] == [(False, False), (True, True), (False, False), (False, False)], (what, got)
            assert got["scales"] == want["scales"] == [2.0**16, 2.0**15, 2.0**15, 2.0**15], (what, got["scales"])
            check(rel_diff(got["losses"], want["losses"]), loss_rtol, f"{what}: losses")
            check(update_diff(got["adapters"], want["adapters"], initial), update_rtol, f"{what}: adapters")
