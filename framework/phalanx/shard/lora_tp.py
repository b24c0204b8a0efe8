"""LoRA adapters (PEFT's `lora.Linear` layers) split over the tensor-parallel group with their base.

An adapted layer computes `base(x) + s · B(A(x))`. Tensor parallelism splits `base` as the policy
says (`phalanx.shard.tensor_parallel`); the adapter is split so that each rank computes exactly its
part of the same sum, with no extra communication on the column side and one small one (of r
features) on the row side:

- column-parallel base (output features split; q/k/v, gate/up): `A` [r, in] stays whole on every
  rank and `B` [out, r] is split by output features like the base weight. `A`'s gradient on a
  rank covers only that rank's output features (B_rᵀ·dy_r), so it is a partial gradient, summed
  over the group like a replicated key/value head's. The layer's input is communicated once for
  both paths (the copy-to-group or sequence all-gather moves from the base layer to the adapted
  layer's input).
- key/value heads replicated over the group (fewer heads than ranks): `B` stays whole and its
  output is cut to the head this rank uses, as the base's; both `A` and `B` have partial gradients.
- row-parallel base (input features split; o_proj, down_proj): `A` is split by input features
  like the base weight, so A_r·x_r is a partial sum, all-reduced (or reduce-scattered along the
  sequence under split-gather sequence parallelism) over the group as r features; `B` stays whole
  (its gradient partial only under sequence parallelism, where each rank holds a share of the
  tokens).

The parameters keep PEFT's names (`…q_proj.base_layer.weight`, `…q_proj.lora_A.default.weight`), so
checkpoints, optimizer re-binding and `save_lora_as_pretrained` work on the full (gathered)
tensors as without tensor parallelism. Only plain LoRA on linear layers splits: DoRA, LoRA bias
and adapters on the embedding or LM head stop with the fix in the message.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from phalanx.mesh import LayoutError
from phalanx.shard.layers import ColumnParallelLinear, InputComm, ReplicatedHeadsLinear, RowParallelLinear
from phalanx.shard.spec import ShardSpec

PARTIAL = ShardSpec(partial_grad=True)


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (`peft.tuners.lora.LoraLayer`): it wraps `base_layer` and holds `lora_A`/`lora_B`."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def check_adapters(module: nn.Module, path: str, kind: str) -> None:
    """Stop before any module is touched when this adapted layer cannot be split."""
    if kind in ("embedding", "lm_head"):
        raise LayoutError(f"LoRA on {path} (the token embedding / LM head) does not split over tensor-parallel "
                          "ranks: leave it out of LoraConfig.target_modules (or use tp_size=1)")
    if any(getattr(module, "use_dora", {}).values()):
        raise LayoutError(f"{path} uses DoRA, which does not split over tensor-parallel ranks: set "
                          "LoraConfig(use_dora=False) or tp_size=1")
    for adapter, b in module.lora_B.items():
        if getattr(b, "bias", None) is not None:
            raise LayoutError(f"{path}: the LoRA adapter {adapter!r} has a bias (lora_bias=True), which does not "
                              "split over tensor-parallel ranks: set LoraConfig(lora_bias=False) or tp_size=1")
    if getattr(module, "lora_embedding_A", None):
        raise LayoutError(f"{path}: embedding adapters do not split over tensor-parallel ranks")


def split_adapters(module: nn.Module, kind: str, extra: dict, bias_spec: ShardSpec,
                   take: Callable[[nn.Parameter, ShardSpec], nn.Parameter], specs: dict[int, ShardSpec],
                   *, group, sequence_parallel: bool) -> str:
    """Replace the adapters of the PEFT layer `module` (whose base the caller splits as `kind`) by
    their tensor-parallel pieces. `take(param, spec)` returns this rank's piece as a new parameter
    (recording its spec); `specs` receives the specs of whole parameters with partial gradients.
    Returns the input communication the base layer must now use ("none": done here, once for both)."""
    comm = extra.get("input_comm", "none")
    for adapter in list(module.lora_A):
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        if kind == "column":
            specs[id(a.weight)] = PARTIAL
            module.lora_B[adapter] = ColumnParallelLinear(take(b.weight, ShardSpec(0, bias_spec.sections)), None,
                                                          group=group, input_comm="none")
        elif kind == "replicated_heads":
            specs[id(a.weight)] = PARTIAL
            module.lora_B[adapter] = ReplicatedHeadsLinear(take(b.weight, PARTIAL), None, keep=extra["keep"],
                                                           group=group, input_comm="none")
        elif kind == "row":
            module.lora_A[adapter] = RowParallelLinear(take(a.weight, ShardSpec(1)), None, group=group,
                                                       sequence_parallel=sequence_parallel)
            if getattr(module, "parameter_name", None):  # a weight adapter (peft target_parameters): peft
                specs[id(b.weight)] = PARTIAL  # adds B·A_r to this rank's weight columns, so B's gradient is partial
        else:  # pragma: no cover - check_adapters refused the rest
            raise AssertionError(kind)
    if kind in ("column", "replicated_heads") and comm != "none":
        module.register_forward_pre_hook(InputComm(group, gather=comm == "gather"), with_kwargs=True)
    return "none"


def peft_root_prefix(model: nn.Module) -> str:
    """Where a PEFT model keeps the Hugging Face model it adapts ("base_model.model."), or "" for a
    plain model: shard policies name paths inside the Hugging Face model."""
    get_base = getattr(model, "get_base_model", None)
    if get_base is None or not hasattr(model, "peft_config"):
        return ""
    inner = get_base()
    for name, module in model.named_modules():
        if module is inner:
            return name + "." if name else ""
    raise LayoutError(f"{type(model).__name__}: cannot find the adapted model inside the PEFT wrapper")
