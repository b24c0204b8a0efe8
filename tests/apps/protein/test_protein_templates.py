"""Templates (apps.protein.templates, model/template.py): features of real shipped chains, the
HHsearch hits reader and the alignment, the template stack's shapes and masking, and a tiny
config with templates that trains and predicts with a template (`--template`)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from apps.protein.data_sets import structure_path
from apps.protein.features import ground_truth
from apps.protein.io import ProteinInputError, read_structure
from apps.protein.model.dap import Axial
from apps.protein.model.template import TEMPLATE_DISTOGRAM, template_pair_features
from apps.protein.rigid import backbone_frame
from apps.protein.templates import (Template, TemplateHit, align_to_chain, read_hhr, self_template, template_features,
                                    template_from_hit)
from phalanx.testing import rounding_rtol
from protein_tiny import real_batch, tiny_model


@pytest.fixture(scope="module")
def chain():
    return read_structure(structure_path("3zee"), "A")


def _pair(feats: dict, unit_vector: bool = True, **replace) -> torch.Tensor:
    f = feats | replace
    return template_pair_features(f["template_aatype"], f["template_all_atom_positions"], f["template_all_atom_mask"],
                                  f["template_pseudo_beta"], f["template_pseudo_beta_mask"], unit_vector)


def _random_rotation(seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (q * torch.sign(torch.det(q))).float()


def test_self_template_features_of_a_real_chain(chain):
    """3zee A as its own template: residue types, atoms, pseudo-beta and torsions are the chain's;
    the distogram puts each pseudo-beta distance between its bin's edges (3.25 .. 50.75 A, 39 bins,
    nothing below 3.25); the one-hots are of j then i; masks and the layout of the 88 channels."""
    n = len(chain)
    feats = template_features(n, [self_template(chain)], max_templates=2)
    assert feats["template_mask"].tolist() == [1.0, 0.0]
    assert feats["template_aatype"][0].tolist() == chain.aatype.tolist()
    assert (feats["template_aatype"][1] == 21).all() and feats["template_all_atom_mask"][1].sum() == 0
    truth = ground_truth(chain, 0, n)
    assert torch.equal(feats["template_pseudo_beta"][0], truth["pseudo_beta"])
    assert torch.equal(feats["template_torsion_sin_cos"][0], truth["torsion_sin_cos"])
    assert torch.equal(feats["template_torsion_mask"][0], truth["torsion_mask"])

    pair = _pair({k: v[0] for k, v in feats.items()})
    assert pair.shape == (n, n, 88)
    dgram, pb_2d, aa_j, aa_i, unit, bb_2d = pair.split([39, 1, 22, 22, 3, 1], -1)
    low, high, bins = TEMPLATE_DISTOGRAM
    edges = np.linspace(low, high, bins)
    x = truth["pseudo_beta"].double().numpy()
    d = np.linalg.norm(x[:, None] - x[None], axis=-1)
    seen = (truth["pseudo_beta_mask"][:, None] * truth["pseudo_beta_mask"][None]).bool().numpy()
    bb = truth["backbone_mask"]
    both = (bb[:, None] * bb[None]).bool().numpy() & seen
    assert both.sum() > 0.9 * n * n
    index = dgram.argmax(-1).numpy()
    hot = dgram.sum(-1).numpy()
    assert np.all(hot[both & (d < low)] == 0)                       # the diagonal: no bin at all
    far = both & (d >= low)
    assert np.all(hot[far] == 1)
    assert np.all(edges[index[far]] < d[far])
    upper = np.append(edges[1:], np.inf)[index[far]]
    assert np.all(d[far] <= upper)
    assert (index[far] == 0).any() and len(np.unique(index[far])) > 25     # 3.25 .. ~40 A: most of the bins
    i, j = 5, 40
    assert aa_j[i, j].argmax() == chain.aatype[j] and aa_i[i, j].argmax() == chain.aatype[i]
    assert torch.equal(bb_2d[..., 0], (bb[:, None] * bb[None]).float())
    assert torch.equal(pb_2d[..., 0], (truth["pseudo_beta_mask"][:, None] * truth["pseudo_beta_mask"][None]).float())
    assert (pair[~torch.as_tensor(both)] == 0).all()                      # masked pairs: nothing at all
    # AlphaFold's released models zero the unit vectors (use_template_unit_vector: False)
    assert (_pair({k: v[0] for k, v in feats.items()}, unit_vector=False)[..., 84:87] == 0).all()


def test_unit_vectors_are_in_the_backbone_frame(chain):
    """The unit vector of (i, j) is CA_j's direction in residue i's backbone frame: unit length,
    rotated back by i's frame it is the global direction CA_i -> CA_j, and a global rotation and
    translation of the template leaves it (and every pair feature) unchanged."""
    n = len(chain)
    feats = {k: v[0] for k, v in template_features(n, [self_template(chain)], 1).items()}
    pair = _pair(feats)
    unit = pair[..., 84:87].double()
    bb = feats["template_all_atom_mask"][:, :3].prod(-1).bool()
    ok = bb[:, None] & bb[None] & ~torch.eye(n, dtype=torch.bool)
    assert torch.allclose(unit[ok].norm(dim=-1), torch.ones(()).double(), atol=1e-5)
    pos = feats["template_all_atom_positions"].double()
    frames = backbone_frame(pos[:, 0], pos[:, 1], pos[:, 2])
    back = torch.einsum("iab,ijb->ija", frames.rot, unit)
    ca = pos[:, 1]
    direction = ca[None] - ca[:, None]
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-9)
    assert torch.allclose(back[ok], direction[ok], atol=1e-5)

    rot = _random_rotation(7)
    moved = feats["template_all_atom_positions"] @ rot.T + torch.tensor([30.0, -12.0, 5.0])
    moved = moved * feats["template_all_atom_mask"][..., None]
    moved_pb = feats["template_pseudo_beta"] @ rot.T + torch.tensor([30.0, -12.0, 5.0])
    moved_pair = _pair(feats, template_all_atom_positions=moved, template_pseudo_beta=moved_pb)
    assert (moved_pair[..., 84:87] - pair[..., 84:87]).abs().max() < 1e-4
    # the distogram too (a distance within rounding of a bin edge may change bin: at most a pair or two)
    assert (moved_pair[..., :39] != pair[..., :39]).any(-1).sum() <= 2
    assert torch.equal(moved_pair[..., 39:84], pair[..., 39:84]) and torch.equal(moved_pair[..., 87], pair[..., 87])


def _hhr(hits: list[TemplateHit], query_name: str = "query") -> str:
    """A minimal HHsearch .hhr text: header, then one block per hit, alignments 40 columns a line."""
    lines = [f"Query         {query_name}", "Match_columns 88", "", " No Hit   Prob", ""]
    for k, hit in enumerate(hits, 1):
        lines += [f"No {k}", f">{hit.name} some protein", "Probab=99.9  E-value=1e-30", ""]
        q, t = hit.query_start, hit.template_start
        for s in range(0, len(hit.query_aligned), 40):
            qa, ta = hit.query_aligned[s:s + 40], hit.template_aligned[s:s + 40]
            qn, tn = sum(a != "-" for a in qa), sum(a != "-" for a in ta)
            lines += [f"Q ss_pred             {'C' * len(qa)}",
                      f"Q {query_name:<15} {q:>4} {qa} {q + qn - 1:>4} (88)",
                      f"Q Consensus       {q:>4} {qa.lower()} {q + qn - 1:>4} (88)",
                      " " * 22 + "|" * len(qa),
                      f"T Consensus       {t:>4} {ta.lower()} {t + tn - 1:>4} (84)",
                      f"T {hit.name:<15} {t:>4} {ta} {t + tn - 1:>4} (84)",
                      f"T ss_dssp             {'C' * len(ta)}", ""]
            q, t = q + qn, t + tn
    return "\n".join(lines) + "\n"


def test_hhr_hits_and_the_biotite_alignment(chain, tmp_path):
    """4i6p A (a held-out homologue of 3zee A with 3 more residues, GPG, at its N-terminus) aligned to 3zee
    A by biotite pairs residue q + 3 with 3zee's q; the same alignment written as an .hhr (with a
    gap) reads back to the same pairs; letters that do not match the mmCIF's sequence are refused."""
    query = read_structure(structure_path("4i6p"), "A")
    hit = align_to_chain(query.sequence, chain)
    pairs = hit.pairs()
    assert len(pairs) >= 80 and sum(q == t + 3 for q, t in pairs) == 84
    path = tmp_path / "hits.hhr"
    other = TemplateHit("1aki_A", 3, "KVFG-RC", 1, "KVFGRRC")      # a query gap: template residue 5 unpaired
    path.write_text(_hhr([hit, other]))
    read = read_hhr(path)
    assert [h.name for h in read] == ["3zee_A", "1aki_A"]
    assert read[0].pairs() == pairs
    assert read[1].pairs() == [(2, 0), (3, 1), (4, 2), (5, 3), (6, 5), (7, 6)]
    template = template_from_hit(read[0], query.sequence, chain)
    feats = template_features(len(query), [template], 1)
    assert feats["template_aatype"][0, 3:87].tolist() == chain.aatype.tolist()
    assert (feats["template_aatype"][0, :3] == 21).all() and feats["template_aatype"][0, 87] == 21
    letter = "W" if hit.template_aligned[10] != "W" else "A"
    wrong = TemplateHit("3zee_A", hit.query_start, hit.query_aligned, hit.template_start,
                        hit.template_aligned[:10] + letter + hit.template_aligned[11:])
    with pytest.raises(ProteinInputError, match="template residue .* in the alignment but"):
        template_from_hit(wrong, query.sequence, chain)
    (tmp_path / "bad.hhr").write_text("Query x\nnothing here\n")
    with pytest.raises(ProteinInputError, match="no hit"):
        read_hhr(tmp_path / "bad.hhr")


# ----------------------------------------------------------------------------------- the model
def _template_model(seed=0):
    from apps.protein.model.template import TemplateConfig

    return tiny_model(seed, templates=True, template=TemplateConfig(c_t=8, blocks=2, heads=2, c_hidden_mul=8))


def test_template_stack_shapes(chain):
    model = _template_model().eval()
    batch = real_batch(crop=12, clusters=3, extra=4, batch=2, templates=3)
    emb = model.template_embedder
    assert batch["template_aatype"].shape == (2, 3, 12)
    with torch.no_grad():
        pair_mask = batch["seq_mask"][:, :, None] * batch["seq_mask"][:, None]
        z = torch.randn(2, 12, 12, model.cfg.c_z)
        update = emb(z, {k: v for k, v in batch.items() if k.startswith("template_")}, pair_mask)
        rows, row_mask = model.template_angle_embedder(batch, torch.float32)
        out = model(**batch, recycles=0)
    assert update.shape == z.shape and rows.shape == (2, 3, 12, model.cfg.c_m) and row_mask.shape == (2, 3, 12)
    assert row_mask[:, 1:].sum() == 0 and row_mask[:, 0].sum() > 0
    assert out["masked_msa_logits"].shape == (2, 3, 12, 23)          # the template rows are not masked-MSA rows
    assert len(emb.pair_stack.blocks) == 2
    # algorithm 16's order: triangle attention (starting, ending node) before the multiplications
    block = emb.pair_stack.blocks[0]
    t = torch.randn(2, 12, 12, 8)
    with torch.no_grad():
        want = t
        for op in (block.tri_att_start, block.tri_att_end, block.tri_mul_out, block.tri_mul_in):
            want = want + op(want, pair_mask, Axial())
        want = want + block.pair_transition(want)
        assert torch.allclose(block(t, pair_mask), want, atol=1e-6)


def _compare(got, want, what):
    n = 2 * 12 * 12 * 3
    for key in ("pair", "atom37", "masked_msa_logits", "plddt"):
        err = ((got[key] - want[key]).abs().max() / want[key].abs().max()).item()
        assert err <= rounding_rtol(torch.float32, n), f"{what}: {key} differs by {err:.2e}"


def test_a_masked_template_changes_nothing():
    """A template whose template_mask is 0 gives exactly the prediction without template inputs
    (pointwise attention masked and multiplied by 'any template present', its MSA row masked); a
    real template next to masked slots full of another chain's atoms gives the prediction of the
    real one alone; a real template changes the prediction. On the run's device (the emulated GPU
    under tests/emulated)."""
    from phalanx.device import current_device, to_device

    device = current_device()
    model = _template_model().to(device).eval()
    batch = to_device(real_batch(crop=12, clusters=3, extra=4, batch=2, templates=1), device)
    plain = {k: v for k, v in batch.items() if not k.startswith("template_")}
    with torch.no_grad():
        without = model(**plain, recycles=1)
        with_template = model(**batch, recycles=1)
        masked = model(**(batch | {"template_mask": torch.zeros_like(batch["template_mask"])}), recycles=1)
        # slot 2: a real template's atoms (3zee A, shifted) but masked out
        two = {k: torch.cat([v, v.flip(-1 if k == "template_mask" else 2)], 1) if k.startswith("template_") else v
               for k, v in batch.items()}
        two["template_mask"][:, 1] = 0
        with_masked_second = model(**two, recycles=1)
    assert with_template["pair"].device.type == device.type
    assert (with_template["pair"] - without["pair"]).abs().max() > 1e-2
    _compare(masked, without, "all templates masked")
    _compare(with_masked_second, with_template, "a masked second template")


def test_template_inputs_need_the_template_stack():
    model = tiny_model()
    batch = real_batch(crop=8, clusters=2, extra=2, batch=1, templates=1)
    with pytest.raises(ValueError, match="model.templates=true"):
        model(**batch, recycles=0)
    with pytest.raises(ValueError, match="missing"):
        _template_model()(**{k: v for k, v in batch.items() if k != "template_torsion_mask"}, recycles=0)


# ------------------------------------------------------------------- train a few steps, predict
@pytest.mark.slow
def test_tiny_config_with_templates_trains_and_predicts(tmp_path, capsys):
    """tiny.yaml with model.templates=true trains 3 steps through fit, its templates searched among
    the shipped structures released before each chain (data.templates_from=search: 1psm A, the
    oldest, gets none; 2q2k A gets hits); `predict --template` then predicts held-out 4i6p A with
    3zee A as its template, and `predict --template-dir --max-template-date 2013-01-01` with the
    hits of the search released by then."""
    from phalanx.testing import spawn
    from protein_tiny import train_templates_rank

    (losses, last_eval), = spawn(train_templates_rank, 1, str(tmp_path / "run"), "search", timeout=600)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "lddt_ca" in json.dumps(last_eval)
    from apps.protein.predict import main as predict_main
    from protein_tiny import TEMPLATE_OVERRIDES

    query = read_structure(structure_path("4i6p"), "A")
    (tmp_path / "q.fasta").write_text(f">4i6p_A\n{query.sequence}\n")
    predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(tmp_path / "run"),
                  "--fasta", str(tmp_path / "q.fasta"), "--out", str(tmp_path / "pred"),
                  "--template", "apps/protein/data/structures/3zee.cif.gz:A",
                  "--reference", "apps/protein/data/structures/4i6p.cif.gz", "--chain", "A", *TEMPLATE_OVERRIDES])
    out = capsys.readouterr().out
    assert "template 3zee_A: 84 of 88 query residues aligned" in out
    summary = json.loads((tmp_path / "pred" / "4i6p_A.json").read_text())
    assert summary["length"] == 88 and "lddt_ca" in json.dumps(summary["metrics"])
    assert (tmp_path / "pred" / "4i6p_A.cif").is_file()
    predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(tmp_path / "run"),
                  "--fasta", str(tmp_path / "q.fasta"), "--out", str(tmp_path / "searched"),
                  "--template-dir", "apps/protein/data/structures", "--max-template-date", "2013-01-01",
                  *TEMPLATE_OVERRIDES])
    out = capsys.readouterr().out
    hits = [line.split()[2].rstrip(":") for line in out.splitlines() if line.startswith("template hit ")]
    assert hits == ["2q2k_A", "2crb_A"], out                      # data.max_templates=2; 5zng A, 4i39 A are later
    assert "released 2008-02-05" in out and (tmp_path / "searched" / "4i6p_A.pdb").is_file()
    with pytest.raises(ValueError, match="--max-template-date"):
        predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(tmp_path / "run"),
                      "--fasta", str(tmp_path / "q.fasta"), "--max-template-date", "2013-01-01", *TEMPLATE_OVERRIDES])
    with pytest.raises(ValueError, match="model.templates=true"):
        predict_main(["--config", "apps/protein/configs/tiny.yaml", "--checkpoint", str(tmp_path / "run"),
                      "--fasta", str(tmp_path / "q.fasta"), "--template", "apps/protein/data/structures/3zee.cif.gz:A"])


def test_config_checks_for_templates():
    from apps.protein.config import load_recipe
    from phalanx.config import ConfigError

    cfg = load_recipe("apps/protein/configs/tiny.yaml", [])
    assert cfg.model.templates is False and cfg.data.use_templates is False
    cfg = load_recipe("apps/protein/configs/tiny.yaml", ["model.templates=true"])
    assert cfg.data.use_templates is True
    with pytest.raises(ConfigError, match="data.max_templates"):
        load_recipe("apps/protein/configs/tiny.yaml", ["model.templates=true", "data.max_templates=0"])
    with pytest.raises(ConfigError, match="max_msa_clusters \\+ data.max_templates.*multiple of dap_size=4"):
        load_recipe("apps/protein/configs/tiny.yaml", ["model.templates=true", "dap_size=4", "data.crop_size=32",
                                                       "data.max_templates=3"])


def test_templates_from_a_list_of_templates_are_laid_out_on_the_query(chain):
    """Two templates: each fills its own slot; query residues with no aligned template residue are
    gaps (21) without atoms."""
    half = Template(chain, [(i, i) for i in range(0, len(chain), 2)])
    feats = template_features(len(chain), [self_template(chain), half], 3)
    assert feats["template_mask"].tolist() == [1.0, 1.0, 0.0]
    assert (feats["template_aatype"][1, 1::2] == 21).all()
    assert feats["template_all_atom_mask"][1, 1::2].sum() == 0
    assert torch.equal(feats["template_all_atom_positions"][1, ::2], feats["template_all_atom_positions"][0, ::2])
