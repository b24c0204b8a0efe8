"""Expert parallelism (phalanx.shard.expert_parallel): the experts of a Mixtral / Qwen-MoE split
over an EP group, tokens dispatched and combined by all-to-all with uneven splits. One process:
the replaced expert module and the global-batch aux loss equal transformers'. 2 gloo ranks (ep2)
and 4 (ep2 × dp2): one SGD step (cross-entropy + a large aux-loss coefficient) equals one process
on the whole batch, loss and every weight after the step in Hugging Face layout; per-expert token
counts equal the one-process router's."""
from __future__ import annotations

import copy

import pytest
import torch

import moe_models
from expert_parallel_workers import balance_losses, build, ep_step, skewed_dispatch
from phalanx.shard.expert_parallel import apply_expert_parallel, load_balancing_loss, router_z_loss
from phalanx.testing import assert_rel_close, spawn

FP32_RTOL = 1e-5  # fp32, one step of a 2-layer model; the sums over ranks reorder a few additions


@pytest.mark.parametrize("family,width", [(f, 16) for f in moe_models.MOE_FAMILIES] + [("qwen2_moe", 13)])
def test_one_process_experts_and_aux_loss_equal_transformers(family, width):
    """ep_size=1 in one process: logits, the aux loss (with a padding mask) and the loss equal HF's;
    the token counts equal a bincount of the router's top-k. Width 16: the grouped matmul; width 13
    (rows of 52 bytes, not 16-byte aligned): the loop over experts."""
    model = build(family, width)
    ids = torch.randint(5, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ref = model(input_ids=ids, labels=ids, attention_mask=mask, output_router_logits=True)
    ep = copy.deepcopy(model)
    plan = apply_expert_parallel(ep, 1)
    assert type(ep.model.layers[0].mlp.experts).__name__ == "ExpertParallelExperts"
    assert all(m.grouped() == (width == 16) for m in plan.experts.values())
    out = ep(input_ids=ids, labels=ids, attention_mask=mask)
    assert_rel_close(out.logits, ref.logits, FP32_RTOL, f"{family} logits")
    aux = plan.load_balancing_loss(mask)
    assert_rel_close(aux, ref.aux_loss, FP32_RTOL, "aux loss of the recorded router logits")
    experts, k = ref.router_logits[0].shape[-1], model.config.num_experts_per_tok
    assert_rel_close(load_balancing_loss(ref.router_logits, experts, k, mask), ref.aux_loss, FP32_RTOL, "aux loss")
    plain = model(input_ids=ids, output_router_logits=True)
    assert_rel_close(load_balancing_loss(plain.router_logits, experts, k), plain.aux_loss, FP32_RTOL, "aux, no mask")
    assert_rel_close(out.loss + model.config.router_aux_loss_coef * aux, ref.loss, FP32_RTOL, "loss")
    keep = mask.reshape(-1).bool().repeat(len(ref.router_logits))
    by_hand = (torch.cat(ref.router_logits)[keep].logsumexp(-1) ** 2).mean()
    assert_rel_close(plan.router_z_loss(mask), by_hand, FP32_RTOL, "z-loss of the recorded router logits")
    assert_rel_close(router_z_loss(ref.router_logits, mask), by_hand, FP32_RTOL, "z-loss")
    for got, logits in zip(plan.token_counts().values(), ref.router_logits, strict=True):
        assert got.tolist() == torch.bincount(torch.topk(logits, k).indices.reshape(-1), minlength=experts).tolist()


def test_bad_ep_size_is_refused():
    model = build("mixtral")
    with pytest.raises(ValueError, match="must divide the world size"):
        apply_expert_parallel(model, 3)
    with pytest.raises(ValueError, match="no fused expert module"):
        apply_expert_parallel(torch.nn.Linear(2, 2), 1)


def _check(ranks: list[dict]) -> None:
    for rank, layouts in enumerate(ranks):
        for (family, ep), got in layouts.items():
            assert got["names"] == [], (rank, family)
            assert got["local_experts"] == {(4 // ep, 32, 32)}, (family, ep, got["local_experts"])
            assert got["loss"].value < FP32_RTOL and got["update"].value < FP32_RTOL, (rank, family, got)
            assert got["z_loss"].value < FP32_RTOL, (rank, family, got["z_loss"])
            counts, want = got["counts"]
            assert [c.tolist() for c in counts] == [w.tolist() for w in want], (family, counts, want)


def test_ep2_step_equals_one_process():
    """ep2 on 2 ranks: each expert has one owner; its gradient sums both ranks' tokens."""
    _check(spawn(ep_step, 2, [(family, 2) for family in moe_models.MOE_FAMILIES]))


def test_ep2_dp2_and_ep4_step_equal_one_process():
    """ep2 × dp2 on 4 ranks: expert gradients summed over the 2 replicas of each expert and divided
    by 4, dense ones averaged over 4; ep4: one expert per rank (the counts of some ranks' experts
    differ a lot: uneven splits)."""
    _check(spawn(ep_step, 4, [("mixtral", 2), ("qwen2_moe", 2), ("qwen3_moe", 4)]))


def test_a_rank_that_receives_no_tokens():
    """All tokens of both ranks go to experts 0 and 1 (rank 0's): rank 1 sends everything and
    receives nothing, and the backward all-to-all still runs on both; gradients equal HF's."""
    for rank, got in enumerate(spawn(skewed_dispatch, 2)):
        assert got["hidden_grad"].value < FP32_RTOL and got["weights_grad"].value < FP32_RTOL, (rank, got)
        up, want = got["up_grad"]
        if rank == 0:
            assert_rel_close(up, want, FP32_RTOL, "experts 0-1 gradient on their owner")
        else:
            assert up.abs().max().item() == 0.0, "experts 2-3 received no token: zero gradient"


def test_router_losses_over_ranks_with_uneven_padding():
    """2 ranks keeping 11 and 4 of their 12 rows: the global aux loss (== transformers' on all rows)
    and z-loss, values and gradients; a per-rank mean would weigh rank 1's rows 11/4 too much."""
    for rank, got in enumerate(spawn(balance_losses, 2)):
        for name, diffs in got.items():
            assert diffs["value"].value < FP32_RTOL and diffs["grad"].value < FP32_RTOL, (rank, name, diffs)
