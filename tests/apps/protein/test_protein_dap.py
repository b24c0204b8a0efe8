"""Dynamic Axial Parallelism equals one process, forward and backward, on 2 and 4 gloo ranks.

Tolerance: the same arithmetic with sums split differently (row blocks of einsums, gathered
operands), so `rounding_rtol(fp32, n)` with n the longest reduction behind a weight gradient:
batch x residues x residues x MSA rows (the outer product mean's weight gradient)."""
from __future__ import annotations

import pytest
import torch

from phalanx.testing import check, rel_diff, rounding_rtol, spawn
from protein_tiny import dap_ranks, predict_dap_ranks


def _compare(results, crop, rows, zero_ok=()):
    """`rows`: the MSA rows the trunk reduces over, the extra MSA stack's included (its gradients,
    e.g. its outer product mean's bias, sum over crop² positions of its rows: with n counting only the
    clusters, AVX2 kernels measured 1.03x that bound there)."""
    tol = rounding_rtol(torch.float32, 2 * crop * crop * rows)
    for rank, r in enumerate(results):
        one, dap = r["one"], r["dap"]
        check(rel_diff(dap["loss"], one["loss"]), tol, f"rank {rank} loss")
        check(rel_diff(dap["atom37"], one["atom37"]), tol, f"rank {rank} atom positions")
        check(rel_diff(dap["pair"], one["pair"]), tol, f"rank {rank} pair representation")
        check(rel_diff(dap["msa_logits"], one["msa_logits"]), tol, f"rank {rank} masked-MSA logits")
        # The bias of a pair-bias projection (IPA's) or of the LayerNorm before one (row attention's)
        # shifts every logit of a row equally, which the softmax ignores: the true gradient is 0 and
        # both runs hold rounding noise (~1e-9 of the largest gradient). Those tensors are compared
        # on the scale of the largest gradient instead.
        biggest = max(g.abs().max().item() for g in one["grads"].values())
        noise = {k for k, g in one["grads"].items() if g.abs().max() < 1e-6 * biggest}
        assert noise <= {k for k in noise if k.endswith(("row_attn.norm_z.bias", "ipa.bias.bias", *zero_ok))}, f"unexpected zero gradients {noise}"
        for k in noise:
            assert dap["grads"][k].abs().max() < 1e-6 * biggest, k
        real = {k: g for k, g in one["grads"].items() if k not in noise}
        check(rel_diff({k: dap["grads"][k] for k in real}, real), tol, f"rank {rank} gradients")


def test_dap_two_ranks_equals_one_process():
    results = spawn(dap_ranks, 2, 16, 4, 4, timeout=300)
    _compare(results, 16, 4 + 4)


def test_dap_chunked_equals_one_process_whole():
    """DAP on 2 ranks with attention, outer product mean and triangle multiplications chunked
    (3 rows at a time of each rank's 8: uneven chunks) against one process unchunked, both with
    AlphaFold's dropout from the same random state: each rank draws the whole row-/column-wise
    mask and keeps its slice, so the split does not change which entries are dropped."""
    results = spawn(dap_ranks, 2, 16, 4, 4, 3, True, timeout=300)
    _compare(results, 16, 4 + 4)


@pytest.mark.slow
def test_dap_with_templates_equals_one_process():
    """With the template stack (run whole on every rank) and one template row joining the 3 MSA
    clusters (4 rows split over 2 ranks), DAP equals one process, forward and backward."""
    results = spawn(dap_ranks, 2, 16, 3, 4, None, False, 1, timeout=300)
    # one template: the pointwise attention's softmax has one entry (weight 1), so its query and
    # key weights have no gradient but rounding noise
    _compare(results, 16, 3 + 1 + 4, zero_ok=("pointwise.q.weight", "pointwise.k.weight"))


@pytest.mark.slow
def test_dap_four_ranks_equals_one_process():
    results = spawn(dap_ranks, 4, 16, 4, 4, timeout=400)
    _compare(results, 16, 4 + 4)


@pytest.mark.slow
def test_predict_with_dap_and_chunking_equals_one_process():
    """`predict` of a 21-residue sequence on 2 DAP ranks (padded to 22, the padding masked) with
    the Evoformer chunked 4 rows at a time equals the one-process, unchunked prediction: atoms,
    pLDDT, PAE and pTM at `rounding_rtol(fp32, n)`, n = residues^2 x MSA rows (measured: equal to
    the bit). ~40 s at load ~20, hence slow."""
    results = spawn(predict_dap_ranks, 2, 21, 4, timeout=300)
    tol = rounding_rtol(torch.float32, 21 * 21 * 4)
    for rank, r in enumerate(results):
        one, dap = r["one"], r["dap"]
        assert dap["atom37"].shape == one["atom37"].shape == (21, 37, 3) and dap["pae"].shape == (21, 21)
        for key in ("atom37", "plddt", "pae", "ptm", "distogram_logits"):
            check(rel_diff(torch.as_tensor(dap[key]), torch.as_tensor(one[key])), tol, f"rank {rank} predict {key}")


def test_predict_refuses_a_world_that_is_not_the_dap_group():
    from apps.protein.predict import dap_axial

    with pytest.raises(ValueError, match="exactly 2 ranks, got 1"):
        dap_axial(2)


def test_dap_rejects_uneven_split():
    import pytest as _pytest
    from apps.protein.model.dap import DapAxial

    ax = DapAxial.__new__(DapAxial)
    ax.size = 3
    with _pytest.raises(ValueError, match="multiple of 3"):
        ax._check(torch.zeros(2, 16, 8), 1)
