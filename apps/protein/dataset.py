"""Training and evaluation samples: chains of apps/protein/data with their MSAs, cropped."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from apps.protein.data_sets import HELD_OUT, TRAIN, msa_path, structure_path
from apps.protein.features import FeatureConfig, crop_window, make_features
from apps.protein.io import Alignment, ProteinChain, read_msa, read_structure


def load_entries(entries) -> list[tuple[ProteinChain, Alignment | None]]:
    out = []
    for stem, chain, msa in entries:
        path = msa_path(msa)
        out.append((read_structure(structure_path(stem), chain), read_msa(path) if path else None))
    return out


class CropDataset(Dataset):
    """One crop of a chain per item (random, or its fixed first window when cfg.random_crop is
    False), with fresh MSA sampling and masking.

    Randomness comes from torch's global generator (one draw per item), which `phalanx.train.fit`
    checkpoints and restores, so a resumed run sees the same crops as an uninterrupted one."""

    def __init__(self, chains, cfg: FeatureConfig, samples_per_epoch: int = 0):
        if not chains:
            raise ValueError("no training chains")
        self.chains, self.cfg = chains, cfg
        self.length = samples_per_epoch or len(chains)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chain, alignment = self.chains[index % len(self.chains)]
        rng = np.random.default_rng(int(torch.randint(0, 2 ** 31 - 1, ()).item()))
        return make_features(chain, alignment, self.cfg, rng, crop_window(chain, self.cfg.crop_size, rng if self.cfg.random_crop else None))


def fixed_crops(chains, cfg: FeatureConfig, seed: int = 0) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Each chain's first window of the observed span, MSA sampled once, no masked-MSA corruption:
    the evaluation set ("training crops" for training chains)."""
    from dataclasses import replace

    clean = replace(cfg, masked_msa_fraction=0.0)
    out = []
    for chain, alignment in chains:
        rng = np.random.default_rng(seed)
        out.append((chain.name, make_features(chain, alignment, clean, rng, crop_window(chain, cfg.crop_size, None))))
    return out


def train_and_heldout(max_train_chains: int = 0, heldout: bool = True):
    return load_entries(TRAIN[:max_train_chains or None]), (load_entries(HELD_OUT) if heldout else [])
