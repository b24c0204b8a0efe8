"""Template search over a local directory of mmCIF files (apps.protein.templates.search_templates,
`predict --template-dir DIR [--max-template-date]`, training's `data.templates_from: search`), on
the shipped structures (apps/protein/data/structures: 13 entries released 1995-2018)."""
from __future__ import annotations

import datetime
import shutil

import numpy as np
import pytest

from apps.protein.data_sets import STRUCTURES, structure_path
from apps.protein.io import ProteinInputError, read_entry, read_structure
from apps.protein.templates import (MAX_IDENTITY, entry_id, search_templates, template_entries, training_templates)

D = datetime.date


@pytest.fixture(scope="module")
def query():
    return read_structure(structure_path("4i6p"), "A")


def test_entry_dates_are_read_from_the_mmcif():
    """Release = the first revision date; deposition = recvd_initial_deposition_date (values from
    the files: 1psm deposited 1994-12-01, released 1995-02-07; 3zee 2012-12-05 / 2013-10-16)."""
    psm = read_entry(structure_path("1psm"))
    assert (psm.release_date, psm.deposition_date) == (D(1995, 2, 7), D(1994, 12, 1))
    zee = read_entry(structure_path("3zee"))
    assert (zee.release_date, zee.deposition_date) == (D(2013, 10, 16), D(2012, 12, 5))
    assert [c.name for c in zee.chains] == ["3zee_A"]
    assert [c.name for c in read_entry(structure_path("5zng")).chains] == ["5zng_A", "5zng_C"]


def test_search_keeps_alphafolds_hits_ranked_by_score(query):
    """4i6p A against every shipped chain: its own entry and 3zee A (the same protein, > 95%
    identical over > 95% of the query) are dropped as copies; what is kept aligns at least 10% of
    the query, is ranked by alignment score and lies on the query's residues."""
    hits = search_templates(query.sequence, STRUCTURES, 4)
    names = [h.name for h in hits]
    assert len(hits) == 4 and names[0] == "5zng_A"
    assert not {"4i6p", "3zee"} & {entry_id(n) for n in names}
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    for h in hits:
        assert h.coverage >= 0.10 and not (h.identity > MAX_IDENTITY and h.coverage > 0.95)
        q, t = np.array(h.template.pairs).T
        assert q.max() < len(query) and t.max() < len(h.template.chain)
        same = np.mean([query.sequence[i] == h.template.chain.sequence[j] for i, j in h.template.pairs])
        assert h.identity == pytest.approx(same) and h.coverage == pytest.approx(len(q) / len(query))
    # 3zee A is a copy of the query: > 95% identical over > 95% of it (so it was dropped, not missed)
    everything = search_templates(query.sequence, STRUCTURES, 100)
    assert "3zee_A" not in [h.name for h in everything]
    from apps.protein.templates import _align
    hit, _ = _align(query.sequence, read_structure(structure_path("3zee"), "A"))
    pairs = hit.pairs()
    zee = read_structure(structure_path("3zee"), "A").sequence
    assert len(pairs) / len(query) > 0.95 and np.mean([query.sequence[i] == zee[j] for i, j in pairs]) > 0.95


def test_a_date_cutoff_drops_later_structures(query):
    """A cutoff of 2013-01-01 drops 5zng A (released 2018) and 4i39 A (2013-03-20), the best two
    hits without it; every kept hit was released by then. The cutoff is inclusive (AlphaFold's
    max_template_date); before=True excludes that day too (training's rule)."""
    late = search_templates(query.sequence, STRUCTURES, 4, "2013-01-01")
    assert [h.name for h in late][:2] == ["2q2k_A", "2crb_A"]
    assert all(h.release_date <= D(2013, 1, 1) for h in late)
    assert not {"5zng_A", "4i39_A"} & {h.name for h in late}
    on_the_day = search_templates(query.sequence, STRUCTURES, 4, D(2008, 2, 5))      # 2q2k's release
    assert "2q2k_A" in [h.name for h in on_the_day]
    before = search_templates(query.sequence, STRUCTURES, 4, D(2008, 2, 5), before=True)
    assert "2q2k_A" not in [h.name for h in before] and before
    assert all(h.release_date < D(2008, 2, 5) for h in before)
    assert search_templates(query.sequence, STRUCTURES, 4, "1990-01-01") == []
    excluded = search_templates(query.sequence, STRUCTURES, 4, exclude=("5ZNG",))
    assert "5zng_A" not in [h.name for h in excluded]


def test_tiny_alignments_are_dropped(query):
    """The same query with 800 prolines appended: every hit now aligns under 10% of it."""
    assert search_templates(query.sequence + "P" * 800, STRUCTURES, 4) == []


def test_training_chains_never_see_themselves_or_later_structures():
    """data.templates_from: search -- each chain's hits were released before its own entry and are
    never of that entry (3zee A, released 2013-10-16, could use 4i6p A, 2013-07-17, by date, but
    that one is a copy of it and dropped)."""
    for stem, chain_id in (("3zee", "A"), ("5kc1", "B"), ("2q2k", "A"), ("5zng", "A")):
        chain = read_structure(structure_path(stem), chain_id)
        own = read_entry(structure_path(stem)).release_date
        templates = training_templates(chain, STRUCTURES, 4)
        dates = {entry_id(e.path.name.split(".")[0]): e.release_date for e in template_entries(STRUCTURES)}
        for t in templates:
            assert entry_id(t.name) != stem and dates[entry_id(t.name)] < own, (chain.name, t.name)
    # 1psm is the oldest shipped entry: nothing was released before it
    assert training_templates(read_structure(structure_path("1psm"), "A"), STRUCTURES, 4) == []


def test_training_features_with_searched_templates():
    """make_features with data.templates_from: search fills the slots with the searched hits (the
    crop of the query's residues)."""
    from apps.protein.features import FeatureConfig, crop_window, make_features

    chain = read_structure(structure_path("5zng"), "A")
    cfg = FeatureConfig(crop_size=32, max_msa_clusters=2, max_extra_msa=2, max_templates=3, templates_from="search",
                        use_templates=True)
    rng = np.random.default_rng(0)
    feats = make_features(chain, None, cfg, rng, crop_window(chain, 32, None))
    hits = training_templates(chain, STRUCTURES, 3)
    assert len(hits) == 3 and feats["template_mask"].tolist() == [1.0, 1.0, 1.0]
    assert feats["template_aatype"].shape == (3, 32)
    with pytest.raises(ValueError, match="templates_from"):
        FeatureConfig(templates_from="hhsearch")
    from apps.protein.config import load_recipe
    from phalanx.config import ConfigError
    with pytest.raises(ConfigError, match="data.template_dir.*no such directory"):
        load_recipe("apps/protein/configs/tiny.yaml", ["model.templates=true", "data.templates_from=search",
                                                       "data.template_dir=/no/such/mmcif"])
    cfg = load_recipe("apps/protein/configs/tiny.yaml", ["model.templates=true", "data.templates_from=search",
                                                         "data.template_dir=apps/protein/data/structures"])
    assert cfg.data.template_dir == str(STRUCTURES)


def test_bad_template_directories_and_dates(tmp_path, query):
    with pytest.raises(ProteinInputError, match="no such directory"):
        search_templates(query.sequence, tmp_path / "missing", 4)
    with pytest.raises(ProteinInputError, match="no .cif"):
        search_templates(query.sequence, tmp_path, 4)
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        search_templates(query.sequence, STRUCTURES, 4, "30/04/2018")
    # a copied directory is read again (another path): the same hits; an entry without protein
    # (here: one water molecule) is part of a PDB mirror and skipped, not an error
    for stem in ("5zng", "2q2k"):
        shutil.copy(structure_path(stem), tmp_path / f"{stem}.cif.gz")
    import biotite.structure as struc
    import biotite.structure.io.pdbx as pdbx
    water = struc.AtomArray(1)
    water.coord[:] = 0.0
    water.chain_id[:], water.res_id[:], water.res_name[:], water.atom_name[:] = "A", 1, "HOH", "O"
    water.element[:], water.hetero[:] = "O", True
    cif = pdbx.CIFFile()
    pdbx.set_structure(cif, water)
    cif.write(str(tmp_path / "9hoh.cif"))
    assert read_entry(tmp_path / "9hoh.cif").chains == []
    assert [h.name for h in search_templates(query.sequence, tmp_path, 4)] == ["5zng_A", "2q2k_A"]
