"""OpenFold's parameter naming (its `.pt` state dicts, e.g. openfold_params/finetuning_*.pt).

OpenFold stores torch layouts ([out, in] weights, attention heads flattened as h * c_hidden + k),
which are this model's, under its own module names (`evoformer.blocks.3.msa_att_row.mha.linear_q
.weight`, `structure_module.ipa.linear_q_points.linear.weight`). Only the invariant point
attention differs: OpenFold keeps AlphaFold's coordinate-major points (x of every point, then y,
then z), so those rows and the output projection's columns are permuted as for the .npz files.

`openfold_mapping(model)` pairs every parameter with its OpenFold name; `load_openfold_params`
reads a plain state dict, a Lightning checkpoint ({"state_dict": {"model.…"}}, EMA weights
preferred when present), and the names of OpenFold releases before its multimer refactor.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from apps.protein.model import AlphaFold
from apps.protein.weights import existing_file, load_mapped_state, point_rows, refuse_unknown

_ATTN = {"q": "linear_q", "k": "linear_k", "v": "linear_v", "g": "linear_g", "o": "linear_o"}
_TRANSITION = {"norm": "layer_norm", "fc1": "linear_1", "fc2": "linear_2"}
_TRI_MUL = {"norm_in": "layer_norm_in", "norm_out": "layer_norm_out", "a_p": "linear_a_p", "a_g": "linear_a_g",
            "b_p": "linear_b_p", "b_g": "linear_b_g", "g": "linear_g", "o": "linear_z"}
_TOP = {"input_embedder.m_target": "input_embedder.linear_tf_m", "input_embedder.m_msa": "input_embedder.linear_msa_m",
        "input_embedder.z_i": "input_embedder.linear_tf_z_i", "input_embedder.z_j": "input_embedder.linear_tf_z_j",
        "input_embedder.relpos": "input_embedder.linear_relpos",
        "recycling_embedder.norm_m": "recycling_embedder.layer_norm_m",
        "recycling_embedder.norm_z": "recycling_embedder.layer_norm_z",
        "recycling_embedder.dist": "recycling_embedder.linear", "extra_msa_embedder": "extra_msa_embedder.linear",
        "single": "evoformer.linear", "heads.plddt.0": "aux_heads.plddt.layer_norm",
        "heads.plddt.1": "aux_heads.plddt.linear_1", "heads.plddt.3": "aux_heads.plddt.linear_2",
        "heads.plddt.5": "aux_heads.plddt.linear_3", "heads.distogram": "aux_heads.distogram.linear",
        "heads.masked_msa": "aux_heads.masked_msa.linear",
        "heads.experimentally_resolved": "aux_heads.experimentally_resolved.linear", "heads.pae": "aux_heads.tm.linear",
        "structure_module.norm_s": "structure_module.layer_norm_s",
        "structure_module.norm_z": "structure_module.layer_norm_z", "structure_module.inp": "structure_module.linear_in",
        "structure_module.ipa": "structure_module.ipa", "structure_module.ipa.q": "structure_module.ipa.linear_q", "structure_module.ipa.kv": "structure_module.ipa.linear_kv",
        "structure_module.ipa.q_pts": "structure_module.ipa.linear_q_points.linear",
        "structure_module.ipa.kv_pts": "structure_module.ipa.linear_kv_points.linear",
        "structure_module.ipa.bias": "structure_module.ipa.linear_b",
        "structure_module.ipa.o": "structure_module.ipa.linear_out",
        "structure_module.norm_ipa": "structure_module.layer_norm_ipa",
        "structure_module.norm_transition": "structure_module.transition.layer_norm",
        "structure_module.backbone_update": "structure_module.bb_update.linear",
        "structure_module.angles.inp": "structure_module.angle_resnet.linear_in",
        "structure_module.angles.inp_initial": "structure_module.angle_resnet.linear_initial",
        "structure_module.angles.out": "structure_module.angle_resnet.linear_out"}
# Names of OpenFold releases before the multimer refactor -> today's (the facts its own converter applies).
_V1_NAMES = (("core.msa_transition", "msa_transition"),
             ("core.outer_product_mean", "outer_product_mean"), ("core.tri_", "pair_stack.tri_"),
             ("core.pair_transition", "pair_stack.pair_transition"))
TEMPLATE_PREFIXES = ("template_embedder.", "template_angle_embedder.", "template_pair_embedder.",
                     "template_pair_stack.", "template_pointwise_att.", "template_single_embedder.")
# Releases before the refactor kept the template modules at the top level (and called the angle
# embedder template_angle_embedder); today they live under template_embedder.
_V1_TEMPLATE_PREFIXES = (("template_angle_embedder.", "template_embedder.template_single_embedder."),
                         ("template_pair_embedder.", "template_embedder.template_pair_embedder."),
                         ("template_pair_stack.", "template_embedder.template_pair_stack."),
                         ("template_pointwise_att.", "template_embedder.template_pointwise_att."))
_TEMPLATE_TOP = {"template_embedder.pair_embedding": "template_embedder.template_pair_embedder.linear",
                 "template_embedder.pair_stack.norm": "template_embedder.template_pair_stack.layer_norm",
                 "template_angle_embedder.fc1": "template_embedder.template_single_embedder.linear_1",
                 "template_angle_embedder.fc2": "template_embedder.template_single_embedder.linear_2"}


def _block_modules(extra: bool) -> dict[str, str]:
    """This model's module path inside an Evoformer / extra-MSA block -> OpenFold's."""
    m = {"row_attn.norm_m": "msa_att_row.layer_norm_m", "row_attn.norm_z": "msa_att_row.layer_norm_z",
         "row_attn.bias": "msa_att_row.linear_z"}
    m |= {f"row_attn.attn.{a}": f"msa_att_row.mha.{b}" for a, b in _ATTN.items()}
    if extra:
        m["col_attn.norm"] = "msa_att_col.layer_norm_m"
        m |= {f"col_attn.{a}": f"msa_att_col.global_attention.{b}" for a, b in _ATTN.items()}
    else:
        m["col_attn.norm"] = "msa_att_col._msa_att.layer_norm_m"
        m |= {f"col_attn.attn.{a}": f"msa_att_col._msa_att.mha.{b}" for a, b in _ATTN.items()}
    m |= {f"msa_transition.{a}": f"msa_transition.{b}" for a, b in _TRANSITION.items()}
    m |= {"opm.norm": "outer_product_mean.layer_norm", "opm.a": "outer_product_mean.linear_1",
          "opm.b": "outer_product_mean.linear_2", "opm.o": "outer_product_mean.linear_out"}
    for name in ("tri_mul_out", "tri_mul_in"):
        m |= {f"{name}.{a}": f"pair_stack.{name}.{b}" for a, b in _TRI_MUL.items()}
    for name in ("tri_att_start", "tri_att_end"):
        m |= {f"{name}.norm": f"pair_stack.{name}.layer_norm", f"{name}.bias": f"pair_stack.{name}.linear"}
        m |= {f"{name}.attn.{a}": f"pair_stack.{name}.mha.{b}" for a, b in _ATTN.items()}
    m |= {f"pair_transition.{a}": f"pair_stack.pair_transition.{b}" for a, b in _TRANSITION.items()}
    return m


def _module_name(module: str) -> str:
    """OpenFold's name of one of this model's modules (raises for a module OpenFold lacks)."""
    if module in _TOP:
        return _TOP[module]
    if module in _TEMPLATE_TOP:
        return _TEMPLATE_TOP[module]
    parts = module.split(".")
    if module.startswith("template_embedder.pointwise."):
        return f"template_embedder.template_pointwise_att.mha.{_ATTN[parts[-1]]}"
    if module.startswith("template_embedder.pair_stack.blocks."):
        # OpenFold's template pair block holds the pair operations directly (no pair_stack.)
        inner = _block_modules(False)[".".join(parts[4:])].removeprefix("pair_stack.")
        return f"template_embedder.template_pair_stack.blocks.{parts[3]}.{inner}"
    if parts[0] in ("evoformer", "extra_msa_stack") and parts[1] == "blocks":
        inner = _block_modules(parts[0] == "extra_msa_stack")[".".join(parts[3:])]
        return f"{parts[0]}.blocks.{parts[2]}.{inner}"
    if module.startswith("structure_module.transition."):
        return f"structure_module.transition.layers.0.linear_{int(parts[-1]) + 1}"
    if module.startswith("structure_module.angles.blocks."):
        return f"structure_module.angle_resnet.layers.{parts[3]}.linear_{int(parts[4]) + 1}"
    raise KeyError(f"{module}: OpenFold has no such module (model.crop_position_bins must be 0)")


def _ipa_converts(model: AlphaFold) -> dict:
    """This model's [head, point, xyz] order from OpenFold's coordinate-major points."""
    sm = model.structure_module
    cfg = sm.cfg
    h, pq, pv, c = cfg.heads, cfg.query_points, cfg.value_points, cfg.c_ipa
    q_rows, kv_rows = point_rows(h, pq), point_rows(h, pq + pv)
    n_scalar, n_pts = h * c, h * pv
    cols = np.concatenate([np.arange(n_scalar), n_scalar + point_rows(h, pv),
                           np.arange(n_scalar + 3 * n_pts, sm.ipa.o.in_features)])
    return {"structure_module.ipa.q_pts.weight": lambda w: w[q_rows], "structure_module.ipa.q_pts.bias": lambda b: b[q_rows],
            "structure_module.ipa.kv_pts.weight": lambda w: w[kv_rows],
            "structure_module.ipa.kv_pts.bias": lambda b: b[kv_rows],
            "structure_module.ipa.o.weight": lambda w: w[:, cols]}


def openfold_mapping(model: AlphaFold) -> dict[str, tuple]:
    """{parameter name: (OpenFold state-dict name, conversion or None, None)}."""
    converts = _ipa_converts(model)
    out = {}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        target = _module_name(module) + "." + leaf if module else name
        out[name] = (target, converts.get(name), None)
    return out


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors from a state dict or a training checkpoint, names normalised."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a state dict (a {type(obj).__name__})")
    if isinstance(obj.get("ema"), dict) and isinstance(obj["ema"].get("params"), dict):
        obj = obj["ema"]["params"]
    elif isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    out = {}
    for key, value in obj.items():
        for prefix in ("module.", "model."):
            key = key[len(prefix):] if key.startswith(prefix) else key
        for old, new in _V1_NAMES:
            key = key.replace(old, new)
        for old, new in _V1_TEMPLATE_PREFIXES:
            if key.startswith(old):
                key = new + key[len(old):]
        if key.endswith(("ipa.linear_q_points.weight", "ipa.linear_q_points.bias", "ipa.linear_kv_points.weight",
                         "ipa.linear_kv_points.bias")):
            stem, _, leaf = key.rpartition(".")
            key = f"{stem}.linear.{leaf}"
        out[key] = value
    return out


def load_openfold_params(model: AlphaFold, path: str | Path) -> list[str]:
    """Fill `model` from an OpenFold .pt; returns the file's keys this model has no use for (the
    template stack when `model.templates` is off: the model then predicts as without template hits)."""
    path = existing_file(path)
    params = {k: v.detach().float().numpy() for k, v in _state_dict(path).items() if isinstance(v, torch.Tensor)}
    mapping = openfold_mapping(model)
    load_mapped_state(model, params, mapping, path, "an OpenFold state dict", "model.evoformer_blocks / model.extra_msa_blocks")
    unused = sorted(set(params) - {key for key, _, _ in mapping.values()})
    refuse_unknown(unused, path, TEMPLATE_PREFIXES, "aux_heads.tm.")
    return unused
