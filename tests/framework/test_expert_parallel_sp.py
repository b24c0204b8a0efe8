"""Expert parallelism with Ulysses / ring sequence parallelism in HybridParallelPlugin: each
sequence-parallel rank routes its own shard of the sequence, the experts split over EP groups
carved out of the dp × sp ranks, expert gradients averaged over the dp × sp ranks holding the same
experts, dense ones over dp × sp, the load-balancing loss, z-loss and token counts over the global
batch (every token once). Two SGD steps of a tiny Mixtral (cross-entropy + 0.5 · load-balancing
loss + 0.1 · z-loss, clipped at 0.5) equal one process on the whole batch: losses, gradient norms,
every weight after the steps in Hugging Face layout, the last step's per-expert counts; the saved
model loads into a layout without sequence parallelism and through from_pretrained. Without EP the
router losses are the global batch's the same way (hooks on the routers); under split-gather they
are refused."""
from __future__ import annotations

from expert_parallel_sp_workers import (refusals, resume_from_ep_sp, sp_layouts, sp_layouts_without_ep,
                                        split_gather_router_loss_refusals)
from test_expert_parallel_plugin import FP32_RTOL, UPDATE_RTOL, _check
from phalanx.testing import ADAMW_UPDATE_RTOL, check, spawn

ULYSSES = {"sp_size": 2, "sequence_parallelism": "ulysses"}


def _check_loaded(ranks: list[dict], where: str) -> None:
    for rank, got in enumerate(ranks):
        check(got["loaded"]["logits"], FP32_RTOL, f"logits of the ep x sp model loaded under {where}, rank {rank}")
        if rank == 0:
            check(got["loaded"]["from_pretrained"], FP32_RTOL, "logits of the ep x sp model by from_pretrained")


def test_ep2_with_ulysses_sp2_on_two_ranks_equals_one_process(tmp_path):
    """2 ranks, dp1 × sp2 with ep2 over the two sequence shards (ZeRO 0 and 2); the ZeRO-0 model
    saved in HF layout loads under plain ep2 and by from_pretrained."""
    layouts = {"ep2 sp2": {"ep_size": 2, **ULYSSES}, "ep2 sp2 zero2": {"ep_size": 2, "zero_stage": 2, **ULYSSES}}
    ranks = spawn(sp_layouts, 2, layouts, save=str(tmp_path / "model"), load_layout={"ep_size": 2})
    _check([r["layouts"] for r in ranks], {name: 2 for name in layouts})
    _check_loaded(ranks, "ep2 (no sp)")


def test_ep_with_sp2_and_dp2_on_four_ranks_equals_one_process(tmp_path):
    """4 ranks, dp2 × sp2: ep2 over each data rank's sequence shards (ZeRO-1: the experts' states
    over their 2 replicas, dense over 4), ep4 over all four (ZeRO-2, one replica each), ep2 with
    ring attention (ZeRO 0); the ep4 model loads under tp2 × ep2."""
    layouts = {"ep4 sp2 zero2": {"ep_size": 4, "zero_stage": 2, **ULYSSES},
               "ep2 sp2 dp2 zero1": {"ep_size": 2, "zero_stage": 1, **ULYSSES},
               "ep2 ring2 dp2": {"ep_size": 2, "sp_size": 2, "sequence_parallelism": "ring"}}
    ranks = spawn(sp_layouts, 4, layouts, save=str(tmp_path / "model"), load_layout={"ep_size": 2, "tp_size": 2})
    _check([r["layouts"] for r in ranks], {"ep4 sp2 zero2": 4, "ep2 sp2 dp2 zero1": 2, "ep2 ring2 dp2": 2})
    _check_loaded(ranks, "tp2 x ep2")


def test_impossible_ep_sp_layouts_are_refused():
    split_gather, indivisible = spawn(refusals, 2)[0]
    assert "split-gather" in split_gather and "ulysses" in split_gather, split_gather
    assert "must divide the data x sequence-parallel size 2" in indivisible and "[1, 2]" in indivisible, indivisible


def test_optimizer_state_moves_from_ep_sp_to_other_layouts(tmp_path):
    """AdamW: a step under ep2 × sp2 (2 ranks; ZeRO 0, where both sequence shards of the data rank
    hold the dense state and one writes it, and ZeRO-1), model and optimizer saved, loaded under
    ep2 without sp and under ep2 × sp2 ZeRO-2; the second step there equals two steps in one process."""
    ranks = spawn(resume_from_ep_sp, 2, str(tmp_path))
    for rank, saved in enumerate(ranks):
        for source, layouts in saved.items():
            for name, got in layouts.items():
                check(got["loss"], FP32_RTOL, f"{source} -> {name} second loss, rank {rank}")
                if rank == 0:
                    check(got["update"], ADAMW_UPDATE_RTOL, f"{source} -> {name} weights after the resumed step")


def test_planner_applies_the_plugins_ep_sp_rule():
    """phalanx.plan's structural check mirrors the plugin: ep divides dp × sp under Ulysses/ring,
    split-gather refused."""
    from phalanx.plan import Layout, load_spec
    from phalanx.plan.layout import structural_problem

    spec = load_spec(dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                          num_experts_per_tok=2))
    problem = lambda layout: structural_problem(layout, spec, 8)  # noqa: E731
    assert problem(Layout("hybrid", 4, sp=2, sp_mode="ulysses", ep=2)) is None  # dp2 x sp2
    assert problem(Layout("hybrid", 4, sp=2, sp_mode="ulysses", ep=4)) is None  # ep over all four
    assert problem(Layout("hybrid", 2, sp=2, sp_mode="ulysses", ep=2)) is None  # dp1: ep over the shards
    assert problem(Layout("hybrid", 8, sp=2, sp_mode="ring", tp=2, ep=4)) is None
    assert "data x sequence-parallel size 2" in problem(Layout("hybrid", 2, sp=2, sp_mode="ulysses", ep=4))
    assert "split-gather" in problem(Layout("hybrid", 4, tp=2, sp_mode="split_gather", ep=2))
    assert Layout("hybrid", 8, sp=2, sp_mode="ulysses", ep=2, zero_stage=1).expert_shard_group == 4


def test_fit_under_ep_sp_matches_sp_alone_and_logs_expert_tokens(tmp_path):
    """phalanx.train.fit with plugin_options {ep_size: 2, sp_size: 2, sequence_parallelism: ulysses,
    zero_stage: 1} on 2 ranks (cross-entropy only) gives the losses of Ulysses sp2 without EP (the
    same data replica) over 3 AdamW steps, and every metrics record carries the per-expert token
    counts of the whole batch (2 rows x 16 tokens, top-2: 64 per block), not of one shard."""
    from expert_parallel_plugin_workers import fit_layouts
    from phalanx.testing import rel_diff

    ulysses = {"zero_stage": 1, **ULYSSES}
    got = spawn(fit_layouts, 2, str(tmp_path), {"sp2": ("hybrid", ulysses),
                                                "ep2 sp2": ("hybrid", {"ep_size": 2, **ulysses})})[0]
    check(rel_diff(got["ep2 sp2"]["losses"], got["sp2"]["losses"]), FP32_RTOL, "fit under ep2 x sp2 vs sp2: losses")
    blocks_per_step = got["ep2 sp2"]["expert_tokens"]
    assert len(blocks_per_step) == 3 and all(r is None for r in got["sp2"]["expert_tokens"]), blocks_per_step
    for blocks in blocks_per_step:
        assert len(blocks) == 2 and all(len(b) == 4 and sum(b) == 2 * 16 * 2 for b in blocks), blocks


def _check_without_ep(ranks: list[dict]) -> None:
    for rank, layouts in enumerate(ranks):
        for name, got in layouts.items():
            check(got["losses"], FP32_RTOL, f"{name} rank {rank} losses")
            check(got["norms"], FP32_RTOL, f"{name} rank {rank} gradient norms")
            if rank == 0:
                assert got["names"] == [], (name, got["names"])
                check(got["update"], UPDATE_RTOL, f"{name} weights after the steps")


def test_router_losses_without_ep_under_sp_equal_one_process():
    """No expert parallelism, Ulysses sp2 on 2 ranks (ZeRO 0 and 1): the load-balancing loss and
    z-loss of the global batch (the shares and row counts summed over dp × sp, each rank's value
    summed over its row's shards), from hooks on the routers, not transformers' per-shard aux loss."""
    _check_without_ep(spawn(sp_layouts_without_ep, 2, {"sp2": ULYSSES, "sp2 zero1": {**ULYSSES, "zero_stage": 1}}))


def test_router_losses_without_ep_under_sp2_and_dp2_equal_one_process():
    """4 ranks without expert parallelism: dp2 × Ulysses sp2 (ZeRO-2) and dp2 × ring sp2."""
    _check_without_ep(spawn(sp_layouts_without_ep, 4, {"dp2 sp2 zero2": {**ULYSSES, "zero_stage": 2},
                                                       "dp2 ring2": {"sp_size": 2, "sequence_parallelism": "ring"}}))


def test_router_losses_under_split_gather_are_refused():
    """Split-gather runs the expert block on each tp rank's tokens: the router losses (which would
    have to count over dp × tp) are refused at boost, naming Ulysses/ring and the settings to drop."""
    for name, message in spawn(split_gather_router_loss_refusals, 2)[0].items():
        assert "split-gather" in message and "ulysses" in message and "router_z_loss=0" in message, (name, message)
