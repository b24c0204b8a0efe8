"""apps/video_gen's data x sequence layout under the emulated GPU (PHALANX_EMULATE_GPU=1): the recipe
on 4 emulated GPUs with parallel.sp_size=2 (2 data-parallel replicas of 2 SP ranks: DDP's
ranks_per_replica, one process group per SP pair), 2 steps with its evaluation, motion check on every
rank and export. A batch, noise draw or collective buffer left on the host fails it as on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import run_module_emulated  # noqa: E402
from test_recipe_video_diffusion import VIDEO_PIXELS, check_video_run, emulated  # noqa: E402


def test_video_train_on_four_emulated_gpus_data_times_sequence_parallel(tmp_path):
    out = tmp_path / "video"
    output = emulated(run_module_emulated("apps.video_gen.train", *VIDEO_PIXELS, f"train.output_dir={out}",
                                          "parallel.sp_size=2", "model.gradient_checkpointing=true", ranks=4))
    assert "dp=2 x sp=2" in output, output[-3000:]
    check_video_run(out)
