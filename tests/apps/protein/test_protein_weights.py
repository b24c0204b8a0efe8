"""The AlphaFold 2 / OpenFold parameter loader, on small files the test writes in that naming."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apps.protein.weights import ROOT, load_af2_params, save_af2_params
from protein_tiny import real_batch, tiny_model

EVO = ROOT + "evoformer/evoformer_iteration/"
IPA = ROOT + "structure_module/fold_iteration/invariant_point_attention/"


def test_roundtrip_through_the_official_naming(tmp_path):
    source = tiny_model(seed=0)
    path = save_af2_params(source, tmp_path / "params_model_tiny.npz")
    with np.load(path) as npz:
        keys = set(npz.files)
        # Stacked blocks, [in, out] weights, per-head attention tensors, as in params_model_*.npz.
        assert npz[EVO + "outer_product_mean/left_projection//weights"].shape == (1, 16, 4)
        assert npz[EVO + "msa_row_attention_with_pair_bias/attention//query_w"].shape == (1, 16, 2, 4)
        assert npz[EVO + "triangle_attention_starting_node//feat_2d_weights"].shape == (1, 8, 2)
        assert npz[IPA + "q_point_local//weights"].shape == (16, 2 * 2 * 3)
    assert ROOT + "evoformer/pair_activiations//weights" in keys  # AlphaFold's own spelling
    target = tiny_model(seed=1)
    unused = load_af2_params(target, path)
    assert unused == []
    for (name, a), b in zip(source.named_parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b), name
    batch = real_batch(crop=16, clusters=4, extra=4, batch=1)
    with torch.no_grad():
        assert torch.equal(source.eval()(**batch)["atom37"], target.eval()(**batch)["atom37"])


def test_layouts_follow_alphafold(tmp_path):
    """Hand-set values in AlphaFold's layout land where this model expects them."""
    model = tiny_model(seed=0)
    path = save_af2_params(model, tmp_path / "p.npz")
    params = dict(np.load(path))
    # query_w [c, heads, ch]: head h, channel k of the query is row h*ch + k of our q projection.
    qw = np.random.default_rng(0).standard_normal((1, 16, 2, 4)).astype(np.float32)
    params[EVO + "msa_row_attention_with_pair_bias/attention//query_w"] = qw
    # IPA query points are stored x of every (head, point), then y, then z.
    hp = 2 * 2
    bias = np.concatenate([np.full(hp, 1.0), np.full(hp, 2.0), np.full(hp, 3.0)]).astype(np.float32)
    params[IPA + "q_point_local//bias"] = bias
    np.savez(tmp_path / "q.npz", **params)
    assert load_af2_params(model, tmp_path / "q.npz") == []
    q = model.evoformer.blocks[0].row_attn.attn.q.weight.detach().numpy()
    assert np.allclose(q[1 * 4 + 3], qw[0, :, 1, 3])
    pts = model.structure_module.ipa.q_pts.bias.detach().numpy().reshape(hp, 3)
    assert np.allclose(pts, [[1.0, 2.0, 3.0]] * hp)


def test_wrong_files_are_refused(tmp_path):
    model = tiny_model(seed=0)
    path = save_af2_params(model, tmp_path / "p.npz")
    params = dict(np.load(path))
    del params[EVO + "pair_transition/transition1//weights"]
    np.savez(tmp_path / "missing.npz", **params)
    with pytest.raises(KeyError, match="pair_transition/transition1//weights"):
        load_af2_params(model, tmp_path / "missing.npz")
    bigger = tiny_model(seed=0, evoformer_blocks=2)
    with pytest.raises(ValueError, match="stacks 1 blocks where the config has 2"):
        load_af2_params(bigger, path)
    with pytest.raises(ValueError, match="stacks 2 blocks where the config has 1"):
        load_af2_params(model, save_af2_params(bigger, tmp_path / "bigger.npz"))
    params = dict(np.load(path))
    params[ROOT + "predicted_aligned_error_head/logits//weights"] = np.zeros((8, 64), np.float32)
    np.savez(tmp_path / "ptm.npz", **params)
    with pytest.raises(KeyError, match="set model.pae_head=true"):
        load_af2_params(model, tmp_path / "ptm.npz")
