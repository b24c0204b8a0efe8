"""apps/video_gen's data x sequence layout under the emulated GPU (PHALANX_EMULATE_GPU=1): the recipe
on 4 emulated GPUs with parallel.sp_size=2 (2 data-parallel replicas of 2 SP ranks, one process group
per SP pair), 2 steps with its evaluation, motion check on every rank and export, under DDP
(ranks_per_replica) and under ZeRO-2 and FSDP2 sharded over all four ranks
(apps/video_gen/sequence_replicas.py). A batch, noise draw or collective buffer left on the host fails
it as on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import run_module_emulated  # noqa: E402
from test_recipe_video_diffusion import VIDEO_PIXELS, check_video_run, emulated  # noqa: E402


def test_video_train_on_four_emulated_gpus_data_times_sequence_parallel(tmp_path):
    out = tmp_path / "video"
    output = emulated(run_module_emulated("apps.video_gen.train", *VIDEO_PIXELS, f"train.output_dir={out}",
                                          "parallel.sp_size=2", "model.gradient_checkpointing=true", ranks=4))
    assert "dp=2 x sp=2" in output, output[-3000:]
    check_video_run(out)


# FSDP2 with activation checkpointing: its forward prefetch during the recomputed forward leaves an
# all-gather that finalize_backward waits on through torch.accelerator.current_stream(), which the
# emulator now answers with its own stream (it failed with "Event device type CPU does not match
# blocking stream's device type EMUCUDA" before: an emulator gap, not a GPU one).
@pytest.mark.slow
@pytest.mark.parametrize("plugin, checkpointing", [("zero2", "true"), ("fsdp", "true")])
def test_video_train_on_four_emulated_gpus_data_times_sequence_sharded(tmp_path, plugin, checkpointing):
    out = tmp_path / "video"
    output = emulated(run_module_emulated("apps.video_gen.train", *VIDEO_PIXELS, f"train.output_dir={out}",
                                          f"train.plugin={plugin}", "parallel.sp_size=2",
                                          f"model.gradient_checkpointing={checkpointing}", ranks=4))
    assert "dp=2 x sp=2, sharded over all 4 ranks" in output, output[-3000:]
    check_video_run(out)
