"""`phalanx.amp.fused_step`: the gradient-clipping factor applied inside torch's fused optimizer
kernels (their `grad_scale` input) gives the update that clipping the gradients in place and then
stepping gives, without the pass that scales every gradient; where the step is not fused (the
user chose a kernel), the gradients are scaled in place as before."""
from __future__ import annotations

import pytest
import torch

from phalanx.amp.fused_step import fused_step

CLIP = 0.3


def _params_and_grads(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(37, 19, generator=g)), torch.nn.Parameter(torch.randn(101, generator=g))]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    return params, grads


def _run(make_opt, steps: int, in_kernel: bool):
    params, grads = _params_and_grads()
    opt = make_opt(params)
    seen_before_step = []
    for step in range(steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone() * (step + 1)
        if in_kernel:
            with fused_step(opt, torch.device("cpu"), [p.grad for p in params], CLIP):
                seen_before_step.append([p.grad.clone() for p in params])
                opt.step()
            assert getattr(opt, "grad_scale", None) is None, "the kernel's input must not outlive the step"
        else:
            for p in params:
                p.grad.mul_(CLIP)
            opt.step()
    return [p.detach().clone() for p in params], seen_before_step


def _fused(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in opt.param_groups:
        group["fused"] = True
    return opt


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
], ids=["adamw", "adam", "sgd", "adagrad"])
def test_clip_inside_the_fused_kernel_equals_clip_then_step(make_opt):
    want, _ = _run(lambda ps: _fused(make_opt(ps)), 3, in_kernel=False)
    got, seen = _run(make_opt, 3, in_kernel=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the gradients reached the step unscaled: the factor was applied inside the kernel
    _, grads = _params_and_grads()
    for step, before in enumerate(seen):
        for g, g0 in zip(before, grads, strict=True):
            torch.testing.assert_close(g, g0 * (step + 1), rtol=0, atol=0)


def test_a_users_kernel_choice_gets_the_gradients_scaled_first():
    params, grads = _params_and_grads()
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    with fused_step(opt, torch.device("cpu"), [p.grad for p in params], CLIP):
        assert not opt.param_groups[0].get("fused")
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(p.grad, g * CLIP)
        opt.step()
    assert getattr(opt, "grad_scale", None) is None


def test_no_clipping_leaves_the_gradients_and_the_optimizer_alone():
    params, grads = _params_and_grads()
    opt = torch.optim.AdamW(params, lr=1e-2)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    with fused_step(opt, torch.device("cpu"), [p.grad for p in params], 1.0):
        assert opt.param_groups[0]["fused"] and getattr(opt, "grad_scale", None) is None
        for p, g in zip(params, grads, strict=True):
            assert torch.equal(p.grad, g)
    assert opt.param_groups[0]["fused"] is None  # the user's setting is back
