"""LoRA through the Booster: low-rank adapters (PEFT underneath) trained by any plugin.

    model = booster.enable_lora(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)     # after enable_lora
    model, optimizer, *_ = booster.boost(model, optimizer)
    ...
    booster.save_lora_as_pretrained(model, "out/adapter")              # adapter_config.json + adapter_model.safetensors
    booster.save_lora_as_pretrained(model, "out/merged", merge=True)   # a plain Hugging Face model directory

`enable_lora` wraps the model with `peft.get_peft_model`: the base weights are frozen
(`requires_grad=False`) and only the adapters train. `Booster.boost` then keeps only the trainable
parameters in the optimizer (`keep_trainable`), so the plugins give optimizer state, fp32 masters
and gradient buckets (ZeRO's flat partitions, DDP's buckets) to the adapters alone.

Saving walks the plugin's `iter_full_model_state` (a collective, as for a full save) and writes,
on rank 0, either the adapter in PEFT's format (`peft.PeftModel.from_pretrained(base, dir)` opens
it) or, with `merge=True`, the base model with `W + scaling * B @ A` folded into each adapted
linear layer, under the base model's own names (`AutoModelForCausalLM.from_pretrained(dir)`).
peft is an optional dependency (the `llama` and `diffusion` extras): it is imported only here,
when LoRA is used.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from phalanx.booster.plugins.base import Plugin, unwrap_model
from phalanx.booster.wrappers import ModelWrapper

@dataclass
class LoRASection:
    """The `lora:` section of a recipe config (the LLaMA and RLHF recipes'): adapters instead of
    full fine-tuning, the base frozen. `with_lora(model, section)` applies it."""

    enabled: bool = False
    rank: int = 8  # r: the adapters' inner dimension
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    merge: bool = False  # also write the merged model (where: the recipe says)

    def validate(self) -> None:
        from phalanx.config import ConfigError

        if self.rank < 1:
            raise ConfigError(f"lora.rank must be a positive integer, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.enabled and not self.target_modules:
            raise ConfigError("lora.target_modules is empty: name the linear layers to adapt, e.g. [q_proj, v_proj]")


def with_lora(model: nn.Module, lora: LoRASection) -> nn.Module:
    """`model` with the section's adapters (a `peft.PeftModel` whose base is frozen: only the
    adapters train, under any plugin), or `model` itself when LoRA is off. A collective with
    several ranks (every rank starts from rank 0's initial adapters)."""
    if not lora.enabled:
        return model
    peft = import_peft()
    return enable_lora(model, peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                              target_modules=list(lora.target_modules)))


PEFT_PREFIX = "base_model.model."  # what a PeftModel's state-dict keys carry before the base model's names
BASE_LAYER, LORA_A, LORA_B = ".base_layer.", ".lora_A.", ".lora_B."


def import_peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs the peft package: pip install 'peft>=0.21' (or the extra: "
                          "pip install -e '.[llama]')") from None
    return peft


def is_lora_model(model: Any) -> bool:
    """Whether `model` (boosted or not) is a PEFT model made by `enable_lora`. peft not imported
    yet means no PEFT model exists (nothing is imported to find out)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(unwrap_model(model), peft.PeftModel)


def enable_lora(model: nn.Module, lora_config: Any, adapter_name: str = "default") -> nn.Module:
    """`model` with LoRA adapters from `lora_config` (a `peft.LoraConfig`): a `peft.PeftModel`
    whose base weights are frozen. Call it before `Booster.boost`, and build the optimizer on the
    returned model. A lazy model (meta device, `phalanx.lazy`) stays lazy: only the adapters are
    made real here (peft's own initialisation), and the plugin reads this rank's pieces of the base
    when it is boosted (FSDP2: its rows; tensor parallel: its slices), so a base larger than one
    rank's memory can take adapters. A collective when several ranks run: every rank starts from
    rank 0's adapters."""
    peft = import_peft()
    if isinstance(model, ModelWrapper):
        raise ValueError("enable_lora got a boosted model: call booster.enable_lora(model, config) on the original "
                         "model, then build the optimizer on what it returns, then booster.boost(...)")
    if not isinstance(lora_config, peft.LoraConfig):
        raise TypeError(f"enable_lora needs a peft.LoraConfig, got {type(lora_config).__name__}: "
                        "peft.LoraConfig(r=8, lora_alpha=16, target_modules=[...])")
    if is_lora_model(model):
        raise ValueError("this model already has LoRA adapters (it is a peft.PeftModel): call enable_lora once")
    lazy_base = any(p.is_meta for p in model.parameters())
    if lazy_base:
        _check_lazy_lora(lora_config)
        rng = torch.get_rng_state()  # peft draws the adapters on the host, then moves them to the meta device
    peft_model = peft.get_peft_model(model, lora_config, adapter_name=adapter_name)
    if lazy_base:
        torch.set_rng_state(rng)  # draw them again, into real storage
        _initialise_adapters(peft_model, adapter_name, lora_config)
    _same_adapters_on_every_rank(peft_model)
    return peft_model


def _check_lazy_lora(lora_config: Any) -> None:
    """What a lazy (meta-device) base cannot take: adapters whose initialisation or layout reads
    the base weights."""
    needs_base = []
    if getattr(lora_config, "use_dora", False):
        needs_base.append("use_dora=True (DoRA's magnitude is the base weight's norm)")
    if lora_config.init_lora_weights not in (True, False, "gaussian"):
        needs_base.append(f"init_lora_weights={lora_config.init_lora_weights!r} (computed from the base weights)")
    if getattr(lora_config, "modules_to_save", None):
        needs_base.append("modules_to_save (copies of base modules that train)")
    if getattr(lora_config, "target_parameters", None):
        needs_base.append("target_parameters (adapters on parameters, e.g. MoE experts)")
    if needs_base:
        raise ValueError("LoRA on a lazy (meta-device) base cannot use " + "; ".join(needs_base) + ": materialise the "
                         "base first (phalanx.lazy.materialize(model)), or use plain LoRA adapters")


def _initialise_adapters(peft_model: nn.Module, adapter_name: str, lora_config: Any) -> None:
    """On a lazy base peft creates the adapters on the meta device too: give them real storage and
    peft's own initial values (the layers' own init, then `reset_lora_parameters`, module by module
    from the global generator: the draws an eager base's adapters take, so the same seed gives the
    same adapters). The base stays on the meta device."""
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            for pieces in (module.lora_A, module.lora_B, module.lora_embedding_A, module.lora_embedding_B):
                if adapter_name in pieces:
                    piece = pieces[adapter_name]
                    if isinstance(piece, nn.Module):
                        piece.to_empty(device="cpu")
                        if hasattr(piece, "reset_parameters"):  # as built eagerly: the same draws
                            piece.reset_parameters()
                    else:  # the embedding adapters are parameters of a ParameterDict
                        pieces[adapter_name] = nn.Parameter(torch.empty_like(piece, device="cpu"),
                                                            requires_grad=piece.requires_grad)
            module.reset_lora_parameters(adapter_name, lora_config.init_lora_weights)
    left = [n for n, p in peft_model.named_parameters() if p.requires_grad and p.is_meta]
    if left:
        raise RuntimeError(f"LoRA on a lazy base: trainable parameters left on the meta device: {left[:3]}")


def _same_adapters_on_every_rank(peft_model: nn.Module) -> None:
    """Every rank takes rank 0's initial adapters (one broadcast of them all, on the run's
    device): peft draws them from each rank's own random stream, which need not agree (a rank
    seeded for its own dropout), and FSDP2 keeps each rank's shard of what it was given."""
    import torch.distributed as dist

    from phalanx.device import run_device
    from phalanx.launch import collective

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = [p for p in peft_model.parameters() if p.requires_grad]
    if not params:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float() for p in params]).to(run_device())
        with collective("lora.broadcast_adapters"):
            dist.broadcast(flat, src=0)
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(piece.view_as(p).to(p.device, p.dtype))


def keep_trainable(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Drop the frozen parameters from `optimizer`'s param groups (in place; the groups and their
    order stay, for the LR scheduler), so no plugin gives them optimizer state, masters or
    gradient buckets. Refuses an optimizer that lacks an adapter. Returns how many it dropped."""
    trainable = {id(p): n for n, p in unwrap_model(model).named_parameters() if p.requires_grad}
    dropped, present = 0, set()
    for group in optimizer.param_groups:
        keep = [p for p in group["params"] if p.requires_grad]
        dropped += len(group["params"]) - len(keep)
        group["params"] = keep
        present.update(id(p) for p in keep)
    missing = [n for i, n in trainable.items() if i not in present]
    if missing:
        raise ValueError(f"the optimizer does not hold {len(missing)} of the {len(trainable)} LoRA parameters "
                         f"(e.g. {missing[0]}): build the optimizer after enable_lora, on the model it returned "
                         "(torch.optim.AdamW(model.parameters(), ...))")
    return dropped


def adapter_state_names(peft_model: nn.Module) -> set[str]:
    """State-dict keys of what the adapter saves: the trainable parameters (LoRA matrices,
    modules_to_save, trained biases) and every `lora_` tensor."""
    names = {n for n, p in peft_model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return names | {n for n in peft_model.state_dict() if "lora_" in n}


def write_adapter(peft_model: nn.Module, state: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Write the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) from
    `state` (full tensors under the PeftModel's own keys; rank 0 only): peft's `save_pretrained`
    picks and renames the adapter's keys."""
    from safetensors.torch import load_file, save_file

    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    peft_model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    # peft names the tensors of the LoRA layers it finds in this rank's model; under pipeline
    # parallelism the other stages' layers are not here, so their matrices are added from `state`
    # under peft's file naming (the adapter name dropped from the key).
    adapter = peft_model.active_adapter
    marker = f".{adapter}."
    lora = {k.replace(marker, ".", 1): v for k, v in state.items() if "lora_" in k and marker in k}
    path = Path(directory) / ("" if adapter == "default" else adapter) / "adapter_model.safetensors"
    written = load_file(str(path))
    if set(lora) - set(written):
        save_file({**lora, **written}, str(path), metadata={"format": "pt"})


def _lora_layers(peft_model: nn.Module, adapter: str) -> dict[str, nn.Module]:
    """Base-model name -> LoRA layer, for the layers `merged_pairs` can merge; refuses the rest."""
    from peft.tuners.lora import LoraLayer

    config = peft_model.peft_config[adapter]
    if getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
        raise ValueError("merge=True merges plain LoRA on linear layers; this adapter uses DoRA or modules_to_save: "
                         "save the adapter (merge=False) and merge it with peft's merge_and_unload on one process")
    layers = {}
    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A and not _is_param_wrapper(module):
            if not _is_linear(module.get_base_layer()) or getattr(module, "lora_bias", {}).get(adapter):
                raise ValueError(f"merge=True merges LoRA on nn.Linear layers; {name} is "
                                 f"{type(module.get_base_layer()).__name__}: save the adapter (merge=False) instead")
            layers[name] = module
    return layers


def _is_param_wrapper(module: nn.Module) -> bool:
    """peft's adapter on a parameter (`target_parameters`: Mixtral's fused expert tensors)."""
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(module, ParamWrapper)


class _ExpertAdapter:
    """One `target_parameters` adapter: the stream names of its base parameter and of its A and B
    (peft nests one wrapper per adapted parameter of a module, so the parameter sits below every
    wrapper's `base_layer`), and the merged parameter's name."""

    def __init__(self, name: str, wrapper: nn.Module, adapter: str):
        from peft.tuners.lora import LoraLayer

        if wrapper.lora_bias.get(adapter):
            raise ValueError(f"merge=True: {name}'s expert adapter has a bias: save the adapter (merge=False) instead")
        module, path = wrapper, name
        while isinstance(module, LoraLayer):
            module, path = module.base_layer, path + ".base_layer"
        self.wrapper, self.adapter = wrapper, adapter
        self.names = {f"{path}.{wrapper.parameter_name}": "base", f"{name}.lora_A.{adapter}.weight": "A",
                      f"{name}.lora_B.{adapter}.weight": "B"}
        self.base_path, self.clean_path = path, path.replace(".base_layer", "")  # the wrapped module's names
        self.merged_name = f"{self.clean_path}.{wrapper.parameter_name}"

    def merge(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """W[e] + scaling * (B_e @ A_e), per expert, laid out as W: what peft's get_delta_weight computes.
        A 2-D parameter (a linear layer's `.weight` named in target_parameters: DeepSeek's shared
        experts, whose module names peft's v4 -> v5 conversion would take for the routed experts')
        is one plain linear adapter: W + scaling * B @ A."""
        weight = parts["base"]
        if weight.dim() == 2:
            from peft.utils.other import transpose

            delta = transpose(parts["B"].float() @ parts["A"].float(), getattr(self.wrapper, "fan_in_fan_out", False))
            delta = delta * self.wrapper.scaling[self.adapter]
            if delta.shape != weight.shape:
                raise ValueError(f"merge=True: the delta of {self.merged_name} has shape {tuple(delta.shape)}, the "
                                 f"weight {tuple(weight.shape)}: save the adapter (merge=False) instead")
            return (weight.float() + delta.to(weight.device)).to(weight.dtype)
        experts = weight.shape[0]  # the full weight's (under expert parallelism the wrapper holds only its rank's)
        a = parts["A"].float().reshape(experts, -1, parts["A"].shape[-1])  # experts x rank x in
        b = parts["B"].float().reshape(parts["B"].shape[0], -1, experts)  # out x rank x experts
        layout = "e o i" if self.wrapper._did_swap_in_out_features else "e i o"
        delta = torch.einsum(f"o r e, e r i -> {layout}", b, a) * self.wrapper.scaling[self.adapter]
        if delta.shape != weight.shape:
            raise ValueError(f"merge=True: the delta of {self.merged_name} has shape {tuple(delta.shape)}, the "
                             f"weight {tuple(weight.shape)}: save the adapter (merge=False) instead")
        return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def _expert_adapters(peft_model: nn.Module, adapter: str) -> dict[str, tuple[_ExpertAdapter, str]]:
    """Stream name -> (its expert adapter, base / A / B), for every `target_parameters` adapter."""
    index = {}
    for name, module in peft_model.get_base_model().named_modules():
        if _is_param_wrapper(module) and adapter in module.lora_A:
            expert = _ExpertAdapter(name, module, adapter)
            index.update({n: (expert, piece) for n, piece in expert.names.items()})
    return index


def _is_linear(layer: nn.Module) -> bool:
    """nn.Linear, or its tensor-parallel piece (the merge works on the gathered full weight)."""
    from phalanx.shard.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(layer, nn.Linear) or (isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
                                            and not layer.transposed)


def _split(name: str, layers: dict[str, nn.Module], elsewhere=None) -> tuple[str, str, str] | None:
    """(layer name, piece, rest) when `name` is part of a LoRA layer: piece is base/A/B. A layer
    that is not in `layers` (another pipeline stage's) is added as `elsewhere(layer name)`."""
    for marker, piece in ((BASE_LAYER, "base"), (LORA_A, "A"), (LORA_B, "B")):
        head, sep, rest = name.partition(marker)
        if sep and head not in layers and elsewhere is not None and (stand_in := elsewhere(head)) is not None:
            layers[head] = stand_in
        if sep and head in layers:
            return head, piece, rest
    return None


class _LayerElsewhere:
    """What merging needs of a LoRA layer this rank does not hold (under pipeline parallelism,
    another stage's): its scaling and weight layout, from the adapter's config. Refused when the
    config gives layers different ranks or alphas (only the layer itself knows its own then)."""

    def __init__(self, peft_model: nn.Module, adapter: str, name: str):
        import math

        config = peft_model.peft_config[adapter]
        if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
            raise ValueError(f"merge=True: {name} is on another pipeline stage and the adapter has per-layer "
                             "rank_pattern / alpha_pattern: save the adapter (merge=False) and merge it with peft's "
                             "merge_and_unload on one process")
        root = math.sqrt(config.r) if getattr(config, "use_rslora", False) else config.r
        self.scaling = {adapter: config.lora_alpha / root}
        self.fan_in_fan_out = bool(getattr(config, "fan_in_fan_out", False))


_EXPERT_MERGE_UNDER_PP = ("merge=True with expert adapters under pipeline parallelism: save the adapter "
                          "(merge=False) and merge it with peft's merge_and_unload on one process")


def merged_pairs(peft_model: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's (name, tensor) pairs with the active adapter merged into each adapted
    linear weight (`W + scaling * B @ A`, computed in fp32, stored in W's dtype), from the full
    PeftModel pairs a plugin streams. A weight waits only for its own layer's A and B."""
    adapter = peft_model.active_adapter
    layers = _lora_layers(peft_model, adapter)
    experts = _expert_adapters(peft_model, adapter)
    here = {n for n, _ in peft_model.get_base_model().named_modules()}

    def elsewhere(layer: str):  # a layer this rank does not hold (another pipeline stage's)
        if layer in here:
            return None
        if experts:
            raise ValueError(_EXPERT_MERGE_UNDER_PP)
        return _LayerElsewhere(peft_model, adapter, layer)

    # the other tensors of a module below target_parameters wrappers (a linear layer's bias): its own names
    wrapped = {expert.base_path: expert.clean_path for expert, _ in experts.values()}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    expert_parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in pairs:
        name = name.removeprefix(PEFT_PREFIX)
        if name in experts:  # a target_parameters adapter's base, A or B
            expert, piece = experts[name]
            parts = expert_parts.setdefault(expert.merged_name, {})
            parts[piece] = tensor
            if len(parts) == 3:
                del expert_parts[expert.merged_name]
                yield expert.merged_name, expert.merge(parts)
            continue
        module, _, leaf = name.rpartition(".")
        if module in wrapped:
            yield f"{wrapped[module]}.{leaf}", tensor
            continue
        where = _split(name, layers, elsewhere)
        if where is None:
            if "lora_" not in name:  # another adapter's tensors are not part of the merged model
                yield name, tensor
            continue
        layer, piece, rest = where
        if piece == "base":
            if rest != "weight":
                yield f"{layer}.{rest}", tensor  # the bias, unchanged
                continue
        elif not rest.startswith(f"{adapter}."):
            continue
        parts = pending.setdefault(layer, {})
        parts[piece] = tensor
        if len(parts) == 3:
            del pending[layer]
            yield f"{layer}.weight", _merge(layers[layer], adapter, parts)
    if pending or expert_parts:
        missing = sorted(pending) or sorted(expert_parts)
        raise ValueError(f"the model's state lacks the base weight or an adapter matrix of {missing[0]}")


def _merge(layer: nn.Module, adapter: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    from peft.utils.other import transpose

    weight = parts["base"]
    delta = transpose(parts["B"].float() @ parts["A"].float(), layer.fan_in_fan_out) * layer.scaling[adapter]
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def save_lora(plugin: Plugin, model: nn.Module, directory: Path, *, writer: bool, merge: bool = False,
              tokenizer=None, **kwargs) -> None:
    """Collective: every rank walks the plugin's gather of the full model; where `writer` is true
    the adapter (or, with `merge`, the merged base model in HF layout; `kwargs` go to
    `save_hf_model`) is written into `directory`."""
    peft_model = unwrap_model(model)
    if not is_lora_model(peft_model):
        raise ValueError("save_lora_as_pretrained needs a model with LoRA adapters: call booster.enable_lora(model, "
                         "config) before booster.boost; save a full model with booster.save_model")
    if merge:  # refuse before the collective walk, on every rank
        _lora_layers(peft_model, peft_model.active_adapter)
        if getattr(plugin, "pp_size", 1) > 1 and _expert_adapters(peft_model, peft_model.active_adapter):
            raise ValueError(_EXPERT_MERGE_UNDER_PP)
    write_lora_pairs(peft_model, plugin.iter_full_model_state(model), directory, writer=writer, merge=merge,
                     tokenizer=tokenizer, **kwargs)


def write_lora_pairs(peft_model: nn.Module, pairs: Iterator[tuple[str, torch.Tensor]], directory: Path, *,
                     writer: bool, merge: bool = False, tokenizer=None, **kwargs) -> None:
    """Walks `pairs` (the full tensors of `peft_model` under its peft names, from a plugin's collective
    gather) to its end on every rank; where `writer` is true writes the adapter in PEFT's format (or,
    with `merge`, the merged base model in HF layout; `kwargs` go to `save_hf_model`) into `directory`."""
    from phalanx.checkpoint.hf import save_hf_model

    try:
        if merge:
            if writer:
                save_hf_model(peft_model.get_base_model(), merged_pairs(peft_model, pairs), directory,
                              tokenizer=tokenizer, **kwargs)
        else:
            keep = adapter_state_names(peft_model)  # this rank's; with pipeline stages other layers' adapters
            state = {name: tensor for name, tensor in pairs if name in keep or "lora_" in name}  # come by name
            if writer:
                write_adapter(peft_model, state, directory)
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(directory))
    finally:
        for pair in pairs:
            del pair  # the other ranks are inside the gather until every tensor is walked


def checkpoint_pairs(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a HF-layout directory, one tensor at a time (a file's tensors are read
    as they are handed out, not the whole model at once)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {str(model_dir)!r}: not a model directory a checkpoint wrote")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def export_from_checkpoint(peft_model: nn.Module, model_dir: str | Path, directory: str | Path, *,
                           merge: bool = False, tokenizer=None) -> Path:
    """One process (rank 0): the adapter in PEFT's format (or, with `merge`, the merged base
    model in HF layout) from the model/ directory of a training checkpoint of the LoRA model
    `peft_model` (what `phalanx.train.fit` saved), into `directory`. For recipes that train with
    `fit`, which owns the Booster."""
    from phalanx.checkpoint.hf import save_hf_model

    directory = Path(directory)
    pairs = checkpoint_pairs(model_dir)
    if merge:
        save_hf_model(peft_model.get_base_model(), merged_pairs(peft_model, pairs), directory, tokenizer=tokenizer)
        return directory
    keep = adapter_state_names(peft_model)
    state = {name: tensor for name, tensor in pairs if name in keep}
    if not state:
        raise ValueError(f"the checkpoint in {str(model_dir)!r} holds no adapter tensors: was it saved from this "
                         "LoRA model?")
    write_adapter(peft_model, state, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
