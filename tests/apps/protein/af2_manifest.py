"""The arrays of DeepMind's AlphaFold 2 parameter files and of OpenFold's state dicts: name and shape.

Written from the public model definition (the AF2 monomer config: channel sizes, heads, blocks)
and the published weight-import table of OpenFold (which names each array and its layout), not
from this recipe's code, so the tests can hold apps.protein.weights against it. At AF2's sizes
its output is the fixture `fixtures/af2_params_manifest.json` (regenerate with
`python tests/apps/protein/af2_manifest.py`); at a tiny size it describes small synthetic files.

Naming facts: a Haiku module path under `alphafold/alphafold_iteration/`, then `//` and the
parameter (`weights` [in, out], `bias`, `scale`, `offset`); the attention module's parameters hang
off `.../attention//query_w` [c_in, heads, c_head]; the Evoformer, extra-MSA and template pair
stacks are stacked along a first axis (the template pair stack under `__layer_stack_no_state`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "af2_params_manifest.json"
ROOT = "alphafold/alphafold_iteration/"
VARIANTS = [f"model_{i}{s}" for s in ("", "_ptm") for i in range(1, 6)]
TEMPLATE_VARIANTS = {"model_1", "model_2", "model_1_ptm", "model_2_ptm"}


@dataclass
class Dims:
    """AlphaFold 2 monomer sizes (model config `model_1` .. `model_5`)."""
    c_m: int = 256
    c_z: int = 128
    c_e: int = 64
    c_s: int = 384
    c_t: int = 64
    evoformer_blocks: int = 48
    extra_blocks: int = 4
    template_blocks: int = 2
    heads_msa: int = 8          # per-head width: c_m / heads in the main stack, c_e / heads in the extra one
    heads_pair: int = 4         # triangle attention: c_z / heads
    heads_template: int = 4     # template pair stack and pointwise attention: c_t / heads
    c_mul: int = 128
    c_mul_template: int = 64
    c_opm: int = 32
    transition: int = 4
    transition_template: int = 2
    ipa_heads: int = 12
    c_ipa: int = 16
    query_points: int = 4
    value_points: int = 8
    c_resnet: int = 128
    c_head: int = 128           # pLDDT head hidden width


def _linear(out: dict, path: str, c_in: int, c_out: int, bias: bool = True, stack: tuple = ()) -> None:
    out[path + "//weights"] = [*stack, c_in, c_out]
    if bias:
        out[path + "//bias"] = [*stack, c_out]


def _norm(out: dict, path: str, c: int, stack: tuple = ()) -> None:
    out[path + "//scale"] = [*stack, c]
    out[path + "//offset"] = [*stack, c]


def _attention(out: dict, path: str, c_q: int, c_kv: int, heads: int, c_head: int, gating: bool, stack=()) -> None:
    a = path + "/attention//"
    out[a + "query_w"] = [*stack, c_q, heads, c_head]
    out[a + "key_w"] = [*stack, c_kv, heads, c_head]
    out[a + "value_w"] = [*stack, c_kv, heads, c_head]
    out[a + "output_w"] = [*stack, heads, c_head, c_q]
    out[a + "output_b"] = [*stack, c_q]
    if gating:
        out[a + "gating_w"] = [*stack, c_q, heads, c_head]
        out[a + "gating_b"] = [*stack, heads, c_head]


def _pair_ops(out: dict, path: str, c: int, heads: int, c_mul: int, n: int, stack: tuple) -> None:
    for direction in ("outgoing", "incoming"):
        t = f"{path}/triangle_multiplication_{direction}"
        _norm(out, t + "/layer_norm_input", c, stack)
        for part in ("left_projection", "right_projection", "left_gate", "right_gate"):
            _linear(out, f"{t}/{part}", c, c_mul, stack=stack)
        _norm(out, t + "/center_layer_norm", c_mul, stack)
        _linear(out, t + "/output_projection", c_mul, c, stack=stack)
        _linear(out, t + "/gating_linear", c, c, stack=stack)
    for node in ("starting", "ending"):
        t = f"{path}/triangle_attention_{node}_node"
        _norm(out, t + "/query_norm", c, stack)
        out[t + "//feat_2d_weights"] = [*stack, c, heads]
        _attention(out, t, c, c, heads, c // heads, True, stack)
    _norm(out, path + "/pair_transition/input_layer_norm", c, stack)
    _linear(out, path + "/pair_transition/transition1", c, n * c, stack=stack)
    _linear(out, path + "/pair_transition/transition2", n * c, c, stack=stack)


def _msa_block(out: dict, path: str, d: Dims, c: int, extra: bool, blocks: int) -> None:
    stack = (blocks,)
    row = path + "/msa_row_attention_with_pair_bias"
    _norm(out, row + "/query_norm", c, stack)
    _norm(out, row + "/feat_2d_norm", d.c_z, stack)
    out[row + "//feat_2d_weights"] = [blocks, d.c_z, d.heads_msa]
    _attention(out, row, c, c, d.heads_msa, c // d.heads_msa, True, stack)
    if extra:
        col = path + "/msa_column_global_attention"
        _attention(out, col, c, c, d.heads_msa, c // d.heads_msa, True, stack)
        out[col + "/attention//key_w"] = [blocks, c, c // d.heads_msa]     # one shared key/value head
        out[col + "/attention//value_w"] = [blocks, c, c // d.heads_msa]
    else:
        col = path + "/msa_column_attention"
        _attention(out, col, c, c, d.heads_msa, c // d.heads_msa, True, stack)
    _norm(out, col + "/query_norm", c, stack)
    _norm(out, path + "/msa_transition/input_layer_norm", c, stack)
    _linear(out, path + "/msa_transition/transition1", c, d.transition * c, stack=stack)
    _linear(out, path + "/msa_transition/transition2", d.transition * c, c, stack=stack)
    opm = path + "/outer_product_mean"
    _norm(out, opm + "/layer_norm_input", c, stack)
    _linear(out, opm + "/left_projection", c, d.c_opm, stack=stack)
    _linear(out, opm + "/right_projection", c, d.c_opm, stack=stack)
    out[opm + "//output_w"] = [blocks, d.c_opm, d.c_opm, d.c_z]
    out[opm + "//output_b"] = [blocks, d.c_z]
    _pair_ops(out, path, d.c_z, d.heads_pair, d.c_mul, d.transition, stack)


def _templates(out: dict, d: Dims) -> None:
    ev = ROOT + "evoformer/"
    te = ev + "template_embedding/single_template_embedding"
    _linear(out, te + "/embedding2d", 88, d.c_t)
    _pair_ops(out, te + "/template_pair_stack/__layer_stack_no_state", d.c_t, d.heads_template, d.c_mul_template,
              d.transition_template, (d.template_blocks,))
    _norm(out, te + "/output_layer_norm", d.c_t)
    _attention(out, ev + "template_embedding", d.c_z, d.c_t, d.heads_template, d.c_t // d.heads_template, False)
    _linear(out, ev + "template_single_embedding", 57, d.c_m)
    _linear(out, ev + "template_projection", d.c_m, d.c_m)


def _structure(out: dict, d: Dims) -> None:
    sm = ROOT + "structure_module"
    _norm(out, sm + "/single_layer_norm", d.c_s)
    _linear(out, sm + "/initial_projection", d.c_s, d.c_s)
    _norm(out, sm + "/pair_layer_norm", d.c_z)
    fi = sm + "/fold_iteration"
    ipa = fi + "/invariant_point_attention"
    h, pq, pv = d.ipa_heads, d.query_points, d.value_points
    _linear(out, ipa + "/q_scalar", d.c_s, h * d.c_ipa)
    _linear(out, ipa + "/kv_scalar", d.c_s, 2 * h * d.c_ipa)
    _linear(out, ipa + "/q_point_local", d.c_s, 3 * h * pq)
    _linear(out, ipa + "/kv_point_local", d.c_s, 3 * h * (pq + pv))
    out[ipa + "//trainable_point_weights"] = [h]
    _linear(out, ipa + "/attention_2d", d.c_z, h)
    _linear(out, ipa + "/output_projection", h * (d.c_ipa + 4 * pv + d.c_z), d.c_s)
    _norm(out, fi + "/attention_layer_norm", d.c_s)
    for name in ("transition", "transition_1", "transition_2"):
        _linear(out, f"{fi}/{name}", d.c_s, d.c_s)
    _norm(out, fi + "/transition_layer_norm", d.c_s)
    _linear(out, fi + "/affine_update", d.c_s, 6)
    rs = fi + "/rigid_sidechain"
    _linear(out, rs + "/input_projection", d.c_s, d.c_resnet)
    _linear(out, rs + "/input_projection_1", d.c_s, d.c_resnet)
    for name in ("resblock1", "resblock2", "resblock1_1", "resblock2_1"):
        _linear(out, f"{rs}/{name}", d.c_resnet, d.c_resnet)
    _linear(out, rs + "/unnormalized_angles", d.c_resnet, 14)


def af2_arrays(d: Dims, variant: str) -> dict[str, list[int]]:
    """{key: shape} of params_<variant>.npz at the sizes `d`."""
    out: dict[str, list[int]] = {}
    ev = ROOT + "evoformer/"
    _linear(out, ev + "preprocess_1d", 22, d.c_m)
    _linear(out, ev + "preprocess_msa", 49, d.c_m)
    _linear(out, ev + "left_single", 22, d.c_z)
    _linear(out, ev + "right_single", 22, d.c_z)
    _linear(out, ev + "pair_activiations", 65, d.c_z)   # sic, as released
    _linear(out, ev + "prev_pos_linear", 15, d.c_z)
    _norm(out, ev + "prev_msa_first_row_norm", d.c_m)
    _norm(out, ev + "prev_pair_norm", d.c_z)
    _linear(out, ev + "extra_msa_activations", 25, d.c_e)
    _linear(out, ev + "single_activations", d.c_m, d.c_s)
    _msa_block(out, ev + "evoformer_iteration", d, d.c_m, False, d.evoformer_blocks)
    _msa_block(out, ev + "extra_msa_stack", d, d.c_e, True, d.extra_blocks)
    if variant in TEMPLATE_VARIANTS:
        _templates(out, d)
    _structure(out, d)
    _norm(out, ROOT + "predicted_lddt_head/input_layer_norm", d.c_s)
    _linear(out, ROOT + "predicted_lddt_head/act_0", d.c_s, d.c_head)
    _linear(out, ROOT + "predicted_lddt_head/act_1", d.c_head, d.c_head)
    _linear(out, ROOT + "predicted_lddt_head/logits", d.c_head, 50)
    _linear(out, ROOT + "distogram_head/half_logits", d.c_z, 64)
    _linear(out, ROOT + "experimentally_resolved_head/logits", d.c_s, 37)
    _linear(out, ROOT + "masked_msa_head/logits", d.c_m, 23)
    if variant.endswith("_ptm"):
        _linear(out, ROOT + "predicted_aligned_error_head/logits", d.c_z, 64)
    return out


# ---------------------------------------------------------------- OpenFold's names for the same arrays
# OpenFold's weight-import table: AlphaFold module path -> OpenFold module, leaf -> parameter.
_OF_TOP = {"evoformer/preprocess_1d": "input_embedder.linear_tf_m", "evoformer/preprocess_msa": "input_embedder.linear_msa_m",
           "evoformer/left_single": "input_embedder.linear_tf_z_i", "evoformer/right_single": "input_embedder.linear_tf_z_j",
           "evoformer/pair_activiations": "input_embedder.linear_relpos",
           "evoformer/prev_pos_linear": "recycling_embedder.linear",
           "evoformer/prev_msa_first_row_norm": "recycling_embedder.layer_norm_m",
           "evoformer/prev_pair_norm": "recycling_embedder.layer_norm_z",
           "evoformer/extra_msa_activations": "extra_msa_embedder.linear", "evoformer/single_activations": "evoformer.linear",
           "structure_module/single_layer_norm": "structure_module.layer_norm_s",
           "structure_module/initial_projection": "structure_module.linear_in",
           "structure_module/pair_layer_norm": "structure_module.layer_norm_z",
           "predicted_lddt_head/input_layer_norm": "aux_heads.plddt.layer_norm",
           "predicted_lddt_head/act_0": "aux_heads.plddt.linear_1", "predicted_lddt_head/act_1": "aux_heads.plddt.linear_2",
           "predicted_lddt_head/logits": "aux_heads.plddt.linear_3", "distogram_head/half_logits": "aux_heads.distogram.linear",
           "experimentally_resolved_head/logits": "aux_heads.experimentally_resolved.linear",
           "masked_msa_head/logits": "aux_heads.masked_msa.linear", "predicted_aligned_error_head/logits": "aux_heads.tm.linear"}
_OF_FOLD = {"invariant_point_attention/q_scalar": "ipa.linear_q", "invariant_point_attention/kv_scalar": "ipa.linear_kv",
            "invariant_point_attention/q_point_local": "ipa.linear_q_points.linear",
            "invariant_point_attention/kv_point_local": "ipa.linear_kv_points.linear",
            "invariant_point_attention/attention_2d": "ipa.linear_b", "invariant_point_attention/output_projection":
            "ipa.linear_out", "invariant_point_attention": "ipa", "attention_layer_norm": "layer_norm_ipa",
            "transition": "transition.layers.0.linear_1", "transition_1": "transition.layers.0.linear_2",
            "transition_2": "transition.layers.0.linear_3", "transition_layer_norm": "transition.layer_norm",
            "affine_update": "bb_update.linear", "rigid_sidechain/input_projection": "angle_resnet.linear_in",
            "rigid_sidechain/input_projection_1": "angle_resnet.linear_initial",
            "rigid_sidechain/resblock1": "angle_resnet.layers.0.linear_1", "rigid_sidechain/resblock2":
            "angle_resnet.layers.0.linear_2", "rigid_sidechain/resblock1_1": "angle_resnet.layers.1.linear_1",
            "rigid_sidechain/resblock2_1": "angle_resnet.layers.1.linear_2",
            "rigid_sidechain/unnormalized_angles": "angle_resnet.linear_out"}
_OF_MUL = {"layer_norm_input": "layer_norm_in", "center_layer_norm": "layer_norm_out", "output_projection": "linear_z",
           "gating_linear": "linear_g"}
_OF_BLOCK = {"msa_row_attention_with_pair_bias/query_norm": "msa_att_row.layer_norm_m",
             "msa_row_attention_with_pair_bias/feat_2d_norm": "msa_att_row.layer_norm_z",
             "msa_row_attention_with_pair_bias": "msa_att_row.linear_z",      # its //feat_2d_weights
             "msa_row_attention_with_pair_bias/attention": "msa_att_row.mha",
             "msa_column_attention/query_norm": "msa_att_col._msa_att.layer_norm_m",
             "msa_column_attention/attention": "msa_att_col._msa_att.mha",
             "msa_column_global_attention/query_norm": "msa_att_col.layer_norm_m",
             "msa_column_global_attention/attention": "msa_att_col.global_attention",
             "msa_transition/input_layer_norm": "msa_transition.layer_norm",
             "msa_transition/transition1": "msa_transition.linear_1", "msa_transition/transition2": "msa_transition.linear_2",
             "outer_product_mean/layer_norm_input": "outer_product_mean.layer_norm",
             "outer_product_mean/left_projection": "outer_product_mean.linear_1",
             "outer_product_mean/right_projection": "outer_product_mean.linear_2",
             "outer_product_mean": "outer_product_mean.linear_out",
             "pair_transition/input_layer_norm": "pair_stack.pair_transition.layer_norm",
             "pair_transition/transition1": "pair_stack.pair_transition.linear_1",
             "pair_transition/transition2": "pair_stack.pair_transition.linear_2"}
for _d, _of in (("outgoing", "tri_mul_out"), ("incoming", "tri_mul_in")):
    _a, _b = ("a", "b") if _d == "outgoing" else ("b", "a")   # OpenFold swaps left/right for incoming
    _OF_BLOCK |= {f"triangle_multiplication_{_d}/{k}": f"pair_stack.{_of}.{v}" for k, v in _OF_MUL.items()}
    _OF_BLOCK |= {f"triangle_multiplication_{_d}/left_projection": f"pair_stack.{_of}.linear_{_a}_p",
                  f"triangle_multiplication_{_d}/right_projection": f"pair_stack.{_of}.linear_{_b}_p",
                  f"triangle_multiplication_{_d}/left_gate": f"pair_stack.{_of}.linear_{_a}_g",
                  f"triangle_multiplication_{_d}/right_gate": f"pair_stack.{_of}.linear_{_b}_g"}
for _n, _of in (("starting", "tri_att_start"), ("ending", "tri_att_end")):
    _OF_BLOCK |= {f"triangle_attention_{_n}_node/query_norm": f"pair_stack.{_of}.layer_norm",
                  f"triangle_attention_{_n}_node": f"pair_stack.{_of}.linear",
                  f"triangle_attention_{_n}_node/attention": f"pair_stack.{_of}.mha"}
_OF_LEAF = {"weights": "weight", "bias": "bias", "scale": "weight", "offset": "bias", "feat_2d_weights": "weight",
            "output_w": "weight", "output_b": "bias", "query_w": "linear_q.weight", "key_w": "linear_k.weight",
            "value_w": "linear_v.weight", "gating_w": "linear_g.weight", "gating_b": "linear_g.bias",
            "trainable_point_weights": "head_weights"}
_OF_ATTN_LEAVES = {"query_w", "key_w", "value_w", "gating_w", "gating_b"}
# The template stack (OpenFold's import table for model_1/2; its modules under template_embedder).
_TEMPLATE_STACK = "evoformer/template_embedding/single_template_embedding/template_pair_stack/__layer_stack_no_state"
_OF_TEMPLATE = {"evoformer/template_embedding/single_template_embedding/embedding2d":
                "template_embedder.template_pair_embedder.linear",
                "evoformer/template_embedding/single_template_embedding/output_layer_norm":
                "template_embedder.template_pair_stack.layer_norm",
                "evoformer/template_embedding/attention": "template_embedder.template_pointwise_att.mha",
                "evoformer/template_single_embedding": "template_embedder.template_single_embedder.linear_1",
                "evoformer/template_projection": "template_embedder.template_single_embedder.linear_2"}


def openfold_name(key: str, block: int | None = None) -> str:
    """OpenFold's state-dict name of one AlphaFold array (of block `block` of a stacked one)."""
    module, leaf = key[len(ROOT):].split("//")
    if leaf == "output_w" and module.endswith("/attention"):
        leaf = "linear_o.weight"
    elif leaf == "output_b" and module.endswith("/attention"):
        leaf = "linear_o.bias"
    else:
        leaf = _OF_LEAF[leaf]
    for stack, of in (("evoformer/evoformer_iteration", "evoformer"), ("evoformer/extra_msa_stack", "extra_msa_stack")):
        if module.startswith(stack + "/"):
            return f"{of}.blocks.{block}.{_OF_BLOCK[module[len(stack) + 1:]]}.{leaf}"
    if module.startswith(_TEMPLATE_STACK + "/"):   # a template pair block holds the pair operations directly
        inner = _OF_BLOCK[module[len(_TEMPLATE_STACK) + 1:]].removeprefix("pair_stack.")
        return f"template_embedder.template_pair_stack.blocks.{block}.{inner}.{leaf}"
    if module in _OF_TEMPLATE:
        return f"{_OF_TEMPLATE[module]}.{leaf}"
    if module.startswith("structure_module/fold_iteration/"):
        return f"structure_module.{_OF_FOLD[module[len('structure_module/fold_iteration/'):]]}.{leaf}"
    return f"{_OF_TOP[module]}.{leaf}"


def openfold_layout(key: str, value):
    """OpenFold's tensor of an AlphaFold array: weights [in.., out] become [out, in] with the
    heads flattened; attention outputs [heads, c_head, out] become [out, heads * c_head]."""
    leaf = key.split("//")[-1]
    if leaf == "gating_b":
        return value.reshape(-1)
    if leaf == "output_w":
        return value.reshape(-1, value.shape[-1]).T
    if leaf in _OF_ATTN_LEAVES or leaf in ("weights", "feat_2d_weights"):
        return value.reshape(value.shape[0], -1).T
    return value


def is_stacked(key: str) -> bool:
    """Whether an AlphaFold array stacks the blocks of a stack on its first axis."""
    return "/evoformer_iteration/" in key or "/extra_msa_stack/" in key or "/__layer_stack_no_state/" in key


def openfold_arrays(af2: dict[str, list[int]]) -> dict[str, list[int]]:
    """{OpenFold state-dict name: torch shape} of the arrays of an AlphaFold file; the
    blocks of a stack are written once, as `blocks.{i}.` (their count is the AlphaFold stack's)."""
    import numpy as np

    out = {}
    for key, shape in af2.items():
        stacked = is_stacked(key)
        one = np.empty(shape[1:] if stacked else shape, dtype=np.int8)
        out[openfold_name(key, "{i}" if stacked else None)] = list(openfold_layout(key, one).shape)
    return out


def expand_blocks(arrays: dict[str, list[int]], blocks: dict[str, int]) -> dict[str, list[int]]:
    """`blocks.{i}.` names -> one name per block."""
    out = {}
    for name, shape in arrays.items():
        stack = name.split(".")[0]
        count = blocks[stack] if ".blocks.{i}." in name else 1
        for i in range(count):
            out[name.replace("{i}", str(i))] = shape
    return out


def _split(variants: dict[str, dict]) -> tuple[dict, dict]:
    """Arrays shared by every variant, and each part's extra ones, so the fixture stays small."""
    base = variants["model_3"]
    parts = {"base": base, "templates": {k: v for k, v in variants["model_1"].items() if k not in base},
             "ptm": {k: v for k, v in variants["model_3_ptm"].items() if k not in base}}
    return parts, {v: ["base"] + (["templates"] if v in TEMPLATE_VARIANTS else []) + (["ptm"] if "_ptm" in v else [])
                   for v in variants}


def manifest(d: Dims | None = None) -> dict:
    """The fixture: dims, the arrays in parts, which parts each variant has, OpenFold's names."""
    d = d or Dims()
    parts, variants = _split({v: af2_arrays(d, v) for v in VARIANTS})
    of_base = openfold_arrays(parts["base"])
    return {"source": "AlphaFold 2 monomer model config and OpenFold's weight-import table (facts: names, shapes)",
            "dims": asdict(d), "parts": parts, "variants": variants,
            "openfold": {"blocks": {"evoformer": d.evoformer_blocks, "extra_msa_stack": d.extra_blocks,
                                    "template_embedder": d.template_blocks},
                         "base": of_base, "ptm": openfold_arrays(parts["ptm"]),
                         "templates": openfold_arrays(parts["templates"])}}


def variant_arrays(m: dict, variant: str) -> dict[str, list[int]]:
    """One variant's {key: shape} from a manifest."""
    out = {}
    for part in m["variants"][variant]:
        out |= m["parts"][part]
    return out


def openfold_variant(m: dict, ptm: bool, templates: bool = False) -> dict[str, list[int]]:
    """OpenFold's {name: shape} of a checkpoint, with or without the pTM head and the template stack."""
    of = m["openfold"]
    return expand_blocks(of["base"] | (of["ptm"] if ptm else {}) | (of["templates"] if templates else {}), of["blocks"])


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    import re

    text = json.dumps(manifest(), indent=1, sort_keys=True)
    text = re.sub(r"\[\s*([\d,\s]*?)\s*\]", lambda g: "[" + re.sub(r"\s+", "", g.group(1)) + "]", text)
    FIXTURE.write_text(text + "\n")
    print(f"wrote {FIXTURE}")
