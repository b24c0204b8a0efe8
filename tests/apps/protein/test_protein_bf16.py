"""bf16 with AlphaFold's / OpenFold's fp32 islands: the model cast to bf16 (what the precision
plugins do) computes its linear layers in bf16 and keeps in fp32 the softmax (inside
`masked_softmax`), layer-norm statistics, the structure module's frames, points and rigid
operations, the torsions and atoms, the ideal-geometry tables, counts over MSA rows and the heads'
logits (losses and confidences).

The comparison: the bf16 model against the same bf16-rounded weights run in fp32, so what differs
is the arithmetic, not the weights. Bounds in units of bf16's eps (7.8e-3) relative to each
tensor's largest entry, measured on three seeds (see each check): the Evoformer's outputs within
2 eps (measured <= 1.4 eps), the structure module's atoms and frames, computed in fp32 from the
Evoformer's bf16 outputs and amplifying their differences over its layers, within 6 eps
(measured <= 4.2 eps over seeds 0-2). Recycling is off: its
distogram bins the first pass's positions, so a 0.01 A difference can move a pair into the next
bin (a discontinuity, not an error)."""
from __future__ import annotations

import copy

import numpy as np

import pytest
import torch

from apps.protein.model.primitives import LayerNorm
from phalanx.testing import check, rel_diff
from protein_tiny import real_batch, tiny_model

EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture(scope="module")
def runs():
    batch = real_batch(crop=16, batch=2)
    model = tiny_model(seed=0)
    low = copy.deepcopy(model).to(torch.bfloat16)
    reference = copy.deepcopy(low).float()     # the same (rounded) weights in fp32
    with torch.no_grad():
        return low, reference(**batch, recycles=0), low(**batch, recycles=0), batch


def test_bf16_outputs_match_fp32_within_the_stated_bound(runs):
    _, want, got, _ = runs
    for key, eps_units in (("pair", 2), ("distogram_logits", 2), ("masked_msa_logits", 2), ("plddt", 2),
                           ("single", 2), ("atom37", 6), ("frames_trans", 6), ("frames_rot", 6)):
        check(rel_diff(got[key].float(), want[key]), eps_units * EPS, f"bf16 {key}")


def test_the_islands_are_fp32(runs):
    low, _, got, _ = runs
    assert low.single.weight.dtype == torch.bfloat16 and got["pair"].dtype == torch.bfloat16  # bf16 where it should be
    for key in ("frames_rot", "frames_trans", "angles", "atom14", "atom37", "group_rot", "plddt", "plddt_logits",
                "distogram_logits", "masked_msa_logits", "experimentally_resolved_logits"):
        assert got[key].dtype == torch.float32, key
    assert low.default_frames.dtype == low.atom14_local.dtype == torch.float32   # not rounded by .to(bf16)
    assert got["single"].dtype == torch.float32                                   # the structure module's state


def test_structure_module_runs_in_fp32(runs, monkeypatch):
    import apps.protein.model.structure as structure

    low, _, _, batch = runs
    seen = []
    inner = structure.masked_softmax
    monkeypatch.setattr(structure, "masked_softmax", lambda x, *a: seen.append(x.dtype) or inner(x, *a))
    frames, layers = [], []
    low.structure_module.ipa.register_forward_hook(lambda mod, args, out: frames.append(args[2].rot.dtype))
    low.structure_module.ipa.q.register_forward_hook(lambda mod, args, out: layers.append(out.dtype))
    with torch.no_grad():
        low(**batch, recycles=0)
    assert seen and set(seen) == set(frames) == set(layers) == {torch.float32}
    assert low.structure_module.ipa.q.weight.dtype == torch.bfloat16   # stored in bf16, computed in fp32


def test_layer_norm_statistics_are_fp32():
    """Rows with a large mean (1000 + noise): bf16 statistics lose the noise entirely; the
    LayerNorm of a bf16 input equals the fp32 computation rounded to bf16 (1 ulp)."""
    torch.manual_seed(0)
    norm = LayerNorm(64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = (1000 + torch.randn(4, 64)).to(torch.bfloat16)
    want = norm(x.float())
    got = copy.deepcopy(norm).to(torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 7)
    assert (got.float() - want).abs().max() <= ulp


@pytest.mark.parametrize("terms,grad_eps", [("evoformer", 2), ("all", 8)])
def test_bf16_gradients_follow_fp32(runs, terms, grad_eps):
    """One backward pass (no recycling): the loss within eps / 8 of fp32's; the gradient norm
    within 2 eps for the Evoformer's own terms (distogram, masked MSA: measured 0.14 eps) and within
    8 eps for the whole AlphaFold loss (measured 5.5 eps: FAPE and pLDDT reach the Evoformer
    through the structure module, which amplifies the Evoformer's 1-eps output differences, as
    its atoms' 3 eps above show)."""
    from apps.protein.losses import LossWeights, alphafold_loss

    low, _, _, batch = runs
    weights = (LossWeights(experimentally_resolved=0.01) if terms == "all" else
               LossWeights(fape_backbone=0, fape_sidechain=0, torsion=0, plddt=0))
    reference = copy.deepcopy(low).float()
    losses, norms = [], []
    for model in (reference, low):
        out = model(**batch, recycles=0)
        tables = {"default_frames": model.default_frames, "atom14_local": model.atom14_local}
        loss, _ = alphafold_loss(out, batch, tables, weights)
        loss.backward()
        losses.append(loss.detach())
        norms.append(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)))
        model.zero_grad()
    assert losses[1].dtype == torch.float32
    check(rel_diff(losses[1], losses[0]), EPS / 8, f"bf16 loss ({terms})")
    check(rel_diff(norms[1], norms[0]), grad_eps * EPS, f"bf16 gradient norm ({terms})")


def test_predict_in_bf16_matches_fp32(tmp_path):
    """`predict ... train.precision=bf16` loads the checkpoint, casts it to bf16 (islands in fp32)
    and predicts what fp32 predicts with the same (bf16-rounded) weights: Ca positions within the
    6 eps above, the PAE map within 2 eps, pLDDT within 2 points."""
    from safetensors.torch import save_file

    from apps.protein.config import load_recipe
    from apps.protein.model import AlphaFold
    from apps.protein.predict import load_model, predict

    overrides = ["model.evoformer_blocks=1", "model.structure.layers=2", "model.pae_head=true"]
    cfg = load_recipe("apps/protein/configs/tiny.yaml", overrides)
    torch.manual_seed(0)
    model = AlphaFold(cfg.model)
    with torch.no_grad():     # every output layer non-zero, rounded to bf16 so both runs hold the same weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
            p.copy_(p.to(torch.bfloat16).float())
    (tmp_path / "ckpt" / "model").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    sequence = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
    preds = {}
    for precision in ("fp32", "bf16"):
        cfg = load_recipe("apps/protein/configs/tiny.yaml", [*overrides, f"train.precision={precision}"])
        loaded = load_model(cfg, str(tmp_path / "ckpt"))
        assert loaded.single.weight.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        preds[precision] = predict(loaded, cfg, "query", sequence, None, 0)
    want, got = preds["fp32"], preds["bf16"]
    assert got["atom37"].dtype == want["atom37"].dtype == np.float32
    ca = slice(None), 1
    check(rel_diff(torch.as_tensor(got["atom37"][ca]), torch.as_tensor(want["atom37"][ca])), 6 * EPS, "bf16 predict Ca")
    assert np.abs(got["plddt"] - want["plddt"]).max() < 2.0
    check(rel_diff(torch.as_tensor(got["pae"]), torch.as_tensor(want["pae"])), 2 * EPS, "bf16 predict PAE")
