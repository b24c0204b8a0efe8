"""LoRA adapters (peft) on the attention projections, saved in the diffusers format.

    add_lora(unet, rank=4)                                 # to_q / to_k / to_v / to_out.0 of every attention
    save_lora(out_dir, unet, text_encoder_or_None)         # out_dir/pytorch_lora_weights.safetensors
    pipe.load_lora_weights(out_dir)                        # plain diffusers reads it back
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def _config(rank: int, alpha: int | None, targets: list[str]):
    from peft import LoraConfig

    # gaussian init of A, zero B: the adapted model starts exactly at the base model.
    return LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian", target_modules=targets)


def add_lora(model: nn.Module, rank: int, alpha: int | None = None, text_encoder: bool = False) -> nn.Module:
    """Freeze `model` and add trainable LoRA adapters (the UNet's attention, or a CLIP text encoder's).

    The text encoder's go in through peft's own `inject_adapter_in_model`: transformers 5's
    `add_adapter` asks for peft >= 0.22, a release that does not exist yet (0.21.2 is the latest);
    the adapters, their state dict and diffusers' `load_lora_weights` are the same either way."""
    if rank < 1:
        raise ValueError(f"LoRA rank={rank}: must be at least 1")
    model.requires_grad_(False)
    if text_encoder:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(_config(rank, alpha, TEXT_TARGETS), model)
    else:
        model.add_adapter(_config(rank, alpha, UNET_TARGETS))
    return model


def save_lora(directory: str | Path, unet: nn.Module, text_encoder: nn.Module | None = None,
              text_encoder_2: nn.Module | None = None, xl: bool = False) -> Path:
    """The adapters only, as diffusers' `StableDiffusionPipeline.save_lora_weights` writes them (with
    `xl`: `StableDiffusionXLPipeline.save_lora_weights`, whose file also holds text_encoder_2's)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    def layers(module):
        return convert_state_dict_to_diffusers(get_peft_model_state_dict(module)) if module is not None else None

    directory = Path(directory)
    if xl:
        StableDiffusionXLPipeline.save_lora_weights(str(directory), unet_lora_layers=layers(unet),
                                                    text_encoder_lora_layers=layers(text_encoder),
                                                    text_encoder_2_lora_layers=layers(text_encoder_2),
                                                    safe_serialization=True)
        return directory
    if text_encoder_2 is not None:
        raise ValueError("save_lora: text_encoder_2 adapters belong to an SDXL pipeline: pass xl=True")
    StableDiffusionPipeline.save_lora_weights(str(directory), unet_lora_layers=layers(unet),
                                              text_encoder_lora_layers=layers(text_encoder), safe_serialization=True)
    return directory
