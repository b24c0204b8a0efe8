"""pLDDT calibration (`apps.protein.calibrate`) and the confidence metrics every eval reports:
the calibration set excludes the fitted chains and the held-out chains' PDB entries, the head fit
learns a target it can express, only the pLDDT head changes, and the metrics match hand values."""
from __future__ import annotations

import json

import pytest
import torch

from apps.protein.calibrate import calibration_entries, fit_head, head_inputs
from apps.protein.model.alphafold import plddt_from_logits
from apps.protein.scoring import confidence_metrics, pearson


def test_calibration_chains_are_neither_fitted_nor_held_out_entries():
    assert [f"{s}_{c}" for s, c, _ in calibration_entries(4)] == ["4zey_A", "1aki_A", "1k6p_A", "2crb_A"]
    with pytest.raises(ValueError, match="max_train_chains=0"):
        calibration_entries(0)


def test_pearson_and_confidence_metrics_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert pearson(x, 2 * x + 1) == pytest.approx(1.0) and pearson(x, -x) == pytest.approx(-1.0)
    assert pearson(x, torch.ones(4)) == 0.0
    # a straight 4-residue chain predicted exactly: true lDDT 1.0 everywhere (x 100)
    ca = torch.tensor([[0.0, 0, 0], [3.8, 0, 0], [7.6, 0, 0], [11.4, 0, 0]])
    m = confidence_metrics(torch.tensor([90.0, 80.0, 100.0, 70.0]), ca, ca, torch.ones(4))
    assert m["plddt_error"] == pytest.approx(15.0)                 # |90-100| + 20 + 0 + 30, over 4


def test_fit_head_learns_a_target_of_its_input():
    from apps.protein.model.alphafold import Heads, ModelConfig

    torch.manual_seed(0)
    head = Heads(ModelConfig(c_s=8, c_z=4)).plddt
    single = torch.randn(6, 10, 8)
    target = 100 * torch.sigmoid(2 * single[..., 0])                # what the head should learn to say
    mask = torch.ones(6, 10)
    said = lambda: plddt_from_logits(head(single)).detach()         # noqa: E731
    assert pearson(said().flatten(), target.flatten()) < 0.5        # the zero-initialised last layer: flat
    losses = fit_head(head, single, target, mask, steps=150, lr=3e-3)
    assert losses[-1] < 0.8 * losses[0]
    assert pearson(said().flatten(), target.flatten()) > 0.9
    assert (said() - target).abs().mean() < 10


def test_calibrate_changes_only_the_plddt_head(tmp_path):
    from safetensors.torch import load_file, save_file

    from apps.protein.calibrate import calibrate
    from apps.protein.config import load_recipe
    from apps.protein.model import AlphaFold

    overrides = ["model.evoformer_blocks=1", "model.structure.layers=2", "data.crop_size=16", "eval_recycles=0"]
    cfg = load_recipe("apps/protein/configs/tiny.yaml", overrides)
    torch.manual_seed(0)
    model = AlphaFold(cfg.model)
    (tmp_path / "ckpt" / "model").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    result = calibrate(cfg, str(tmp_path / "ckpt"), tmp_path / "cal", steps=20, lr=3e-3, windows=1)
    before, after = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors")), load_file(str(tmp_path / "cal" / "model" / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("heads.plddt.") for k in changed)
    saved = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert saved["heldout_before"].keys() == saved["heldout_after"].keys() == {"4i6p_A", "5kc1_F", "5zng_C", "pooled"}
    assert result["calibration_crops"] == 4 + 4 + 4 and saved["loss_first_last"][1] < saved["loss_first_last"][0]
    # the held-out figures are the calibrated head's: recomputed from the saved checkpoint
    from apps.protein.dataset import fixed_crops, load_entries
    from apps.protein.data_sets import HELD_OUT
    from apps.protein.predict import load_model

    _, _, mask, said = head_inputs(load_model(cfg, str(tmp_path / "cal")), fixed_crops(load_entries(HELD_OUT), cfg.data), 0)
    assert float(said[0][mask[0] > 0].mean()) == pytest.approx(saved["heldout_after"]["4i6p_A"]["plddt"], abs=1e-3)
