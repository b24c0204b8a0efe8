"""apps.protein.weights against the real layout of AlphaFold 2's params_model_*.npz and OpenFold's
.pt state dicts: every array of the manifest (fixtures/af2_params_manifest.json, written from the
public model definition by af2_manifest.py) maps to one parameter of this model at AF2's sizes
(built on the meta device: no memory), and small synthetic files in that naming load and run.

Models 1 and 2 (and their _ptm files) also hold a template stack: with `model.templates` every one
of its arrays maps too; without it the template arrays are exactly what stays unused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from af2_manifest import (FIXTURE, TEMPLATE_VARIANTS, VARIANTS, Dims, af2_arrays, is_stacked, manifest,
                          openfold_layout, openfold_name, openfold_variant, variant_arrays)
from apps.protein.model import AlphaFold, ModelConfig
from apps.protein.model.evoformer import EvoformerConfig
from apps.protein.model.structure import StructureConfig
from apps.protein.model.template import TemplateConfig
from apps.protein.weights import af2_mapping, load_af2_params, load_params, save_af2_params
from apps.protein.weights_openfold import load_openfold_params, openfold_mapping
from protein_tiny import real_batch

MANIFEST = json.loads(FIXTURE.read_text())


def config_for(d: Dims, ptm: bool, templates: bool = False) -> ModelConfig:
    """This recipe's config of a network with AlphaFold's layout at the sizes `d`."""
    return ModelConfig(c_m=d.c_m, c_z=d.c_z, c_e=d.c_e, c_s=d.c_s, evoformer_blocks=d.evoformer_blocks,
                       extra_msa_blocks=d.extra_blocks, pae_head=ptm, templates=templates,
                       template=TemplateConfig(c_t=d.c_t, blocks=d.template_blocks, heads=d.heads_template,
                                               c_hidden_mul=d.c_mul_template, transition_n=d.transition_template),
                       evoformer=EvoformerConfig(heads_msa=d.heads_msa, c_hidden_msa=d.c_m // d.heads_msa,
                                                 heads_pair=d.heads_pair, c_hidden_pair=d.c_z // d.heads_pair,
                                                 c_hidden_mul=d.c_mul, c_hidden_opm=d.c_opm,
                                                 transition_n=d.transition, c_hidden_extra=d.c_e // d.heads_msa),
                       structure=StructureConfig(c_ipa=d.c_ipa, heads=d.ipa_heads, query_points=d.query_points,
                                                 value_points=d.value_points, c_resnet=d.c_resnet)).synced()


@pytest.fixture(scope="module")
def real_size_models():
    """AlphaFold 2's sizes from the alphafold2.yaml config, on the meta device."""
    from apps.protein.config import load_recipe

    models = {}
    for ptm in (False, True):
        for templates in (False, True):
            cfg = load_recipe("apps/protein/configs/alphafold2.yaml", [f"model.pae_head={ptm}", f"model.templates={templates}"])
            with torch.device("meta"):
                models[ptm, templates] = AlphaFold(cfg.model)
    return models


def test_fixture_is_the_generators_output_at_alphafold_sizes():
    assert MANIFEST == json.loads(json.dumps(manifest()))
    sizes = {v: sum(int(np.prod(s)) for s in variant_arrays(MANIFEST, v).values()) for v in VARIANTS}
    assert 92_000_000 < sizes["model_3"] < sizes["model_1"] < 94_000_000  # "~93M parameters"
    assert variant_arrays(MANIFEST, "model_3") == variant_arrays(MANIFEST, "model_5")


def _converted_shape(convert, shape) -> tuple:
    return tuple((convert(np.zeros(shape, np.int8)) if convert is not None else np.zeros(shape, np.int8)).shape)


def _check_af2_mapping(model: AlphaFold, arrays: dict[str, list[int]]) -> set[str]:
    """Every mapped key is in `arrays` with the right shape (each block of a stack exactly once);
    returns the keys of `arrays` nothing maps to."""
    params = dict(model.named_parameters())
    mapping = af2_mapping(model)
    assert set(mapping) == set(params)  # no parameter unmapped
    blocks: dict[str, set[int]] = {}
    for name, (key, convert, index) in mapping.items():
        assert key in arrays, f"{name} -> {key}: not an array of the file"
        shape = arrays[key]
        if index is not None:
            blocks.setdefault(key, set()).add(index)
            shape = shape[1:]
        assert _converted_shape(convert, shape) == tuple(params[name].shape), (name, key)
    for key, seen in blocks.items():
        assert seen == set(range(arrays[key][0])), key
    single = [k for k, (key, _, index) in mapping.items() if index is None]
    assert len({mapping[k][0] for k in single}) == len(single)  # one parameter per unstacked array
    return set(arrays) - {key for key, _, _ in mapping.values()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_array_of_the_alphafold_file_maps_to_one_parameter(variant, real_size_models):
    """Models 1-2 with model.templates: every array, the template stack's too; the others without."""
    templates = variant in TEMPLATE_VARIANTS
    arrays = variant_arrays(MANIFEST, variant)
    assert _check_af2_mapping(real_size_models[variant.endswith("_ptm"), templates], arrays) == set()
    if templates:  # a model without the stack leaves exactly the template arrays unused
        unused = _check_af2_mapping(real_size_models[variant.endswith("_ptm"), False], arrays)
        assert unused == set(MANIFEST["parts"]["templates"])


@pytest.mark.parametrize("ptm", [False, True])
@pytest.mark.parametrize("templates", [False, True])
def test_every_openfold_tensor_maps_to_one_parameter(ptm, templates, real_size_models):
    model = real_size_models[ptm, templates]
    tensors = openfold_variant(MANIFEST, ptm, templates)
    params = dict(model.named_parameters())
    mapping = openfold_mapping(model)
    assert set(mapping) == set(params)
    assert sorted(key for key, _, _ in mapping.values()) == sorted(tensors)  # each once, none left over
    for name, (key, convert, _) in mapping.items():
        assert _converted_shape(convert, tensors[key]) == tuple(params[name].shape), (name, key)


# ------------------------------------------------------------------ small synthetic files
TINY = Dims(c_m=16, c_z=8, c_e=8, c_s=16, c_t=8, evoformer_blocks=2, extra_blocks=1, template_blocks=1, heads_msa=2,
            heads_pair=2, heads_template=2, c_mul=8, c_mul_template=8, c_opm=4, transition=2, transition_template=2,
            ipa_heads=2, c_ipa=4, query_points=2, value_points=3, c_resnet=8, c_head=128)


def _random_file(variant: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in af2_arrays(TINY, variant).items()}


def _as_openfold(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The same arrays in OpenFold's names and layouts (as its import converts them)."""
    out = {}
    for key, value in arrays.items():
        for b, v in (enumerate(value) if is_stacked(key) else [(None, value)]):
            out[openfold_name(key, b)] = torch.from_numpy(np.ascontiguousarray(openfold_layout(key, v)))
    return out


def test_synthetic_files_load_run_and_export(tmp_path):
    """A random params_model_3_ptm-layout .npz and the same values as an OpenFold .pt load into
    identical models that run; the exporter writes the .npz back array for array."""
    arrays = _random_file("model_3_ptm")
    np.savez(tmp_path / "params_model_3_ptm.npz", **arrays)
    torch.save(_as_openfold(arrays), tmp_path / "finetuning_ptm.pt")
    cfg = config_for(TINY, ptm=True)
    cfg.recycles = 1
    from_npz, from_pt = AlphaFold(cfg), AlphaFold(cfg)
    assert load_params(from_npz, tmp_path / "params_model_3_ptm.npz") == []
    assert load_params(from_pt, tmp_path / "finetuning_ptm.pt") == []
    for (name, a), b in zip(from_npz.named_parameters(), from_pt.parameters(), strict=True):
        assert torch.equal(a, b), name
    # A value lands where AlphaFold's layout says: head 1, channel 2 of the query is row 1 * 8 + 2.
    qw = arrays["alphafold/alphafold_iteration/evoformer/extra_msa_stack/msa_row_attention_with_pair_bias/"
                "attention//query_w"]
    q = from_npz.extra_msa_stack.blocks[0].row_attn.attn.q.weight.detach().numpy()
    assert q.shape == (2 * 4, 8) and np.allclose(q[1 * 4 + 2], qw[0, :, 1, 2])
    batch = real_batch(crop=12, clusters=3, extra=4, batch=1)
    with torch.no_grad():
        out_npz, out_pt = from_npz.eval()(**batch), from_pt.eval()(**batch)
    assert out_npz["pae_logits"].shape == (1, 12, 12, 64)
    assert torch.isfinite(out_npz["atom37"]).all()
    assert torch.equal(out_npz["atom37"], out_pt["atom37"]) and torch.equal(out_npz["pae_logits"], out_pt["pae_logits"])
    back = np.load(save_af2_params(from_npz, tmp_path / "export.npz"))
    assert sorted(back.files) == sorted(arrays)
    for key, value in arrays.items():
        assert np.array_equal(back[key], value), key


V1_TEMPLATE_NAMES = (("template_embedder.template_single_embedder.", "template_angle_embedder."),
                     ("template_embedder.", ""))   # OpenFold before its multimer refactor


@pytest.mark.parametrize("variant", ["model_1", "model_2_ptm"])
def test_synthetic_template_files_load_run_and_export(variant, tmp_path):
    """Random params_model_1/2 files (every array of the manifest, the template stack included)
    load from .npz, from an OpenFold .pt and from an OpenFold .pt in the pre-refactor names into
    identical models with model.templates, which run on a batch with a template (the template
    changes the prediction); the exporter writes the .npz back array for array."""
    arrays = _random_file(variant, seed=3)
    np.savez(tmp_path / "p.npz", **arrays)
    state = _as_openfold(arrays)
    torch.save(state, tmp_path / "new.pt")
    old = {}
    for k, v in state.items():
        for new, former in V1_TEMPLATE_NAMES:
            if k.startswith(new):
                k = former + k[len(new):]
                break
        old[k] = v
    assert any(k.startswith("template_angle_embedder.linear_1") for k in old)
    torch.save(old, tmp_path / "old.pt")
    cfg = config_for(TINY, ptm=variant.endswith("_ptm"), templates=True)
    models = [AlphaFold(cfg) for _ in range(3)]
    for model, name in zip(models, ("p.npz", "new.pt", "old.pt"), strict=True):
        assert load_params(model, tmp_path / name) == []
    for (name, a), b, c in zip(models[0].named_parameters(), models[1].parameters(), models[2].parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name
    # The pointwise attention's key: head 1, channel 3 of template channel 5 is row 1 * 4 + 3, column 5.
    kw = arrays["alphafold/alphafold_iteration/evoformer/template_embedding/attention//key_w"]
    k = models[0].template_embedder.pointwise.k.weight.detach().numpy()
    assert k.shape == (8, 8) and np.allclose(k[1 * 4 + 3, 5], kw[5, 1, 3])
    batch = real_batch(crop=12, clusters=3, extra=4, batch=1, templates=2)
    with torch.no_grad():
        outs = [m.eval()(**batch) for m in models]
        plain = models[0](**{k: v for k, v in batch.items() if not k.startswith("template_")})
    assert torch.equal(outs[0]["atom37"], outs[1]["atom37"]) and torch.equal(outs[0]["atom37"], outs[2]["atom37"])
    assert (outs[0]["pair"] - plain["pair"]).abs().max() > 1e-3    # the template reached the pair representation
    back = np.load(save_af2_params(models[0], tmp_path / "export.npz"))
    assert sorted(back.files) == sorted(arrays)
    for key, value in arrays.items():
        assert np.array_equal(back[key], value), key
    with pytest.raises(KeyError, match="no template stack .*model.templates=false"):
        load_params(AlphaFold(cfg), _save(tmp_path / "model_3.npz", _random_file("model_3")))


def _save(path, arrays):
    np.savez(path, **arrays)
    return path


def test_template_files_load_without_their_template_stack(tmp_path):
    """params_model_1: everything but the template stack loads; the template arrays come back as
    unused (the model predicts as AlphaFold without template hits)."""
    arrays = _random_file("model_1")
    np.savez(tmp_path / "params_model_1.npz", **arrays)
    unused = load_af2_params(AlphaFold(config_for(TINY, ptm=False)), tmp_path / "params_model_1.npz")
    assert unused and all("template" in k for k in unused)
    assert set(unused) == set(af2_arrays(TINY, "model_1")) - set(af2_arrays(TINY, "model_3"))


def test_openfold_checkpoint_variants(tmp_path):
    """A Lightning checkpoint (EMA weights preferred, `model.` prefix) and the names of OpenFold's
    releases before its multimer refactor load the same values."""
    arrays = _random_file("model_4")
    state = _as_openfold(arrays)
    old = {}
    for k, v in state.items():
        k = k.replace("pair_stack.tri_", "core.tri_").replace("pair_stack.pair_transition", "core.pair_transition")
        k = k.replace(".msa_transition.", ".core.msa_transition.").replace("linear_q_points.linear", "linear_q_points")
        old["model." + k] = v
    torch.save({"state_dict": {"model." + k: torch.zeros_like(v) for k, v in state.items()}, "ema": {"params": old}},
               tmp_path / "ckpt.ckpt")
    cfg = config_for(TINY, ptm=False)
    reference, model = AlphaFold(cfg), AlphaFold(cfg)
    np.savez(tmp_path / "p.npz", **arrays)
    load_af2_params(reference, tmp_path / "p.npz")
    assert load_openfold_params(model, tmp_path / "ckpt.ckpt") == []
    for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(KeyError, match="a pTM file: set model.pae_head=true"):
        torch.save(_as_openfold(_random_file("model_4_ptm")), tmp_path / "ptm.pt")
        load_openfold_params(AlphaFold(cfg), tmp_path / "ptm.pt")
    with pytest.raises(ValueError, match=r"\.npz .* or an OpenFold \.pt"):
        load_params(model, tmp_path / "params.bin")
