"""DeepSeek's own auxiliary balance losses (phalanx.models.deepseek.BalanceLoss), which transformers
leaves out: DeepSeek-V2's expert-level balance loss (softmax scores, over the batch) and DeepSeek-V3's
complementary sequence-wise balance loss (sigmoid scores normalised over the experts, per sequence),
each with `aux_loss_alpha` from the config and `seq_aux` choosing the form.

One process: the loss and its gradients equal a by-hand computation of the papers' formula (loops
over units, experts and tokens) on a tiny padded batch, for both families in both forms.
Two gloo ranks (one spawn): HybridParallelPlugin with config.output_router_logits=True adds the loss
of the global batch: two SGD steps under ep2 and under dp2 equal one process (losses, gradient
norms, every weight after the steps); ranks holding 3 and 1 padded sequences give the one-process
loss and gradient; the layouts the loss cannot run under are refused at boost, naming the fix.
"""
from __future__ import annotations

import pytest
import torch

from deepseek_workers import ROWS, SEQ, VOCAB, build
from phalanx.device import run_device, to_device
from phalanx.models.deepseek import BalanceLoss, balance_settings
from phalanx.testing import check, rel_diff, rounding_rtol
from spawn_batch import spawn_suites

FP32_RTOL = rounding_rtol(torch.float32, ROWS * SEQ)  # 8·eps·√128 = 1.1e-5
UPDATE_RTOL = 1e-5  # two SGD steps, as test_deepseek_family.py
ALPHA = 0.1  # large, so that the loss's gradients count in the steps (the papers use 1e-3 / 1e-4)

FORMS = {  # (variant, seq_aux): the families' defaults and the other form
    "v2-batch": ("v2", None), "v2-sequence": ("v2", True), "v3-sequence": ("v3", None), "v3-batch": ("v3", False)}


def _mask() -> torch.Tensor:
    """3 rows of 6 tokens, right-padded: 6, 4 and 1 real tokens."""
    return torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])


def by_hand(outputs: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, sigmoid: bool,
            per_sequence: bool, alpha: float) -> torch.Tensor:
    """The papers' formula, written out: per block, per unit u (a sequence, or the batch) of T real
    tokens, Σ_i f_i P_i with f_i = N/(K·T) · #{t chose i}, P_i = 1/T · Σ_t s'_{i,t}; mean over units,
    sum over blocks, times alpha."""
    batch, seq = mask.shape
    total = torch.zeros(())
    for logits, chosen in outputs:
        experts, k = logits.shape[1], chosen.shape[1]
        units = [[b] for b in range(batch)] if per_sequence else [list(range(batch))]
        values = []
        for unit in units:
            tokens = [b * seq + t for b in unit for t in range(seq) if mask[b, t]]
            if not tokens:
                continue
            value = torch.zeros(())
            for i in range(experts):
                hits = sum(int(i in chosen[n].tolist()) for n in tokens)
                f = experts * hits / (k * len(tokens))
                p = torch.zeros(())
                for n in tokens:
                    s = torch.sigmoid(logits[n]) / torch.sigmoid(logits[n]).sum() if sigmoid else torch.softmax(logits[n], -1)
                    p = p + s[i]
                value = value + f * p / len(tokens)
            values.append(value)
        total = total + sum(values) / len(values)
    return alpha * total


@pytest.mark.parametrize("form", list(FORMS))
def test_balance_loss_equals_the_formula_by_hand(form):
    variant, seq_aux = FORMS[form]
    extra = {} if seq_aux is None else {"seq_aux": seq_aux}
    model = build(variant, aux_loss=ALPHA, **extra).to(run_device())
    alpha, per_sequence = balance_settings(model.config)
    assert (alpha, per_sequence) == (ALPHA, form.endswith("sequence")), (alpha, per_sequence)
    loss_fn = BalanceLoss.attach(model)
    routers = [m.mlp.gate for m in model.model.layers if hasattr(m.mlp, "gate")]
    outputs = []
    for router in routers:  # the routers' own outputs, recorded apart from BalanceLoss
        router.register_forward_hook(lambda m, a, out: outputs.append((out[0], out[2])))
    ids = to_device(torch.randint(5, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4)), run_device())
    mask = to_device(_mask(), run_device())
    model(input_ids=ids, attention_mask=mask)
    got = loss_fn.loss(mask)
    want = by_hand(outputs, mask, sigmoid=variant == "v3", per_sequence=per_sequence, alpha=ALPHA)
    assert len(outputs) == len(routers) == 2
    check(rel_diff(got, want), rounding_rtol(torch.float32, mask.numel()), f"{form} balance loss")
    weights = [r.weight for r in routers] + [model.model.embed_tokens.weight]
    grads = torch.autograd.grad(got, weights, retain_graph=True)
    for w, g_got, g_want in zip(weights, grads, torch.autograd.grad(want, weights), strict=True):
        assert g_want.abs().max() > 0
        check(rel_diff(g_got, g_want), rounding_rtol(torch.float32, mask.numel()), f"{form} gradient {tuple(w.shape)}")
    with pytest.raises(RuntimeError, match="run a forward"):  # the recording was consumed
        loss_fn.loss(mask)
    model(input_ids=ids)
    with pytest.raises(ValueError, match="does not match the routers' batch"):
        loss_fn.loss(mask[:2])


def test_the_loss_is_asked_for_with_a_coefficient():
    """Only output_router_logits=True asks for it; without aux_loss_alpha it is refused, naming
    the key and the papers' values; other families are not DeepSeek's."""
    assert balance_settings(build("v3").config) is None
    config = build("v3").config
    config.output_router_logits = True
    with pytest.raises(ValueError, match="aux_loss_alpha is not set.*1e-4"):
        balance_settings(config)
    from transformers import MixtralConfig
    assert balance_settings(MixtralConfig(output_router_logits=True)) is None


# ---------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def two_ranks(request):
    from deepseek_workers import layout_steps
    from deepseek_workers import balance_refusals, uneven_ranks

    suites = {"test_ep2_and_dp2_with_the_balance_loss_equal_one_process[v2]":
                  (layout_steps, ("v2", {"ep2": {"ep_size": 2}, "dp2": {}}), {"aux_loss": ALPHA}),
              "test_ep2_and_dp2_with_the_balance_loss_equal_one_process[v3]":
                  (layout_steps, ("v3", {"ep2 zero1": {"ep_size": 2, "zero_stage": 1}, "dp2 zero1": {"zero_stage": 1}}),
                   {"aux_loss": ALPHA, "balance": 0.02}),
              "test_uneven_ranks_give_the_global_loss": (uneven_ranks, (ALPHA,), {}),
              "test_layouts_without_the_loss_are_refused": (balance_refusals, (), {})}
    return spawn_suites(request, 2, suites, timeout=600)


@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_ep2_and_dp2_with_the_balance_loss_equal_one_process(two_ranks, variant):
    """Cross-entropy + 0.1 · DeepSeek's balance loss (V2: over the global batch; V3: per sequence, with
    the correction bias updated by BiasBalancer), ep2 (4 of the 8 experts per rank) and dp2, each rank
    half the batch: the same losses, gradient norms and weights as one process on the whole batch."""
    for rank, layouts in enumerate(two_ranks.get(f"test_ep2_and_dp2_with_the_balance_loss_equal_one_process[{variant}]")):
        for name, got in layouts.items():
            what = f"{variant} {name} rank {rank}"
            check(got["losses"], FP32_RTOL, f"{what} losses")
            check(got["norms"], FP32_RTOL, f"{what} gradient norms")
            assert got["local_experts"] == ([(4, 32, 32)] if "ep2" in name else None), (what, got["local_experts"])
            if variant == "v3":
                check(got["biases"], FP32_RTOL, f"{what} correction biases")
            if rank == 0:
                assert got["names"] == [], (what, got["names"])
                check(got["update"], UPDATE_RTOL, f"{what} weights after the steps")


def test_uneven_ranks_give_the_global_loss(two_ranks):
    """Rank 0 holds 3 padded sequences, rank 1 one: the mean over ranks of each rank's loss and the
    mean of their gradients (what data parallelism averages) equal one process on all 4 rows, for
    both forms (per sequence the mean runs over the 4 sequences, not over each rank's)."""
    for rank, forms in enumerate(two_ranks.get("test_uneven_ranks_give_the_global_loss")):
        for form, got in forms.items():
            check(got["loss"], FP32_RTOL, f"{form} loss (mean over ranks), rank {rank}")
            check(got["grads"], FP32_RTOL, f"{form} router and embedding gradients (mean over ranks), rank {rank}")


def test_layouts_without_the_loss_are_refused(two_ranks):
    """Refused at boost with the fix named: a DeepSeek config asking for the loss without
    aux_loss_alpha (with and without ep), split-gather sequence parallelism. Pipeline parallelism
    boosts (the loss rides along the stages: tests/framework/test_expert_parallel_pp.py)."""
    messages = two_ranks.get("test_layouts_without_the_loss_are_refused")[0]
    assert "aux_loss_alpha is not set" in messages["no alpha, ep2"] and "output_router_logits=False" in \
        messages["no alpha, ep2"], messages
    assert "aux_loss_alpha is not set" in messages["no alpha, dp2"], messages
    assert messages["pp2"] == "no error", messages
    assert "whole sequences" in messages["tp2 split-gather"], messages
