"""Training's template search (`data.templates_from: search`) runs once per chain when the dataset is
built, not per item: the dataset keeps each chain's hits (template chain and alignment, by chain
name), items only cut features from them, data-loader workers and later epochs search nothing,
ranks split the search and end with the same hits, and a cache file spares the next run the search."""
from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.protein import templates as tpl
from apps.protein.data_sets import HELD_OUT, STRUCTURES, TRAIN, structure_path
from apps.protein.dataset import CropDataset, fixed_crops, item_templates, load_entries
from apps.protein.features import FeatureConfig, crop_window, make_features
from apps.protein.io import read_entry

# test_training_with_searched_templates_keeps_its_loss_curve's 2 losses, measured with the per-item search
# (apps/protein/{templates,features,dataset}.py as in commit 2012452, before this change), fp32, one thread.
# The template stack's output layers start at zero, so step 1 does not see the templates; step 2 does
# (the same run without templates: 3.1097496, with only the first hit: 3.1093297).
LOSSES_BEFORE = [2.9313387870788574, 3.109118700027466]
SEARCH = tpl.search_templates          # the folder search itself, not counted


def search_cfg(cache: Path | str = "", max_templates: int = 4) -> FeatureConfig:
    return FeatureConfig(crop_size=16, max_msa_clusters=2, max_extra_msa=2, max_templates=max_templates,
                         templates_from="search", use_templates=True, template_hits_cache=str(cache))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty in-process record of searched chains, and every folder search counted: one line per
    call in a file, so calls made in data-loader worker processes count too."""
    monkeypatch.setattr(tpl, "_SEARCHED", {})
    calls = tmp_path / "search_calls"
    original = tpl.search_templates

    def counted(query, *args, **kwargs):
        with open(calls, "a") as f:
            f.write(query + "\n")
        return original(query, *args, **kwargs)

    monkeypatch.setattr(tpl, "search_templates", counted)
    return lambda: calls.read_text().split() if calls.exists() else []


def old_per_item_search(chain, max_templates: int):
    """What the item builder searched per item before: the shipped folder, entries released before the
    chain's own entry, never that entry (the rules written out here, not through the new code)."""
    stem = chain.name.rsplit("_", 1)[0]
    own_date = read_entry(structure_path(stem)).release_date
    assert isinstance(own_date, datetime.date)
    return SEARCH(chain.sequence, STRUCTURES, max_templates, own_date, before=True, exclude=(stem,))


def test_hits_equal_the_per_item_search_for_every_shipped_chain(fresh, tmp_path):
    """All 15 shipped chains (12 training, 3 held-out): the dataset's hits name the same template
    chains in the same order with the same alignments as the old per-item search, and the template
    features cut from them are the same to the bit. Mutant caught: hits kept by position instead of
    chain name (any two chains' hits swapped)."""
    chains = load_entries(TRAIN + HELD_OUT)
    cfg = search_cfg(tmp_path / "cache")
    data = CropDataset(chains, cfg)
    assert len(fresh()) == len(chains) == 15                   # one search per chain when built
    assert list(data.template_hits) == [c.name for c, _ in chains]
    found = 0
    for chain, alignment in chains:
        want = old_per_item_search(chain, 4)
        got = data.template_hits[chain.name]
        assert [h.name for h in got] == [h.name for h in want], chain.name
        assert [h.hit.pairs() for h in got] == [h.template.pairs for h in want], chain.name
        assert [h.score for h in got] == [h.score for h in want], chain.name
        found += len(got)
        window = crop_window(chain, cfg.crop_size, None)
        new = make_features(chain, alignment, cfg, np.random.default_rng(0), window,
                            templates=item_templates(data.template_hits, chain))
        old = make_features(chain, alignment, cfg, np.random.default_rng(0), window,
                            templates=[h.template for h in want])
        assert set(new) == set(old)
        for key in new:
            assert torch.equal(new[key], old[key]), (chain.name, key)
    assert data.template_hits["1psm_A"] == ()                   # the oldest entry: nothing before it
    assert found >= 20 and len({h.name for hs in data.template_hits.values() for h in hs}) >= 5
    # the evaluation crops use the same hits, without searching again
    (name, feats), = fixed_crops(chains[3:4], cfg)
    assert name == "3zee_A" and feats["template_mask"].sum() == len(data.template_hits["3zee_A"]) > 0
    assert len(fresh()) == 15


def test_one_search_per_chain_over_two_epochs_and_two_workers(fresh, tmp_path, monkeypatch):
    """4 chains, 8 items an epoch, 2 epochs through a DataLoader with 2 worker processes: 4 searches,
    all when the dataset is built. A second dataset in a fresh process state reads the cache file
    (no search); other search settings (max_templates) search again. The workers read no mmCIF
    file either (the hit chains were read in the dataset's process). Mutants caught: the items
    searching (each worker searches the chains it meets: 20 calls), `preload_templates` doing
    nothing (each worker reads the hit files)."""
    from torch.utils.data import DataLoader

    from phalanx.train.data import default_collate

    chains = load_entries(TRAIN[:4])
    cfg = search_cfg(tmp_path / "cache", max_templates=2)
    data = CropDataset(chains, cfg, samples_per_epoch=8)
    assert sorted(fresh()) == sorted(c.sequence for c, _ in chains)
    reads = tmp_path / "reads"
    original_read = tpl.read_structure

    def counted_read(path, *args):
        with open(reads, "a") as f:
            f.write(f"{path}\n")
        return original_read(path, *args)

    monkeypatch.setattr(tpl, "read_structure", counted_read)
    loader = DataLoader(data, batch_size=2, shuffle=True, num_workers=2, collate_fn=default_collate,
                        multiprocessing_context="fork")
    masks = [batch["template_mask"] for _ in range(2) for batch in loader]
    assert len(masks) == 8 and sum(float(m.sum()) for m in masks) > 0
    assert len(fresh()) == 4
    assert not reads.exists()              # the hit chains were read when the dataset was built, not per worker

    monkeypatch.setattr(tpl, "_SEARCHED", {})                 # a new run: only the cache file is left
    monkeypatch.setattr(tpl, "_TEMPLATE_CHAINS", type(tpl._TEMPLATE_CHAINS)())
    monkeypatch.setattr(tpl, "read_structure", original_read)
    again = CropDataset(chains, cfg)
    assert len(fresh()) == 4 and again.template_hits == data.template_hits
    monkeypatch.setattr(tpl, "read_structure", counted_read)
    assert sum(float(b["template_mask"].sum()) for b in DataLoader(
        again, batch_size=2, num_workers=2, collate_fn=default_collate, multiprocessing_context="fork")) > 0
    assert not reads.exists()
    assert len(list((tmp_path / "cache").glob("template_hits-*.json"))) == 1
    other = CropDataset(chains, search_cfg(tmp_path / "cache", max_templates=1))
    assert len(fresh()) == 8 and all(len(h) <= 1 for h in other.template_hits.values())
    assert len(list((tmp_path / "cache").glob("template_hits-*.json"))) == 2


def test_cache_file_follows_sequences_and_folder_contents(fresh, tmp_path):
    """The cache is keyed by the chain's sequence and the folder's files: a chain whose sequence
    changed is searched again, and so is everything after a file of the folder changed; a corrupt
    cache file is searched over (a warning) and rewritten."""
    import shutil

    folder = tmp_path / "mmcif"
    folder.mkdir()
    for stem in ("2q2k", "2crb", "3zee", "4i6p", "5zng"):
        shutil.copy(structure_path(stem), folder / f"{stem}.cif.gz")
    (chain, _), = load_entries([("5zng", "A", None)])
    cache = tmp_path / "cache"
    first = tpl.chain_template_hits([chain], folder, 2, cache)
    assert len(fresh()) == 1 and first[chain.name]
    tpl._SEARCHED.clear()
    assert tpl.chain_template_hits([chain], folder, 2, cache) == first and len(fresh()) == 1
    tpl._SEARCHED.clear()
    from dataclasses import replace
    shorter = replace(chain, sequence=chain.sequence[:-1])
    tpl.chain_template_hits([shorter], folder, 2, cache)
    assert len(fresh()) == 2
    tpl._SEARCHED.clear()
    (folder / "4i6p.cif.gz").unlink()                            # the folder changed: a new key
    tpl.chain_template_hits([chain], folder, 2, cache)
    assert len(fresh()) == 3
    tpl._SEARCHED.clear()
    for file in cache.glob("template_hits-*.json"):
        file.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert tpl.chain_template_hits([chain], folder, 2, cache)[chain.name]
    assert len(fresh()) == 4
    tpl._SEARCHED.clear()
    tpl.chain_template_hits([chain], folder, 2, cache)          # rewritten: read back
    assert len(fresh()) == 4
    with pytest.raises(tpl.ProteinInputError, match="two chains named 5zng_A"):
        tpl.chain_template_hits([chain, shorter], folder, 2, cache)


def searched_on_rank(cache: str, calls: str) -> dict:
    """Rank body: the dataset of 6 training chains built on every rank (the search split over the
    ranks and gathered), then again with this process's record cleared (rank 0's cache file,
    broadcast). Returns the hits by chain name and how many searches this rank ran."""
    import torch.distributed as dist

    original = tpl.search_templates

    def counted(query, *args, **kwargs):
        with open(f"{calls}.{dist.get_rank()}", "a") as f:
            f.write(query + "\n")
        return original(query, *args, **kwargs)

    tpl.search_templates = counted
    chains = load_entries(TRAIN[:6])
    first = CropDataset(chains, search_cfg(cache)).template_hits
    tpl._SEARCHED.clear()
    second = CropDataset(chains, search_cfg(cache)).template_hits
    path = Path(f"{calls}.{dist.get_rank()}")
    return {"first": {n: [h.to_json() for h in hs] for n, hs in first.items()},
            "second": {n: [h.to_json() for h in hs] for n, hs in second.items()},
            "searched": path.read_text().split() if path.exists() else []}


def test_ranks_split_the_search_and_end_with_the_same_hits(fresh, tmp_path):
    """2 gloo ranks: 3 chains searched on each (6 in all, none twice), both ranks hold the hits of
    one process's search for every chain; built again, both read rank 0's cache file. Mutant
    caught: the gathered hits matched to chains by position (rank 0's chains first: swapped)."""
    from phalanx.testing import spawn

    ranks = spawn(searched_on_rank, 2, str(tmp_path / "cache"), str(tmp_path / "calls"), timeout=300)
    chains = load_entries(TRAIN[:6])
    want = {n: [h.to_json() for h in hs] for n, hs in CropDataset(chains, search_cfg()).template_hits.items()}
    assert len(want) == 6 and sum(map(len, want.values())) > 6
    for rank in ranks:
        assert rank["first"] == want and rank["second"] == want
        assert len(rank["searched"]) == 3
    assert sorted(ranks[0]["searched"] + ranks[1]["searched"]) == sorted(c.sequence for c, _ in chains)


def train_with_searched_templates_rank(output_dir: str, cache: str) -> list[float]:
    """Rank body: tiny.yaml with small templates (protein_tiny.TEMPLATE_OVERRIDES), templates searched
    among the shipped structures, 4 chains, 2 steps of 2 crops."""
    from protein_tiny import TEMPLATE_OVERRIDES

    from apps.protein.config import load_recipe
    from apps.protein.train import train

    cfg = load_recipe("apps/protein/configs/tiny.yaml", [
        *TEMPLATE_OVERRIDES, "data.templates_from=search", f"data.template_hits_cache={cache}", "max_train_chains=4",
        "eval_heldout=false", "train.micro_batch_size=2", "train.max_steps=2", "train.warmup_steps=0",
        "train.eval_every=0", "train.save_every=0", "train.log_every=1", "train.progress_bar=false", "train.plot=false",
        f"train.output_dir={output_dir}"])
    result, _ = train(cfg)
    return result.losses


def test_training_with_searched_templates_keeps_its_loss_curve(tmp_path):
    """2 steps of the tiny config with searched templates (no warm-up, so step 1 moves the template
    stack's zero-initialised output layers enough for step 2 to see the templates) give the losses
    the per-item search gave (LOSSES_BEFORE), within fp32 rounding of the step's 2 x 16 residues
    (5.4e-6); the run writes the cache file. Mutants caught: each chain's second hit dropped (step 2
    6.8e-5 off), the hits never reaching the items (2.0e-4 off)."""
    from phalanx.testing import check, rel_diff, rounding_rtol, spawn

    (losses,) = spawn(train_with_searched_templates_rank, 1, str(tmp_path / "run"), str(tmp_path / "cache"),
                      timeout=600)
    check(rel_diff(losses, LOSSES_BEFORE), rounding_rtol(torch.float32, 32), "losses against the per-item search's")
    assert len(list((tmp_path / "cache").glob("template_hits-*.json"))) == 1
