"""Pieces of sequence parallelism in one process: block attention with log-sum-exp (forward and
backward, against autograd of plain attention), the online-softmax merge, the zigzag layout,
and the same block functions through the Triton flash-attention kernels (CPU interpreter)."""
from __future__ import annotations

import pytest
import torch

from phalanx.sequence.blocks import block_backward_reference, block_forward_reference, merge
from phalanx.sequence.context import SequenceContext
from phalanx.testing import check, rel_diff, rounding_rtol

# fp32 attention by blocks against plain attention: rel errors within rounding_rtol of the longest
# reduction (the keys, or the head dimension, whichever is longer)


def _plain(q, k, v, causal, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        T, S = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1 + S - T), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_backward_match_autograd(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, requires_grad=True)
    scale = 8 ** -0.5
    want = _plain(q, k, v, causal, scale)
    do = torch.randn_like(want)
    want.backward(do)
    o, lse = block_forward_reference(q.detach(), k.detach(), v.detach(), causal, scale)
    tol = rounding_rtol(torch.float32, 8)  # 6 keys, head dimension 8
    check(rel_diff(o, want), tol, "block forward: output")  # blocks compute in fp32
    dq, dk, dv = block_backward_reference(do, q.detach(), k.detach(), v.detach(), o, lse, causal, scale)
    check(rel_diff({"dq": dq, "dk": dk, "dv": dv}, {"dq": q.grad, "dk": k.grad, "dv": v.grad}), tol,
          "block backward")


def test_merging_key_blocks_equals_attention_over_all_keys():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    out = lse = None
    for ks, vs in zip(k.split(4, 2), v.split(4, 2), strict=True):
        o_b, lse_b = block_forward_reference(q, ks, vs, False, 0.3)
        out, lse = merge(out, lse, o_b, lse_b)
    check(rel_diff(out, _plain(q, k, v, False, 0.3)), rounding_rtol(torch.float32, 12), "merged key blocks")


def test_zigzag_layout_balances_and_restores_order():
    seq = SequenceContext("ring", None, 4, 1)
    assert seq.chunk_ids() == (1, 6)
    assert seq.local_positions(16).tolist() == [2, 3, 12, 13]
    held = torch.cat([SequenceContext("ring", None, 4, r).local_positions(16) for r in range(4)])
    assert torch.equal(held[seq.global_order(16)], torch.arange(16))
    # causal work per rank (visible query/key pairs) is equal under zigzag
    work = [sum(p + 1 for p in SequenceContext("ring", None, 4, r).local_positions(16).tolist()) for r in range(4)]
    assert len(set(work)) == 1


def _triton_blocks():
    from phalanx_kernels import use_backend

    from phalanx.sequence.blocks import block_backward, block_forward

    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 16, 16), torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    do = torch.randn(1, 4, 16, 16)
    out = {}
    for causal in (False, True):
        ref_o, ref_lse = block_forward_reference(q, k, v, causal, 0.25)
        ref_grads = block_backward_reference(do, q, k, v, ref_o, ref_lse, causal, 0.25)
        with use_backend("triton"):
            o, lse = block_forward(q, k, v, causal, 0.25)
            grads = block_backward(do, q, k, v, o, lse, causal, 0.25)
        out[causal] = rel_diff({"o": o, "lse": lse, "dq": grads[0].float(), "dk": grads[1].float(),
                                "dv": grads[2].float()},
                               {"o": ref_o, "lse": ref_lse, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]})
    return out


def test_block_functions_run_the_triton_kernels():
    """On CUDA the ring uses phalanx_kernels' flash-attention kernels; here they run under the
    Triton CPU interpreter (in a fresh process, which must set TRITON_INTERPRET before import)."""
    pytest.importorskip("triton")
    from phalanx.testing import spawn

    diffs = spawn(_triton_blocks, 1, env={"TRITON_INTERPRET": "1"})[0]
    assert set(diffs) == {False, True}
    for causal, diff in diffs.items():  # fp32 kernels: 16 keys, head dimension 16
        check(diff, rounding_rtol(torch.float32, 16), f"Triton blocks (causal={causal})")
