"""The tiny video recipe the tests use (importable by spawned ranks too)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "apps" / "video_gen" / "configs" / "tiny.yaml"
TINY_DATA = ["data.shapes_videos=24", "data.shapes_images=16", "data.clips_per_video=2",
             "data.buckets=[[1,16,16,8],[8,16,16,4],[8,16,28,2]]"]
TINY_MODEL = ["model.num_layers=2", "model.num_heads=2", "model.head_dim=8", "model.ffn_dim=32",
              "model.freq_dim=16", "model.text_hidden_size=32", "model.text_layers=1", "model.text_heads=2"]
TINY_RUN = ["train.max_steps=3", "train.save_every=0", "train.log_every=1", "train.warmup_steps=0",
            "train.progress_bar=false", "train.plot=false", "eval.motion_samples=0", "eval.max_clips=8",
            "eval.ema_decay=0.0"]   # the trained weights, not tiny.yaml's EMA (which lags in a few steps)


def tiny_config(output_dir, *overrides: str):
    from apps.video_gen.config import load_recipe

    return load_recipe(TINY, [*TINY_DATA, *TINY_MODEL, *TINY_RUN, f"train.output_dir={output_dir}", *overrides])


def captions() -> list[str]:
    from apps.video_gen.shapes import COLOURS, DIRECTIONS, SHAPES, caption_for

    return [caption_for(c, s, d) for c in COLOURS for s in SHAPES for d in [None, *DIRECTIONS]]


def save_wan_parts(directory):
    """A Wan pipeline layout (transformer/, vae/, text_encoder/, tokenizer/) of tiny random parts."""
    import torch
    from diffusers import WanTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from apps.video_gen.config import VAEConfig
    from apps.video_gen.text import build_tokenizer
    from apps.video_gen.vae import build_vae

    torch.manual_seed(0)
    tokenizer = build_tokenizer(captions(), 12)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=24, d_kv=8, d_ff=48, num_layers=1, num_heads=3,
                                 dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))
    vae = build_vae(VAEConfig(base_dim=8, z_dim=4))
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=4, out_channels=4, text_dim=24, freq_dim=16, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=256)
    for name, part in [("transformer", transformer), ("vae", vae), ("text_encoder", t5), ("tokenizer", tokenizer)]:
        part.save_pretrained(str(directory / name))
    return transformer, vae, t5, tokenizer
