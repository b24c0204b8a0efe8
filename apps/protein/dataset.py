"""Training and evaluation samples: chains of apps/protein/data with their MSAs, cropped."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from apps.protein.data_sets import DATA, HELD_OUT, TRAIN, msa_path, structure_path
from apps.protein.features import FeatureConfig, crop_window, make_features, search_directory
from apps.protein.io import Alignment, ProteinChain, read_msa, read_structure

REPO = DATA.parents[2]


def load_entries(entries) -> list[tuple[ProteinChain, Alignment | None]]:
    out = []
    for stem, chain, msa in entries:
        path = msa_path(msa)
        out.append((read_structure(structure_path(stem), chain), read_msa(path) if path else None))
    return out


def hits_cache_dir(cfg: FeatureConfig) -> Path | None:
    """data.template_hits_cache as a folder (relative: to the repository), or None."""
    if not cfg.template_hits_cache:
        return None
    path = Path(cfg.template_hits_cache)
    return path if path.is_absolute() else REPO / path


def searched_hits(chains, cfg: FeatureConfig) -> dict[str, tuple] | None:
    """With model.templates and data.templates_from: search, every chain's template hits by chain
    name (`apps.protein.templates.chain_template_hits`: searched once per chain, split over the
    ranks of a distributed run, or read from data.template_hits_cache); else None."""
    if not (cfg.use_templates and cfg.templates_from == "search"):
        return None
    from apps.protein.templates import chain_template_hits, preload_templates

    hits = chain_template_hits([chain for chain, _ in chains], search_directory(cfg), cfg.max_templates,
                               hits_cache_dir(cfg))
    preload_templates(hits)
    return hits


def item_templates(hits: dict[str, tuple] | None, chain: ProteinChain):
    """The templates make_features gets for a chain: those of its stored hits (None: make_features'
    own choice, templates_from self or none)."""
    if hits is None:
        return None
    from apps.protein.templates import load_templates

    return load_templates(hits[chain.name], chain.sequence)


class CropDataset(Dataset):
    """One crop of a chain per item (random, or its fixed first window when cfg.random_crop is
    False), with fresh MSA sampling and masking.

    With data.templates_from: search the template search runs here, once per chain, when the
    dataset is built; the dataset keeps the hits (`template_hits`: chain name -> hit chains and
    alignments, no coordinates) and each item only cuts template features from them.

    Randomness comes from torch's global generator (one draw per item), which `phalanx.train.fit`
    checkpoints and restores, so a resumed run sees the same crops as an uninterrupted one."""

    def __init__(self, chains, cfg: FeatureConfig, samples_per_epoch: int = 0):
        if not chains:
            raise ValueError("no training chains")
        self.chains, self.cfg = chains, cfg
        self.length = samples_per_epoch or len(chains)
        self.template_hits = searched_hits(chains, cfg)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chain, alignment = self.chains[index % len(self.chains)]
        rng = np.random.default_rng(int(torch.randint(0, 2 ** 31 - 1, ()).item()))
        return make_features(chain, alignment, self.cfg, rng,
                             crop_window(chain, self.cfg.crop_size, rng if self.cfg.random_crop else None),
                             templates=item_templates(self.template_hits, chain))


def fixed_crops(chains, cfg: FeatureConfig, seed: int = 0) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Each chain's first window of the observed span, MSA sampled once, no masked-MSA corruption:
    the evaluation set ("training crops" for training chains)."""
    from dataclasses import replace

    clean = replace(cfg, masked_msa_fraction=0.0)
    hits = searched_hits(chains, cfg)
    out = []
    for chain, alignment in chains:
        rng = np.random.default_rng(seed)
        out.append((chain.name, make_features(chain, alignment, clean, rng, crop_window(chain, cfg.crop_size, None),
                                              templates=item_templates(hits, chain))))
    return out


def train_and_heldout(max_train_chains: int = 0, heldout: bool = True):
    return load_entries(TRAIN[:max_train_chains or None]), (load_entries(HELD_OUT) if heldout else [])
