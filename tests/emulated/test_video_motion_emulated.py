"""apps/video_gen's held-out motion check and EMA evaluation (issue 39 item 3) under the emulated GPU
(PHALANX_EMULATE_GPU=1): 2 steps of tiny.yaml (held-out caption combinations and EMA on, as the default),
the motion check on both prompt sets, and the export holding the EMA average of the checkpoint."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import run_module_emulated  # noqa: E402
from test_recipe_video_diffusion import VIDEO_PIXELS, emulated  # noqa: E402


def test_video_held_out_motion_check_on_ema_weights_on_one_emulated_gpu(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "video"
    emulated(run_module_emulated("apps.video_gen.train", *VIDEO_PIXELS, f"train.output_dir={out}",
                                 "data.held_out_combos=true", "eval.ema_decay=0.5", "train.lr=3e-3"))
    final = json.loads((out / "summary.json").read_text())["final"]
    for split in ("held_out", "trained"):
        assert final[f"motion_{split}_clips"] == 4
        assert 0 <= final[f"motion_{split}_both_lo"] <= final[f"motion_{split}_both"] <= final[f"motion_{split}_both_hi"]
    checkpoint = max((out / "checkpoints").iterdir())
    averaged = load_file(str(checkpoint / "ema" / "ema.safetensors"))
    trained = load_file(str(next((checkpoint / "model").glob("*.safetensors"))))
    exported = load_file(str(next((out / "pipeline" / "transformer").glob("*.safetensors"))))
    name = "proj_out.weight"
    assert torch.equal(exported[name], averaged[f"transformer.{name}"])
    assert not torch.allclose(exported[name], trained[f"transformer.{name}"])
