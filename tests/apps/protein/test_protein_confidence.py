"""Predicted aligned error and pTM (AlphaFold 2 supplement 1.9.7) against hand computations, and
`predict` with the PAE head: it prints pTM and writes the PAE plot and AlphaFold's PAE JSON."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from apps.protein.metrics import pae_bin_centres, predicted_aligned_error, predicted_tm_score


def test_pae_bin_centres_are_alphafolds():
    centres = pae_bin_centres()
    assert centres.shape == (64,)
    assert torch.allclose(centres, torch.arange(64) * 0.5 + 0.25)   # 0.25, 0.75, ..., 31.75


def test_expected_error_and_ptm_by_hand():
    length = 30
    logits = torch.full((1, length, length, 64), -1e4)
    logits[..., 4] = 0.0                      # all mass on the bin centred at 2.25 A
    assert torch.allclose(predicted_aligned_error(logits), torch.full((1, length, length), 2.25))
    d0 = 1.24 * (length - 15) ** (1 / 3) - 1.8
    assert predicted_tm_score(logits).item() == pytest.approx(1 / (1 + (2.25 / d0) ** 2), rel=1e-5)
    # uniform logits: the mean of the centres (16 A)
    assert torch.allclose(predicted_aligned_error(torch.zeros(2, 3, 3, 64)), torch.full((2, 3, 3), 16.0))


def test_ptm_takes_the_best_aligned_residue_and_respects_the_mask():
    """Residue 0's frame sees every residue within 0.25 A, the others 31.75 A; short chains use
    N = 19 in d0; masked residues neither count nor score."""
    length = 8
    logits = torch.full((length, length, 64), -1e4)
    logits[..., 63] = 0.0
    logits[0, :, 63], logits[0, :, 0] = -1e4, 0.0
    d0 = 1.24 * (19 - 15) ** (1 / 3) - 1.8
    good, bad = 1 / (1 + (0.25 / d0) ** 2), 1 / (1 + (31.75 / d0) ** 2)
    assert predicted_tm_score(logits).item() == pytest.approx(good, rel=1e-5)
    mask = torch.ones(length)
    mask[0] = 0.0                              # without residue 0 every alignment is bad
    assert predicted_tm_score(logits, mask).item() == pytest.approx(bad, rel=1e-5)
    mask = torch.ones(length)
    mask[4:] = 0.0                             # residue 0's row, scored over residues 0-3 only
    logits[0, 5] = logits[1, 5]                # ... a bad entry among the masked ones changes nothing
    assert predicted_tm_score(logits, mask).item() == pytest.approx(good, rel=1e-5)


def test_predict_with_pae_head_prints_ptm_and_writes_the_pae(tmp_path, capsys):
    from safetensors.torch import save_file

    from apps.protein.config import load_recipe
    from apps.protein.model import AlphaFold
    from apps.protein.predict import main as predict_main

    overrides = ["model.pae_head=true", "model.evoformer_blocks=1", "model.structure.layers=2"]
    cfg = load_recipe("apps/protein/configs/tiny.yaml", overrides)
    torch.manual_seed(0)
    model = AlphaFold(cfg.model)
    with torch.no_grad():                      # a non-uniform PAE head (it starts at zero)
        model.heads.pae.weight.normal_(0.0, 0.5)
        model.heads.pae.bias.normal_(0.0, 1.0)
    (tmp_path / "ckpt" / "model").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    sequence = "MKTAYIAKQRQISFVKSHFSRQ"
    (tmp_path / "q.fasta").write_text(f">query\n{sequence}\n")
    out = tmp_path / "pred"
    predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(tmp_path / "ckpt"),
                  "--fasta", str(tmp_path / "q.fasta"), "--out", str(out), "--recycles", "0", *overrides])
    stdout = capsys.readouterr().out
    printed = json.loads(stdout[stdout.rindex('{\n "name"'):])
    assert printed == json.loads((out / "query.json").read_text())

    # the same forward by hand
    from apps.protein.predict import predict
    pred = predict(model.eval(), cfg, "query", sequence, None, 0)
    assert printed["ptm"] == pytest.approx(float(pred["ptm"]), rel=1e-5)
    pae = np.array(json.loads((out / "query_pae.json").read_text())[0]["predicted_aligned_error"])
    assert pae.shape == (len(sequence), len(sequence))
    assert np.allclose(pae, pred["pae"], atol=0.006)       # written to 2 decimals
    assert pae.std() > 0.1                                   # the random head gives a non-flat map
    logits = model(**_batch(cfg, sequence), recycles=0)["pae_logits"][0]
    assert np.allclose(pred["pae"], predicted_aligned_error(logits).detach().numpy(), atol=1e-4)
    import matplotlib.image as mpimg
    image = mpimg.imread(out / "query_pae.png")
    assert image.ndim == 3 and image.shape[0] > 300 and image[..., :3].std() > 0.05


def _batch(cfg, sequence):
    from apps.protein.features import FeatureConfig, make_features
    from apps.protein.io import ProteinChain

    n = len(sequence)
    chain = ProteinChain("q", sequence, np.zeros((n, 37, 3), np.float32), np.zeros((n, 37), np.float32),
                         np.arange(n, dtype=np.int64))
    fcfg = FeatureConfig(crop_size=n, max_msa_clusters=cfg.data.max_msa_clusters, max_extra_msa=cfg.data.max_extra_msa,
                         masked_msa_fraction=0.0)
    feats = make_features(chain, None, fcfg, np.random.default_rng(0), with_truth=False)
    return {k: torch.as_tensor(v)[None] for k, v in feats.items()}


def test_no_pae_head_no_pae_files(tmp_path):
    from apps.protein.predict import write_prediction

    n = 5
    pred = {"atom37": np.zeros((n, 37, 3), np.float32), "atom37_mask": np.zeros((n, 37), np.float32),
            "plddt": np.full(n, 50.0, np.float32), "distogram_logits": np.zeros((n, n, 64), np.float32)}
    pred["atom37_mask"][:, 1] = 1.0
    paths = write_prediction(pred, "MKTAY", "x", tmp_path)
    assert "pae_png" not in paths and not (tmp_path / "x_pae.json").exists()
    assert math.isclose(float(pred["plddt"].mean()), 50.0)
