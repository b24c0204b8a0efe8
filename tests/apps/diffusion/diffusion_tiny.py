"""The tiny diffusion recipe used by these tests (importable by spawned ranks too), and a tiny
random Stable Diffusion pipeline saved in the real diffusers layout."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "apps" / "diffusion" / "configs"
TINY = CONFIGS / "tiny_emoji.yaml"
DREAMBOOTH = CONFIGS / "dreambooth_tiny.yaml"
SD15_TEXT_TO_IMAGE = CONFIGS / "sd15_text_to_image.yaml"
SD15_DREAMBOOTH = CONFIGS / "sd15_dreambooth_lora.yaml"
EMOJI = REPO / "apps" / "diffusion" / "data" / "noto_emoji_64"

TINY_MODEL = ["model.unet_channels=[32,32]", "model.unet_norm_groups=8", "model.unet_attention_head_dim=8",
              "model.text_hidden_size=32", "model.text_layers=1", "model.text_heads=2", "data.resolution=64"]
TINY_RUN = ["data.max_images=8", "train.micro_batch_size=4", "train.log_every=1", "train.progress_bar=false",
            "train.plot=false", "train.save_every=0", "train.warmup_steps=0",
            "validation.num_inference_steps=2", "validation.prompts=[dog face,red apple]"]
# The real-size configs pointed at a tiny SD directory: 64 px, one CPU process, no wandb.
SD_RUN = ["data.resolution=64", "train.plugin=ddp", "train.precision=fp32", "train.wandb=false",
          "train.save_every=0", "train.warmup_steps=0", "train.micro_batch_size=4", "train.log_every=1",
          "train.progress_bar=false", "train.plot=false", "validation.num_inference_steps=2", "validation.every=0"]


def tiny_config(output_dir: Path, *overrides: str, config: Path = TINY):
    from apps.diffusion.config import load_recipe

    return load_recipe(config, [*TINY_MODEL, *TINY_RUN, f"train.output_dir={output_dir}", *overrides])


def sd_config(output_dir: Path, pretrained_dir: Path, *overrides: str, config: Path = SD15_TEXT_TO_IMAGE):
    """A shipped sd15_* config on the tiny SD directory."""
    from apps.diffusion.config import load_recipe

    return load_recipe(config, [f"model.pretrained_dir={pretrained_dir}", *SD_RUN,
                                f"train.output_dir={output_dir}", *overrides])


def build_tiny_sd_pipeline(directory: Path, seed: int = 0) -> Path:
    """A random Stable Diffusion 1.x pipeline, tiny, saved by `save_pretrained` as a user's
    directory is laid out: model_index.json, unet/ (UNet2DConditionModel), vae/ (AutoencoderKL,
    four levels: 8x downsampling, scaling_factor 0.18215), text_encoder/ (CLIPTextModel),
    tokenizer/ (a CLIP BPE with its own 400-token vocabulary, 77 tokens per prompt) and
    scheduler/ (PNDM with SD's betas)."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from apps.diffusion.build_tokenizer import captions, train_clip_bpe

    directory = Path(directory)
    vocab_dir = train_clip_bpe(captions(EMOJI) + ["a photo of sks dog", "sks cat face"], directory / "bpe", 400)
    tokenizer = CLIPTokenizer.from_pretrained(str(vocab_dir), model_max_length=77)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, projection_dim=32, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
                                cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=8, sample_size=64, scaling_factor=0.18215)
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    out = directory / "sd-tiny"
    pipe.save_pretrained(str(out))
    return out


def build_tiny_sdxl_pipeline(directory: Path, seed: int = 0) -> Path:
    """A random SDXL pipeline, tiny, saved by `save_pretrained` in the `StableDiffusionXLPipeline`
    layout: text_encoder/ (CLIPTextModel), text_encoder_2/ (CLIPTextModelWithProjection, projection
    32), tokenizer/ and tokenizer_2/ (the same 400-token CLIP BPE, 77 tokens), unet/ with SDXL's
    size / crop conditioning (addition_embed_type="text_time": 6 time ids x 8 + the 32-dim pooled
    embedding; cross-attention on both encoders' 32 + 32 features), vae/ (AutoencoderKL, SDXL's
    scaling_factor 0.13025) and scheduler/ (Euler with SD's betas, as SDXL ships)."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from apps.diffusion.build_tokenizer import captions, train_clip_bpe

    directory = Path(directory)
    vocab_dir = train_clip_bpe(captions(EMOJI) + ["a photo of sks dog", "sks cat face"], directory / "bpe", 400)
    tokenizer = CLIPTokenizer.from_pretrained(str(vocab_dir), model_max_length=77)
    torch.manual_seed(seed)

    def clip_config():
        return CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)

    text_encoder, text_encoder_2 = CLIPTextModel(clip_config()), CLIPTextModelWithProjection(clip_config())
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1,
                                cross_attention_dim=64, attention_head_dim=(2, 4), use_linear_projection=True,
                                addition_embed_type="text_time", addition_time_embed_dim=8,
                                projection_class_embeddings_input_dim=6 * 8 + 32, norm_num_groups=32)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=8, sample_size=64, scaling_factor=0.13025)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet, scheduler=scheduler,
                                     add_watermarker=False)
    out = directory / "sdxl-tiny"
    pipe.save_pretrained(str(out))
    return out
