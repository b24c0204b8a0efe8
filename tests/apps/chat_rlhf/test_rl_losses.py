"""The RL loss pieces against values computed by hand."""
import math

import pytest
import torch

from apps.chat_rlhf import rl_losses as L


def test_group_advantages_grpo_group_scale():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = L.group_advantages(r, baseline="grpo", scale="group", eps=0.0 + 1e-12)
    std = math.sqrt(((0.5 ** 2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std, atol=1e-6)
    assert torch.all(adv[1] == 0)  # zero spread: no signal, and finite


def test_group_advantages_scales_and_baselines():
    r = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    # Dr. GRPO: no std division
    assert torch.allclose(L.group_advantages(r, scale="none"), torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    # batch std: std of [3, 1, 0, 0] (unbiased) = sqrt(((1.75-... ) by hand
    mean = 1.0
    std = math.sqrt(((3 - mean) ** 2 + (1 - mean) ** 2 + 2 * mean ** 2) / 3)
    got = L.group_advantages(r, scale="batch", eps=0.0)
    assert torch.allclose(got, torch.tensor([[1.0, -1.0], [0.0, 0.0]]) / std, atol=1e-6)
    # RLOO: r_i - mean of the others; n = 2 -> r0 - r1, r1 - r0
    assert torch.allclose(L.group_advantages(r, baseline="rloo", scale="none"), torch.tensor([[2.0, -2.0], [0.0, 0.0]]))
    # REINFORCE++: r - batch mean (1.0)
    assert torch.allclose(L.group_advantages(r, baseline="reinforce_pp", scale="none"),
                          torch.tensor([[2.0, 0.0], [-1.0, -1.0]]))
    with pytest.raises(ValueError, match="RLOO"):
        L.group_advantages(torch.ones(2, 1), baseline="rloo")


def test_rloo_three_samples_by_hand():
    r = torch.tensor([[1.0, 2.0, 6.0]])
    want = torch.tensor([[1 - 4.0, 2 - 3.5, 6 - 1.5]])
    assert torch.allclose(L.group_advantages(r, baseline="rloo", scale="none"), want)


def test_k3_kl_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    r = -0.5
    assert torch.allclose(L.k3_kl(logp, ref), torch.tensor([math.exp(r) - r - 1, 0.0]), atol=1e-7)
    assert (L.k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_policy_loss_clip_higher_and_aggregation():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.1, 1.0, 1.0]]))
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, st = L.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="token")
    # row 0 (A=+1): ratios 1.5 -> min(1.5, 1.28) = 1.28; 0.5 -> min(0.5, 0.8) = 0.5; 1.0 -> 1.0
    # row 1 (A=-1): ratio 1.1 -> -min(-1.1, -1.1) = 1.1
    want_token = (-(1.28 + 0.5 + 1.0) + 1.1) / 4
    assert loss.item() == pytest.approx(want_token, abs=1e-6)
    assert st["clipped_high"].item() == 1 and st["clipped_low"].item() == 0 and st["tokens"].item() == 4
    seq, _ = L.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="sequence")
    assert seq.item() == pytest.approx((-(1.28 + 0.5 + 1.0) / 3 + 1.1) / 2, abs=1e-6)
    # global totals (data-parallel ranks) replace the local counts
    g, _ = L.policy_loss(logp, old, adv, mask, aggregation="token", token_total=8.0)
    assert g.item() == pytest.approx((-(1.2 + 0.5 + 1.0) + 1.1) / 8, abs=1e-6)


def test_policy_loss_gradient_is_reinforce_at_ratio_one():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = L.policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A / tokens


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.9, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = L.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0 backwards: d2 = 1 - 0.3 = 0.7; d1 = 0 + 0.9*0.3 - 0.2 = 0.07; d0 = 0.9*0.2 - 0.1 = 0.08
    a2 = 0.7
    a1 = 0.07 + 0.45 * a2
    a0 = 0.08 + 0.45 * a1
    assert torch.allclose(adv[0], torch.tensor([a0, a1, a2]), atol=1e-6)
    # row 1: one token, V beyond the end is 0: d0 = 0.5 - 0.4
    assert torch.allclose(adv[1], torch.tensor([0.1, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(ret[0], adv[0] + values[0], atol=1e-6)


def test_value_loss_clipping_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[2.0, 1.0]])
    loss, frac = L.value_loss(v, old, ret, torch.ones(1, 2), clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.7 -> 1.69: max 1.69; token 1: 1 vs 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2, abs=1e-6)
    assert frac.item() == pytest.approx(0.5)


def test_whiten_and_adaptive_controller():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    w = L.whiten(x, torch.tensor([1, 1, 1, 0]))
    assert torch.allclose(w[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-4)
    kl = L.AdaptiveKLController(0.1, target=6.0, horizon=100)
    assert kl.update(12.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped at +0.2
    assert kl.update(3.0, 10) == pytest.approx(0.102 * (1 - 0.2 * 10 / 100))  # error -0.5 clipped at -0.2
    state = kl.state_dict()
    other = L.AdaptiveKLController(1.0)
    other.load_state_dict(state)
    assert other.value == kl.value
    fixed = L.AdaptiveKLController(0.05, target=None)
    assert fixed.update(100.0, 5) == 0.05


def test_controller_counts_samples_and_never_flips_the_sign():
    kl = L.AdaptiveKLController(0.1, target=0.05, horizon=64)  # per-token target, horizon in samples
    assert kl.update(0.075, 32) == pytest.approx(0.1 * (1 + 0.2 * 32 / 64))  # error 0.5, clipped at 0.2
    assert kl.update(0.04, 32) == pytest.approx(0.11 * (1 - 0.2 * 32 / 64))  # error -0.2
    assert kl.update(0.0, 64 * 10) == 0.0  # 1 - 0.2 * 10 < 0: floored at 0, never negative


def _exact_gradients(estimator: str):
    """Over a 6-token vocabulary: the gradient (w.r.t. the policy's logits) of the estimator's loss
    averaged exactly over the sampled token x ~ pi, and the exact gradients of KL(pi || ref) and
    KL(ref || pi)."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    pi = logp.exp().detach()
    expected = sum(pi[x] * torch.autograd.grad(L.kl_penalty(logp[x], ref[x], estimator), theta,
                                               retain_graph=True)[0] for x in range(6))
    reverse = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)[0]
    forward = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)[0]
    return expected, reverse, forward


def test_k2_penalty_has_the_unbiased_kl_gradient_and_k3_does_not():
    expected, reverse, forward = _exact_gradients("k2")
    assert torch.allclose(expected, reverse, atol=1e-12)  # E_pi[(logp - ref) grad logp] = grad KL(pi || ref)
    expected, reverse, forward = _exact_gradients("k3")
    assert torch.allclose(expected, forward, atol=1e-12)  # k3 as a loss follows KL(ref || pi) instead
    assert not torch.allclose(expected, reverse, atol=1e-3)
    with pytest.raises(ValueError, match="choose one of k2, k3"):
        L.kl_penalty(torch.zeros(1), torch.zeros(1), "k1")


def test_tis_weights_by_hand():
    from apps.chat_rlhf.grpo import tis_weights
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = tis_weights(trainer, engine, mask, cap=1.5)
    want = [[min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0], [math.exp(-2.5), 1.0, 1.0]]
    assert torch.allclose(w, torch.tensor(want))
    assert tis_weights(trainer, engine, mask, cap=None).tolist() == [[1.0] * 3] * 2
