"""apps/video_gen and apps/diffusion under the emulated GPU (PHALANX_EMULATE_GPU=1): each recipe's
commands cut to 2 steps, with their evaluation, export and sampling phases, on 1 rank and on 2
(`phalanx run -n 2`). A tensor left on the host next to a device one, or a collective on a CPU
tensor, fails these runs as it would on a GPU.

The diffusion runs set USE_HUB_KERNELS=0: transformers' `from_pretrained` switches on the hub
`kernels` library by default, and its `kernelize` refuses the emulated device type ("Unsupported
device type 'emucuda'") when the model's train/eval mode changes; a real CUDA device is accepted.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import on_the_device, run_module_emulated  # noqa: E402

VIDEO = ["data.shapes_videos=24", "data.shapes_images=16", "data.clips_per_video=2",
         "model.num_layers=2", "model.num_heads=2", "model.head_dim=8", "model.ffn_dim=32", "model.freq_dim=16",
         "model.text_hidden_size=32", "model.text_layers=1", "model.text_heads=2",
         "train.max_steps=2", "train.save_every=0", "train.log_every=1", "train.warmup_steps=0",
         "train.progress_bar=false", "train.plot=false", "eval.max_clips=8", "eval.motion_samples=4",
         "eval.sample_steps=2"]
VIDEO_PIXELS = ["--config", "apps/video_gen/configs/tiny.yaml", *VIDEO,
                "data.buckets=[[1,16,16,8],[8,16,16,4],[8,16,28,2]]"]
VAE = ["--config", "apps/video_gen/configs/vae_tiny.yaml", "data.shapes_videos=16", "data.shapes_images=8",
       "data.clips_per_video=1", "data.buckets=[[1,16,16,4],[9,16,16,2],[9,16,28,2]]", "vae.base_dim=8",
       "vae.held_out_clips=2", "train.max_steps=2", "train.save_every=0", "train.log_every=1",
       "train.warmup_steps=0", "train.progress_bar=false", "train.plot=false"]
VIDEO_LATENT = ["--config", "apps/video_gen/configs/tiny_latent.yaml", *VIDEO,
                "data.buckets=[[1,16,16,8],[9,16,16,4],[9,16,28,2]]", "vae.sample_posterior=true"]

DIFFUSION = ["--config", "apps/diffusion/configs/tiny_emoji.yaml", "model.unet_channels=[32,32]",
             "model.unet_norm_groups=8", "model.unet_attention_head_dim=8", "model.text_hidden_size=32",
             "model.text_layers=1", "model.text_heads=2", "data.resolution=64", "data.max_images=8",
             "train.micro_batch_size=4", "train.log_every=1", "train.progress_bar=false", "train.plot=false",
             "train.save_every=0", "train.warmup_steps=0", "train.max_steps=2", "validation.num_inference_steps=2",
             "validation.prompts=[dog face,red apple]"]
DREAMBOOTH = ["--config", "apps/diffusion/configs/dreambooth_tiny.yaml", "data.resolution=64", "train.log_every=1",
              "train.progress_bar=false", "train.plot=false", "train.save_every=0", "train.warmup_steps=0",
              "train.max_steps=2", "train.micro_batch_size=2", "validation.num_inference_steps=2",
              "validation.every=1", "dreambooth.num_class_images=2", "dreambooth.class_generation_steps=2",
              "lora.rank=4", "dreambooth.fidelity_samples=2"]
NO_HUB_KERNELS = {"USE_HUB_KERNELS": "0"}


def emulated(output: str) -> str:
    assert on_the_device(output), output[-2000:]
    return output


def eval_lines(output_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in lines if any(k.startswith("eval/") for k in r)]


def check_video_run(out: Path, steps: int = 2, space: str = "pixel space") -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["space"] == space
    initial, final = summary["initial"]["loss"], summary["final"]["loss"]
    assert math.isfinite(final) and 0 < final < initial, summary  # two steps at lr 1e-3 lower the held-out loss
    assert summary["final"]["motion_clips"] == 4 and 0 <= summary["final"]["motion_colour"] <= 1
    assert all(math.isfinite(v) for k, v in summary["final"].items() if k.startswith("direction_gap"))
    assert (out / "eval" / "motion_samples.gif").stat().st_size > 0
    assert (out / "pipeline" / "video_gen.json").is_file()
    return summary


def test_video_train_then_sample_on_one_emulated_gpu(tmp_path):
    out = tmp_path / "video"
    emulated(run_module_emulated("apps.video_gen.train", *VIDEO_PIXELS, f"train.output_dir={out}"))
    check_video_run(out)
    samples = tmp_path / "samples"
    printed = run_module_emulated("apps.video_gen.sample", "a red square moving left", "a blue circle moving up",
                                  "--pipeline", str(out / "pipeline"), "--out", str(samples), "--steps", "2")
    written = sorted(p.name for p in samples.iterdir())
    assert written == ["00_a_red_square_moving_left.gif", "00_a_red_square_moving_left.mp4",
                       "01_a_blue_circle_moving_up.gif", "01_a_blue_circle_moving_up.mp4"], printed
    assert all((samples / name).stat().st_size > 0 for name in written)


def test_video_train_on_two_emulated_gpus_with_sequence_parallelism(tmp_path):
    out = tmp_path / "video"
    emulated(run_module_emulated("apps.video_gen.train", *VIDEO_PIXELS, f"train.output_dir={out}",
                                 "parallel.sp_size=2", "model.gradient_checkpointing=true", ranks=2))
    check_video_run(out)


def test_video_autoencoder_then_latent_stage_on_one_emulated_gpu(tmp_path):
    vae_out = tmp_path / "vae_run"
    emulated(run_module_emulated("apps.video_gen.train_vae", *VAE, f"train.output_dir={vae_out}"))
    summary = json.loads((vae_out / "vae_summary.json").read_text())
    assert summary["steps"] == 2 and 0 < summary["final"]["psnr"] < 60, summary
    assert len(summary["latents_mean"]) == 4 and all(s > 0 for s in summary["latents_std"])
    out = tmp_path / "latent"
    emulated(run_module_emulated("apps.video_gen.train", *VIDEO_LATENT, f"vae.from_dir={vae_out / 'vae'}",
                                 f"train.output_dir={out}"))
    check_video_run(out, space="latent space")
    assert (out / "pipeline" / "vae" / "config.json").is_file()


def test_video_fine_tune_from_diffusers_wan_parts_on_one_emulated_gpu_exports_a_wan_pipeline(tmp_path):
    """A pretrained start (model.transformer_dir / text_encoder_dir / vae.from_dir on a diffusers Wan
    layout of tiny random parts), the motion check sampling on the scheduler's grid on the device, and
    the export opened by diffusers' WanPipeline, which samples the recipe's clip."""
    import torch
    from diffusers import WanPipeline

    from apps.video_gen.pipeline import VideoPipeline

    sys.path.insert(0, str(Path(__file__).parents[1] / "apps" / "video_gen"))
    from video_tiny import save_wan_parts

    save_wan_parts(tmp_path / "wan")
    wan, out = str(tmp_path / "wan"), tmp_path / "video"
    emulated(run_module_emulated(
        "apps.video_gen.train", "--config", "apps/video_gen/configs/tiny.yaml", *VIDEO, f"train.output_dir={out}",
        "data.shapes_frames=9", "data.clip_frames=9", "data.clips_dir=null", "data.buckets=[[1,16,16,8],[9,16,16,4]]",
        "model.position_channels=false", "model.motion_channels=false", "model.pooled_text=false",
        "model.prompt_position=false", "flow.skip_data_std=0.0", "model.patch_size=[1,2,2]", "eval.sampler=scheduler",
        f"model.transformer_dir={wan}", f"model.text_encoder_dir={wan}", f"vae.from_dir={wan}"))
    check_video_run(out, space="latent space")
    assert json.loads((out / "pipeline" / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    theirs = WanPipeline.from_pretrained(str(out / "pipeline"))(
        prompt="a red square moving left", num_frames=9, height=16, width=16, num_inference_steps=2,
        guidance_scale=2.0, generator=torch.Generator().manual_seed(0), max_sequence_length=12, output_type="pt")
    ours = VideoPipeline.from_pretrained(out / "pipeline")(["a red square moving left"], seed=0, steps=2)
    assert torch.allclose(ours, theirs.frames.permute(0, 2, 1, 3, 4) * 2 - 1, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_emoji_fsdp(tmp_path_factory):
    """Text-to-image on 2 emulated GPUs under FSDP2 (EMA, held-out fixed-noise validation loss, grid,
    export), with random crop + flip: the crops are encoded by the VAE on the device inside the step."""
    out = tmp_path_factory.mktemp("emulated_diffusion") / "tiny_emoji"
    emulated(run_module_emulated("apps.diffusion.train_text_to_image", *DIFFUSION, f"train.output_dir={out}",
                                 "train.plugin=fsdp", "validation.held_out=4", "data.random_flip=true",
                                 "data.random_crop=true", "data.resize_scale=1.25", ranks=2, **NO_HUB_KERNELS))
    return out


def test_text_to_image_on_two_emulated_gpus_fsdp(tiny_emoji_fsdp):
    out = tiny_emoji_fsdp
    evals = eval_lines(out)
    assert [r["step"] for r in evals] == [2]
    assert math.isfinite(evals[0]["eval/loss"]) and 0 < evals[0]["eval/loss"] < 2 and evals[0]["eval/images"] == 2
    assert (out / "validation" / "step-000002.png").stat().st_size > 0
    assert list((out / "cache").glob("latents-64px-*.safetensors"))
    assert (out / "pipeline" / "model_index.json").is_file()


@pytest.mark.slow
def test_dreambooth_lora_then_sample_on_one_emulated_gpu(tiny_emoji_fsdp, tmp_path):
    out = tmp_path / "dreambooth"
    emulated(run_module_emulated("apps.diffusion.train_dreambooth", *DREAMBOOTH,
                                 f"model.init_from={tiny_emoji_fsdp / 'pipeline'}", f"train.output_dir={out}",
                                 **NO_HUB_KERNELS))
    assert len(list((out / "class_images").glob("*.png"))) == 2
    assert [r["step"] for r in eval_lines(out)] == [1, 2]
    report = json.loads((out / "fidelity.json").read_text())
    for key in ("before", "after", "class_prompt_after"):
        assert all(math.isfinite(v) and v >= 0 for v in report[key].values()), report
    lora = out / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_size > 0
    samples = tmp_path / "samples"
    run_module_emulated("apps.diffusion.sample", "--pipeline", str(tiny_emoji_fsdp / "pipeline"), "--lora",
                        str(out / "lora"), "--prompt", "sks cat face", "--prompt", "dog face", "--steps", "2",
                        "--out", str(samples), **NO_HUB_KERNELS)
    assert sorted(p.name for p in samples.glob("*.png")) == ["000-sks_cat_face.png", "001-dog_face.png", "grid.png"]
