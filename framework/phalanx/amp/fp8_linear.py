"""precision=fp8: the linear layers' matmuls in fp8, through torchao's float8 training.

Why torchao and not our own `torch._scaled_mm` wrapper: torchao's `Float8Linear` is PyTorch's
maintained fp8 training path (the one torchtitan uses): dynamic per-tensor scaling of inputs and
weights in e4m3 and of output gradients in e5m2, the three matmuls of forward and backward in
`torch._scaled_mm`, and FSDP2 composition. We choose which layers convert and when.

What converts: every `nn.Linear` whose input and output widths are multiples of 16 (what
`torch._scaled_mm` requires), except the output head (`lm_head` and friends: the logits' range
is where fp8 hurts most, and torchtitan keeps it in bf16 too). Everything else (embeddings,
norms, attention's softmax, the head) computes in bf16, with fp32 master weights in the
optimizer as for precision=bf16. The conversion happens before the plugin wraps the model
(`Booster.boost`), so DDP / ZeRO / FSDP2 see the converted modules; the weights' names and
shapes are unchanged, so checkpoints and Hugging Face exports are the same as bf16's.

Refused where the device has no fp8 matmul (`phalanx.amp.precision.check_fp8_device`); the
emulated GPU (compute capability 9.0) runs it through torch's CPU `_scaled_mm`, which is how the
suite tests it.
"""
from __future__ import annotations

import logging
import warnings

from torch import nn

# The plugins fp8 composes with (tested under the emulated GPU); Gemini and the hybrid plugin's tensor
# parallelism place or split the linear layers themselves.
FP8_PLUGINS = ("ddp", "zero1", "zero2", "fsdp")
# Output heads stay in the compute dtype (module names, matched as the last part of the path).
HEAD_NAMES = ("lm_head", "output", "score", "classifier")


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """Whether the linear layer `name` converts: widths that `_scaled_mm` takes, and not a head."""
    if not isinstance(module, nn.Linear):
        return False
    if name.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _torchao_float8():
    """torchao.float8, imported quietly: on import torchao tries its prebuilt CUDA extensions and
    logs one warning per library it cannot load (all of them on a CPU machine; the float8
    training path does not use them)."""
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8
            import torchao.float8.float8_linear
    finally:
        log.setLevel(level)
    return torchao.float8


def convert_linears_to_fp8(model: nn.Module) -> list[str]:
    """Swap the eligible `nn.Linear` modules of `model` for torchao `Float8Linear` (dynamic
    scaling), in place. Returns the names of the converted layers."""
    convert_to_float8_training = _torchao_float8().convert_to_float8_training

    converted = [name for name, module in model.named_modules() if fp8_eligible(module, name)]
    if not converted:
        raise ValueError("precision=fp8 found no linear layer to run in fp8 (they need input and output widths that "
                         "are multiples of 16); use precision=bf16 for this model")
    convert_to_float8_training(model, module_filter_fn=lambda module, name: fp8_eligible(module, name))
    return converted


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of `model`'s layers that run in fp8 (for logs and tests)."""
    Float8Linear = _torchao_float8().float8_linear.Float8Linear
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
