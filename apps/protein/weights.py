"""AlphaFold 2 parameters in the official naming (params_model_*.npz, as OpenFold also reads them).

Keys look like `alphafold/alphafold_iteration/evoformer/evoformer_iteration/outer_product_mean/
left_projection//weights`: a Haiku module path, `//`, the parameter. Linear layers store
`weights` [in, out] and `bias`; layer norms `scale` and `offset`; attention stores per-head
tensors under the attention module (`.../attention//query_w` [c, heads, ch], `output_w` [heads, ch,
c]); repeated blocks are stacked along a first axis. `af2_mapping(model)` pairs every parameter of
`AlphaFold` with its key and a conversion; `load_af2_params` applies it and refuses a file that does
not fit, naming the key; `save_af2_params` writes the inverse. OpenFold's `.pt` state dicts:
`apps.protein.weights_openfold`; `load_params` takes either by the file's suffix.

Layout differences handled here: the invariant point attention stores point coordinates
coordinate-major (x of every point, then y, then z) and concatenates its outputs as [scalar,
x, y, z, norms, pair]; and AlphaFold's code computes the incoming triangle update as
sum_k left_kj * right_ki, so its left/right projections are this model's b/a. The template stack
of params_model_1/2 maps with `model.templates: true` (model/template.py); without it its keys are
returned as unused, and the model predicts as AlphaFold does for a query without template hits.
The `_ptm` files' PAE head needs `model.pae_head: true`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from apps.protein.model import AlphaFold

ROOT = "alphafold/alphafold_iteration/"
Convert = Callable[[np.ndarray], np.ndarray]


def _t(x):  # Linear weights [in, out] -> torch [out, in]
    return x.T


def _linear(prefix: str, key: str, lin) -> dict:
    out = {f"{prefix}.weight": (key + "//weights", _t)}
    if lin.bias is not None:
        out[f"{prefix}.bias"] = (key + "//bias", None)
    return out


def _norm(prefix: str, key: str) -> dict:
    return {f"{prefix}.weight": (key + "//scale", None), f"{prefix}.bias": (key + "//offset", None)}


def _attention(prefix: str, key: str, attn) -> dict:
    """Haiku's Attention module: `key` is the module path (ending `/attention`), its parameters
    hang off it after `//` like every other leaf (`.../attention//query_w`)."""
    flat_in = lambda w: w.reshape(w.shape[0], -1).T  # noqa: E731  [c, H, ch] -> [H*ch, c]
    out = {f"{prefix}.q.weight": (key + "//query_w", flat_in), f"{prefix}.k.weight": (key + "//key_w", flat_in),
           f"{prefix}.v.weight": (key + "//value_w", flat_in),
           f"{prefix}.o.weight": (key + "//output_w", lambda w: w.reshape(-1, w.shape[-1]).T),
           f"{prefix}.o.bias": (key + "//output_b", None)}
    if attn.g is not None:
        out[f"{prefix}.g.weight"] = (key + "//gating_w", flat_in)
        out[f"{prefix}.g.bias"] = (key + "//gating_b", lambda b: b.reshape(-1))
    return out


def _global_attention(prefix: str, key: str) -> dict:
    flat_in = lambda w: w.reshape(w.shape[0], -1).T  # noqa: E731
    return {f"{prefix}.q.weight": (key + "//query_w", flat_in), f"{prefix}.k.weight": (key + "//key_w", _t),
            f"{prefix}.v.weight": (key + "//value_w", _t), f"{prefix}.g.weight": (key + "//gating_w", flat_in),
            f"{prefix}.g.bias": (key + "//gating_b", lambda b: b.reshape(-1)),
            f"{prefix}.o.weight": (key + "//output_w", lambda w: w.reshape(-1, w.shape[-1]).T),
            f"{prefix}.o.bias": (key + "//output_b", None)}


def _transition(prefix: str, key: str, t) -> dict:
    return (_norm(f"{prefix}.norm", key + "/input_layer_norm") | _linear(f"{prefix}.fc1", key + "/transition1", t.fc1)
            | _linear(f"{prefix}.fc2", key + "/transition2", t.fc2))


def _block(prefix: str, key: str, block, extra: bool) -> dict:
    m = {}
    ra = key + "/msa_row_attention_with_pair_bias"
    m |= _norm(f"{prefix}.row_attn.norm_m", ra + "/query_norm") | _norm(f"{prefix}.row_attn.norm_z", ra + "/feat_2d_norm")
    m[f"{prefix}.row_attn.bias.weight"] = (ra + "//feat_2d_weights", _t)
    m |= _attention(f"{prefix}.row_attn.attn", ra + "/attention", block.row_attn.attn)
    if extra:
        ca = key + "/msa_column_global_attention"
        m |= _norm(f"{prefix}.col_attn.norm", ca + "/query_norm") | _global_attention(f"{prefix}.col_attn", ca + "/attention")
    else:
        ca = key + "/msa_column_attention"
        m |= _norm(f"{prefix}.col_attn.norm", ca + "/query_norm")
        m |= _attention(f"{prefix}.col_attn.attn", ca + "/attention", block.col_attn.attn)
    m |= _transition(f"{prefix}.msa_transition", key + "/msa_transition", block.msa_transition)
    op = key + "/outer_product_mean"
    m |= _norm(f"{prefix}.opm.norm", op + "/layer_norm_input") | _linear(f"{prefix}.opm.a", op + "/left_projection", block.opm.a)
    m |= _linear(f"{prefix}.opm.b", op + "/right_projection", block.opm.b)
    m[f"{prefix}.opm.o.weight"] = (op + "//output_w", lambda w: w.reshape(-1, w.shape[-1]).T)
    m[f"{prefix}.opm.o.bias"] = (op + "//output_b", None)
    return m | _pair_ops(prefix, key, block)


def _pair_ops(prefix: str, key: str, block) -> dict:
    """Triangle multiplications, triangle attentions and the pair transition of an Evoformer or
    template pair block (the same Haiku names in both stacks)."""
    m = {}
    for name, direction in (("tri_mul_out", "outgoing"), ("tri_mul_in", "incoming")):
        tk, mod = f"{key}/triangle_multiplication_{direction}", getattr(block, name)
        a, b = ("left", "right") if direction == "outgoing" else ("right", "left")
        m |= _norm(f"{prefix}.{name}.norm_in", tk + "/layer_norm_input") | _norm(f"{prefix}.{name}.norm_out", tk + "/center_layer_norm")
        m |= _linear(f"{prefix}.{name}.a_p", f"{tk}/{a}_projection", mod.a_p) | _linear(f"{prefix}.{name}.a_g", f"{tk}/{a}_gate", mod.a_g)
        m |= _linear(f"{prefix}.{name}.b_p", f"{tk}/{b}_projection", mod.b_p) | _linear(f"{prefix}.{name}.b_g", f"{tk}/{b}_gate", mod.b_g)
        m |= _linear(f"{prefix}.{name}.o", tk + "/output_projection", mod.o) | _linear(f"{prefix}.{name}.g", tk + "/gating_linear", mod.g)
    for name, node in (("tri_att_start", "starting"), ("tri_att_end", "ending")):
        tk = f"{key}/triangle_attention_{node}_node"
        m |= _norm(f"{prefix}.{name}.norm", tk + "/query_norm")
        m[f"{prefix}.{name}.bias.weight"] = (tk + "//feat_2d_weights", _t)
        m |= _attention(f"{prefix}.{name}.attn", tk + "/attention", getattr(block, name).attn)
    m |= _transition(f"{prefix}.pair_transition", key + "/pair_transition", block.pair_transition)
    return m


def point_rows(h: int, p: int) -> np.ndarray:
    """Output index permutation: this model's [h, p, xyz] from AlphaFold's [xyz, h, p]."""
    return np.arange(3 * h * p).reshape(3, h * p).T.reshape(-1)


def _structure(model: AlphaFold) -> dict:
    sm, key = model.structure_module, ROOT + "structure_module"
    cfg = sm.cfg
    h, pq, pv, c = cfg.heads, cfg.query_points, cfg.value_points, cfg.c_ipa
    ipa = key + "/fold_iteration/invariant_point_attention"
    q_rows, kv_rows = point_rows(h, pq), point_rows(h, pq + pv)
    # kv points: AlphaFold splits [xyz, h, (pq + pv)] into key and value points per head.
    m = _norm("structure_module.norm_s", key + "/single_layer_norm") | _norm("structure_module.norm_z", key + "/pair_layer_norm")
    m |= _linear("structure_module.inp", key + "/initial_projection", sm.inp)
    m |= _linear("structure_module.ipa.q", ipa + "/q_scalar", sm.ipa.q) | _linear("structure_module.ipa.kv", ipa + "/kv_scalar", sm.ipa.kv)
    m["structure_module.ipa.q_pts.weight"] = (ipa + "/q_point_local//weights", lambda w: w.T[q_rows])
    m["structure_module.ipa.q_pts.bias"] = (ipa + "/q_point_local//bias", lambda b: b[q_rows])
    m["structure_module.ipa.kv_pts.weight"] = (ipa + "/kv_point_local//weights", lambda w: w.T[kv_rows])
    m["structure_module.ipa.kv_pts.bias"] = (ipa + "/kv_point_local//bias", lambda b: b[kv_rows])
    m |= _linear("structure_module.ipa.bias", ipa + "/attention_2d", sm.ipa.bias)
    m["structure_module.ipa.head_weights"] = (ipa + "//trainable_point_weights", None)
    # Output features: AlphaFold [scalar, x(h,pv), y, z, norms, pair] -> ours [scalar, (h,pv,xyz), norms, pair].
    n_scalar, n_pts = h * c, h * pv
    cols = np.concatenate([np.arange(n_scalar), n_scalar + point_rows(h, pv),
                           np.arange(n_scalar + 3 * n_pts, sm.ipa.o.in_features)])
    m["structure_module.ipa.o.weight"] = (ipa + "/output_projection//weights", lambda w: w.T[:, cols])
    m["structure_module.ipa.o.bias"] = (ipa + "/output_projection//bias", None)
    fi = key + "/fold_iteration"
    m |= _norm("structure_module.norm_ipa", fi + "/attention_layer_norm")
    m |= _norm("structure_module.norm_transition", fi + "/transition_layer_norm")
    for i, suffix in enumerate(("transition", "transition_1", "transition_2")):
        m |= _linear(f"structure_module.transition.{i}", f"{fi}/{suffix}", sm.transition[i])
    m |= _linear("structure_module.backbone_update", fi + "/affine_update", sm.backbone_update)
    rs = fi + "/rigid_sidechain"
    m |= _linear("structure_module.angles.inp", rs + "/input_projection", sm.angles.inp)
    m |= _linear("structure_module.angles.inp_initial", rs + "/input_projection_1", sm.angles.inp_initial)
    for i, (fc1, fc2) in enumerate(sm.angles.blocks):
        tail = "" if i == 0 else f"_{i}"
        m |= _linear(f"structure_module.angles.blocks.{i}.0", f"{rs}/resblock1{tail}", fc1)
        m |= _linear(f"structure_module.angles.blocks.{i}.1", f"{rs}/resblock2{tail}", fc2)
    m |= _linear("structure_module.angles.out", rs + "/unnormalized_angles", sm.angles.out)
    return m


def _templates(model: AlphaFold) -> dict:
    """The template stack of params_model_1/2 (its pair-stack blocks: af2_mapping)."""
    te = ROOT + "evoformer/template_embedding"
    emb = model.template_embedder
    m = _linear("template_embedder.pair_embedding", te + "/single_template_embedding/embedding2d", emb.pair_embedding)
    m |= _norm("template_embedder.pair_stack.norm", te + "/single_template_embedding/output_layer_norm")
    m |= _attention("template_embedder.pointwise", te + "/attention", emb.pointwise)
    m |= _linear("template_angle_embedder.fc1", ROOT + "evoformer/template_single_embedding",
                 model.template_angle_embedder.fc1)
    m |= _linear("template_angle_embedder.fc2", ROOT + "evoformer/template_projection", model.template_angle_embedder.fc2)
    return m


def af2_mapping(model: AlphaFold) -> dict[str, tuple[str, Convert | None, int | None]]:
    """{parameter name: (AlphaFold key, conversion, index into the stacked blocks or None)}."""
    ev = ROOT + "evoformer"
    m: dict[str, tuple] = {}
    flat = {}
    flat |= _linear("input_embedder.m_target", ev + "/preprocess_1d", model.input_embedder.m_target)
    flat |= _linear("input_embedder.m_msa", ev + "/preprocess_msa", model.input_embedder.m_msa)
    flat |= _linear("input_embedder.z_i", ev + "/left_single", model.input_embedder.z_i)
    flat |= _linear("input_embedder.z_j", ev + "/right_single", model.input_embedder.z_j)
    flat |= _linear("input_embedder.relpos", ev + "/pair_activiations", model.input_embedder.relpos)  # sic
    flat |= _norm("recycling_embedder.norm_m", ev + "/prev_msa_first_row_norm")
    flat |= _norm("recycling_embedder.norm_z", ev + "/prev_pair_norm")
    flat |= _linear("recycling_embedder.dist", ev + "/prev_pos_linear", model.recycling_embedder.dist)
    flat |= _linear("extra_msa_embedder", ev + "/extra_msa_activations", model.extra_msa_embedder)
    flat |= _linear("single", ev + "/single_activations", model.single)
    heads = model.heads
    flat |= _norm("heads.plddt.0", ROOT + "predicted_lddt_head/input_layer_norm")
    flat |= _linear("heads.plddt.1", ROOT + "predicted_lddt_head/act_0", heads.plddt[1])
    flat |= _linear("heads.plddt.3", ROOT + "predicted_lddt_head/act_1", heads.plddt[3])
    flat |= _linear("heads.plddt.5", ROOT + "predicted_lddt_head/logits", heads.plddt[5])
    flat |= _linear("heads.distogram", ROOT + "distogram_head/half_logits", heads.distogram)
    flat |= _linear("heads.masked_msa", ROOT + "masked_msa_head/logits", heads.masked_msa)
    flat |= _linear("heads.experimentally_resolved", ROOT + "experimentally_resolved_head/logits",
                    heads.experimentally_resolved)
    if heads.pae is not None:
        flat |= _linear("heads.pae", ROOT + "predicted_aligned_error_head/logits", heads.pae)
    flat |= _structure(model)
    if model.cfg.templates:
        flat |= _templates(model)
        te = ev + "/template_embedding/single_template_embedding/template_pair_stack/__layer_stack_no_state"
        for i, block in enumerate(model.template_embedder.pair_stack.blocks):
            m |= {k: (v[0], v[1], i) for k, v in _pair_ops(f"template_embedder.pair_stack.blocks.{i}", te, block).items()}
    m |= {k: (key, conv, None) for k, (key, conv) in flat.items()}
    for stack, key, extra in (("evoformer", ev + "/evoformer_iteration", False),
                              ("extra_msa_stack", ev + "/extra_msa_stack", True)):
        for i, block in enumerate(getattr(model, stack).blocks):
            m |= {k: (v[0], v[1], i) for k, v in _block(f"{stack}.blocks.{i}", key, block, extra).items()}
    return m


TEMPLATE_KEYS = (ROOT + "evoformer/template_embedding/", ROOT + "evoformer/template_single_embedding/",
                 ROOT + "evoformer/template_projection/")


def load_af2_params(model: AlphaFold, path: str | Path) -> list[str]:
    """Fill `model` from an AlphaFold 2 .npz; returns the file's keys this model has no use for
    (the template stack of params_model_1/2 when `model.templates` is off: the model then predicts
    as AlphaFold does for a query without template hits)."""
    path = existing_file(path)
    with np.load(path) as npz:
        params = {k: npz[k] for k in npz.files}
    mapping = af2_mapping(model)
    load_mapped_state(model, params, mapping, path, "an AlphaFold 2 parameter file",
                      "model.evoformer_blocks / model.extra_msa_blocks")
    used = {key for key, _, _ in mapping.values()}
    unused = sorted(set(params) - used)
    refuse_unknown(unused, path, TEMPLATE_KEYS, ROOT + "predicted_aligned_error_head/")
    return unused


def existing_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such parameter file")
    return path


def refuse_unknown(unused: list[str], path: Path, templates: tuple[str, ...], pae: str) -> None:
    """Keys of the file the model cannot place: the template stack is allowed (AlphaFold without
    template hits), anything else means the file and the config disagree."""
    unknown = [k for k in unused if not k.startswith(templates)]
    if unknown:
        hint = (" (a pTM file: set model.pae_head=true)" if any(k.startswith(pae) for k in unknown) else
                ": the config does not describe this file's network")
        raise KeyError(f"{path}: {len(unknown)} arrays fit no parameter of this model, e.g. {unknown[:3]}{hint}")


def load_mapped_state(model: AlphaFold, params: dict, mapping: dict, path: Path, kind: str, blocks_hint: str) -> None:
    """Convert and shape-check every mapped array, then load them all (nothing is loaded on error)."""
    state = {}
    targets = dict(model.named_parameters())
    depth: dict[str, int] = {}
    for key, _, index in mapping.values():
        if index is not None:
            depth[key] = max(depth.get(key, 0), index + 1)
    for name, (key, convert, index) in mapping.items():
        if key not in params:
            hint = (": the file has no template stack (params_model_3/4/5): set model.templates=false"
                    if "template" in name else "")
            raise KeyError(f"{path} lacks {key!r} (for {name}): not {kind} of this architecture{hint}")
        value = np.asarray(params[key])
        if index is not None:
            if value.shape[0] != depth[key]:
                raise ValueError(f"{path}: {key!r} stacks {value.shape[0]} blocks where the config has "
                                 f"{depth[key]}; set {blocks_hint} to the file's")
            value = value[index]
        value = convert(value) if convert is not None else value
        target = targets[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{path}: {key!r} has shape {value.shape} where {name} needs {tuple(target.shape)}: the "
                             "config's channel sizes differ from the file's")
        state[name] = torch.as_tensor(np.ascontiguousarray(value), dtype=target.dtype)
    missing = set(targets) - set(state)
    if missing:
        raise KeyError(f"no key of {kind} maps to {sorted(missing)[:5]}: this model has parts AlphaFold lacks "
                       "(model.crop_position_bins must be 0)")
    model.load_state_dict(state, strict=False)


def save_af2_params(model: AlphaFold, path: str | Path) -> Path:
    """Write `model` in the AlphaFold naming (the inverse of load_af2_params; blocks stacked)."""
    mapping = af2_mapping(model)
    params = dict(model.named_parameters())
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, (key, convert, index) in mapping.items():
        value = params[name].detach().cpu().numpy()
        value = _invert(convert, value, key, model) if convert is not None else value
        if index is None:
            out[key] = value
        else:
            stacks.setdefault(key, {})[index] = value
    for key, blocks in stacks.items():
        out[key] = np.stack([blocks[i] for i in sorted(blocks)])
    np.savez(path, **out)
    return Path(path)


def _invert(convert: Convert, value: np.ndarray, key: str, model: AlphaFold) -> np.ndarray:
    """Solve convert(x) = value for x by probing convert with an index array of the source shape."""
    shape = _source_shape(key, value, model)
    probe = np.arange(int(np.prod(shape))).reshape(shape)
    where = convert(probe)
    flat = np.empty(int(np.prod(shape)), value.dtype)
    flat[where.reshape(-1)] = value.reshape(-1)
    return flat.reshape(shape)


def _source_shape(key: str, value: np.ndarray, model: AlphaFold) -> tuple[int, ...]:
    """The AlphaFold-side shape of a converted tensor."""
    cfg = model.cfg.evoformer
    leaf = key.split("/")[-1]
    heads = cfg.heads_pair if "/triangle_attention" in key else cfg.heads_msa
    if "/template_embedding/" in key:   # the template pair stack's triangle attention and the pointwise attention
        heads = model.cfg.template.heads
    if leaf in ("query_w", "gating_w"):
        return (value.shape[1], heads, value.shape[0] // heads)
    if leaf == "gating_b":
        return (heads, value.shape[0] // heads)
    if leaf in ("key_w", "value_w"):
        if "global" in key:
            return (value.shape[1], value.shape[0])
        return (value.shape[1], heads, value.shape[0] // heads)
    if leaf == "output_w":
        if "outer_product_mean" in key:
            c = cfg.c_hidden_opm
            return (c, c, value.shape[0])
        return (heads, value.shape[1] // heads, value.shape[0])
    if leaf == "bias":
        return value.shape
    return value.shape[::-1]  # Linear weights: [out, in] <- [in, out]


def load_params(model: AlphaFold, path: str | Path) -> list[str]:
    """AlphaFold 2 (.npz) or OpenFold (.pt / .pth / .ckpt) parameters, by the file's suffix; returns
    the file's unused keys (the template stack, if it has one)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".npz":
        return load_af2_params(model, path)
    if suffix in (".pt", ".pth", ".ckpt"):
        from apps.protein.weights_openfold import load_openfold_params
        return load_openfold_params(model, path)
    raise ValueError(f"{path}: parameters must be an AlphaFold 2 .npz (params_model_*.npz) or an OpenFold .pt "
                     "state dict")
