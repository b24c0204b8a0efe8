"""The chains the recipe ships (apps/protein/data, see its README), split into training and held-out.

Held-out chains are honest about what they are: 4i6p A is the same protein family as 3zee A (a
close homologue), 5kc1 F is another copy of a 5kc1 subunit; 5zng C shares no training chain.
"""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
STRUCTURES = DATA / "structures"
# (file stem, author chain, MSA file under data/msas or None for a single-sequence MSA)
TRAIN = [
    ("1psm", "A", None), ("2q2k", "A", "2q2k_A/uniref90_hits.sto"), ("3u8v", "A", None), ("3zee", "A", None),
    ("4zey", "A", None), ("5kc1", "B", None), ("5kc1", "D", None), ("5kc1", "L", None), ("1aki", "A", None),
    ("5zng", "A", None), ("1k6p", "A", None), ("2crb", "A", None),
]
HELD_OUT = [("4i6p", "A", None), ("5kc1", "F", None), ("5zng", "C", None)]


def structure_path(stem: str) -> Path:
    return STRUCTURES / f"{stem}.cif.gz"


def msa_path(name: str | None) -> Path | None:
    return None if name is None else DATA / "msas" / name


def load_chains(entries=TRAIN):
    from apps.protein.io import read_structure

    return [read_structure(structure_path(stem), chain) for stem, chain, _ in entries]


def training_chains():
    return load_chains(TRAIN)
