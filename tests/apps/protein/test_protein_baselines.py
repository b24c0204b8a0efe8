"""The held-out baselines: an ideal alpha-helix and random coils, scored by the same Ca metrics."""
from __future__ import annotations

import math

import pytest
import torch

from apps.protein import constants as rc
from apps.protein.scoring import ideal_helix_ca, random_coil_ca, score_baselines

CA = rc.ATOM37_INDEX["CA"]


def test_ideal_helix_has_alpha_helix_distances():
    x = ideal_helix_ca(8)
    d = [(x[i] - x[0]).norm().item() for i in (1, 3, 4)]
    # chord 2 r sin(50 deg) with 1.5 A rise; i+3: 300 degrees round, 4.5 A up; i+4: 40 degrees, 6 A up
    assert d[0] == pytest.approx(math.hypot(2 * 2.3 * math.sin(math.radians(50)), 1.5))
    assert d[1] == pytest.approx(math.hypot(2.3, 4.5)) and d[2] == pytest.approx(math.hypot(2 * 2.3 * math.sin(math.radians(20)), 6.0))


def test_random_coil_keeps_its_steps_and_angles():
    x = random_coil_ca(20, torch.Generator().manual_seed(3))
    steps = x[1:] - x[:-1]
    assert torch.allclose(steps.norm(dim=-1), torch.full((19,), 3.8, dtype=torch.float64))
    cos = (-(steps[:-1] * steps[1:]).sum(-1)) / 3.8 ** 2           # the Ca-Ca-Ca angle
    assert torch.allclose(cos, torch.full((18,), math.cos(math.radians(120)), dtype=torch.float64))


def _crop(ca: torch.Tensor):
    pos = torch.zeros(ca.shape[0], 37, 3)
    pos[:, CA] = ca.float()
    mask = torch.zeros(ca.shape[0], 37)
    mask[:, CA] = 1
    return "x", {"all_atom_positions": pos, "all_atom_mask": mask}


def test_baselines_score_a_helix_truth_as_the_helix_and_not_the_coil():
    out = score_baselines([_crop(ideal_helix_ca(40) + 5.0)], coil_samples=4)
    assert out["helix"]["lddt_ca"] == pytest.approx(1.0) and out["helix"]["tm_score"] == pytest.approx(1.0, abs=1e-4)
    assert out["helix"]["rmsd"] == pytest.approx(0.0, abs=1e-3)
    assert out["coil"]["lddt_ca"] < 0.6 and out["coil"]["tm_score"] < 0.4
