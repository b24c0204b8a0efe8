"""The one fused log-prob of online RL (`rl_logprobs`): equal to log_softmax + gather, value and
gradient, and never a full-vocabulary float32 tensor (checked on every op it runs). Rows read
twice and bf16 gradients: test_shared_prompt.py::test_token_logprobs_equal_log_softmax."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apps.chat_rlhf import rl_logprobs
from apps.chat_rlhf.rl_logprobs import shifted_logprobs


def reference(logits, targets, mask):
    logp_all = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
def test_shifted_logprobs_equal_log_softmax_gather_and_its_gradient(monkeypatch, chunk_rows):
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 37
    monkeypatch.setattr(rl_logprobs._TokenLogProbs, "CHUNK_ELEMENTS", chunk_rows * V)
    logits = (torch.randn(B, T + 1, V, generator=g) * 3).requires_grad_(True)
    targets = torch.randint(V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    weights = torch.randn(B, T, generator=g)

    logp, entropy = shifted_logprobs(logits, targets, mask, with_entropy=True)
    (logp * weights).sum().backward()
    grad = logits.grad.clone()

    ref_logits = logits.detach().double().requires_grad_(True)
    ref_logp, ref_entropy = reference(ref_logits, targets, mask.double())
    (ref_logp * weights.double()).sum().backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_logits.grad, atol=1e-6, rtol=1e-5)
    assert not entropy.requires_grad


class _Float32Sizes(TorchDispatchMode):
    """Records the element count of every float32 tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_vocabulary_float32_tensor(monkeypatch):
    """bf16 logits of 64 tokens x 4096 vocabulary in chunks of 4 rows: no op, forward or backward,
    makes a float32 tensor larger than one chunk (a log_softmax of the whole would be 64 x 4096)."""
    B, T, V, rows = 4, 16, 4096, 4
    monkeypatch.setattr(rl_logprobs._TokenLogProbs, "CHUNK_ELEMENTS", rows * V)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T + 1, V, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(V, (B, T), generator=g)
    mask = torch.ones(B, T)
    sizes = _Float32Sizes()
    with sizes:
        logp, entropy = shifted_logprobs(logits, targets, mask, with_entropy=True)
        logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert 0 < sizes.largest <= rows * V < B * T * V
    ref, _ = reference(logits.detach().float(), targets, mask.double())
    torch.testing.assert_close(logp.double(), ref, atol=1e-4, rtol=1e-4)
