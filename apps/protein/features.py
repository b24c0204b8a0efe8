"""AlphaFold input features and ground truth for one chain, cropped and padded to a fixed size.

Inputs (AlphaFold 2 supplement, section 1.2): `target_feat` [L, 22] (break flag + aatype one-hot
with X), `residue_index`, `msa_feat` [S, L, 49] for the clustered MSA (residue one-hot with gap
and mask, has-deletion, deletion value, cluster profile, cluster deletion mean), `extra_msa_feat`
[E, L, 25] for the sequences not chosen as cluster centres, and their masks. Masked-MSA training
replaces 15% of the cluster centres' residues (`true_msa`, `bert_mask` are its targets).

With templates (`templates=` or `cfg.use_templates`, from model.templates) also the template
inputs of `apps.protein.templates.template_features`, [max_templates, L, ...].

Ground truth: atom14 and atom37 coordinates with masks, backbone frames, torsion angles.
Unobserved residues are masked everywhere; a crop is a contiguous window of the observed span.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from apps.protein import constants as rc
from apps.protein.io import Alignment, ProteinChain, check_msa_matches
from apps.protein.rigid import backbone_frame
from apps.protein.sidechains import atom37_to_atom14, pseudo_beta, true_torsions

MSA_LETTERS = {a: i for i, a in enumerate(rc.RESTYPES)} | {"X": rc.UNK, "-": rc.GAP}


@dataclass
class FeatureConfig:
    crop_size: int = 64               # residues per sample (padded when the chain is shorter)
    max_msa_clusters: int = 16        # S: cluster centres (the query is always the first)
    max_extra_msa: int = 32           # E: further sequences summarised by the extra-MSA stack
    masked_msa_fraction: float = 0.15  # share of centre residues replaced for the masked-MSA loss
    random_crop: bool = True          # training crops at random positions (False: always each chain's
                                      # first window, the fixed crop that evaluation scores)
    max_templates: int = 4            # T: template slots when the model has templates (AlphaFold: 4)
    templates_from: str = "self"      # training/eval templates with model.templates: "self" (each chain's own
                                      # structure: exercises the stack, and a model learns to copy it),
                                      # "search" (the best hits among template_dir's mmCIF files released
                                      # before the chain's own entry, as AlphaFold trains) or
                                      # "none" (every slot empty: AlphaFold without template hits)
    template_dir: str = ""            # mmCIF files searched by templates_from: search ("": the shipped structures)
    template_hits_cache: str = "runs/protein/template_hits"  # templates_from: search -- the hits of every chain
                                      # searched, in a JSON file per template folder and settings, so a
                                      # later run reads them instead of searching (relative: to the
                                      # repository; "": no file, search once per run)
    use_templates: bool = False       # template inputs in every sample: set from model.templates by the recipe

    def __post_init__(self):
        if self.templates_from not in ("self", "search", "none"):
            raise ValueError(f"data.templates_from={self.templates_from!r}: give 'self' (each chain's own structure), "
                             "'search' (hits from data.template_dir released before the chain) or 'none' (no "
                             "template hits)")


def search_directory(cfg: FeatureConfig):
    """The mmCIF folder `templates_from: search` searches."""
    from apps.protein.data_sets import STRUCTURES

    return cfg.template_dir or STRUCTURES


def msa_indices(alignment: Alignment) -> np.ndarray:
    """[N, L] MSA alphabet indices (rare letters -> X)."""
    return np.array([[MSA_LETTERS.get(ch, rc.UNK) for ch in row] for row in alignment.rows], np.int64)


def single_sequence_alignment(sequence: str) -> Alignment:
    return Alignment([sequence], np.zeros((1, len(sequence)), np.int32), "single sequence")


def observed_span(chain: ProteinChain) -> tuple[int, int]:
    """[start, end) of the residues between the first and last observed CA."""
    seen = np.nonzero(chain.atom37_mask[:, 1])[0]
    if len(seen) == 0:
        raise ValueError(f"{chain.name}: no residue has a CA atom; nothing to train on")
    return int(seen[0]), int(seen[-1]) + 1


def crop_window(chain: ProteinChain, crop_size: int, rng: np.random.Generator | None) -> tuple[int, int]:
    """A contiguous window of at most crop_size residues inside the observed span (random when
    rng is given, else the first window: the fixed crop that evaluation uses)."""
    start, end = observed_span(chain)
    if end - start <= crop_size:
        return start, end
    offset = int(rng.integers(0, end - start - crop_size + 1)) if rng is not None else 0
    return start + offset, start + offset + crop_size


def make_features(chain: ProteinChain, alignment: Alignment | None, cfg: FeatureConfig,
                  rng: np.random.Generator, window: tuple[int, int] | None = None,
                  with_truth: bool = True, templates=None) -> dict[str, torch.Tensor]:
    """Model inputs (+ ground truth) for one chain; every tensor padded to cfg.crop_size.
    templates: a list of `apps.protein.templates.Template` (possibly empty) adds the template
    inputs in cfg.max_templates slots; None: no template inputs."""
    if alignment is None:
        alignment = single_sequence_alignment(chain.sequence)
    check_msa_matches(alignment, chain.sequence, f"chain {chain.name}")
    start, end = window if window is not None else (0, len(chain))
    if end - start > cfg.crop_size:
        raise ValueError(f"{chain.name}: window of {end - start} residues is larger than crop_size={cfg.crop_size}")
    msa = msa_indices(alignment)[:, start:end]
    deletions = alignment.deletions[:, start:end].astype(np.float32)
    aatype = chain.aatype[start:end]
    length = end - start
    feats = _msa_features(msa, deletions, cfg, rng)
    feats["aatype"] = aatype
    feats["target_feat"] = np.concatenate([np.zeros((length, 1), np.float32),
                                           np.eye(21, dtype=np.float32)[aatype]], -1)
    feats["residue_index"] = chain.residue_index[start:end]
    feats["seq_mask"] = np.ones(length, np.float32)
    out = {k: torch.as_tensor(v) for k, v in feats.items()}
    if templates is None and cfg.use_templates:
        from apps.protein.templates import self_template, training_templates
        if cfg.templates_from == "search":
            # Datasets pass the hits they searched when built (apps.protein.dataset); a lone call
            # searches this chain here, once per process.
            templates = training_templates(chain, search_directory(cfg), cfg.max_templates)
        else:
            templates = [self_template(chain)] if cfg.templates_from == "self" else []
    if templates is not None:
        from apps.protein.templates import template_features
        out.update({k: v if k == "template_mask" else v[:, start:end]
                    for k, v in template_features(len(chain), templates, cfg.max_templates).items()})
    if with_truth:
        out.update(ground_truth(chain, start, end))
    return pad_features(out, cfg)


def _msa_features(msa: np.ndarray, deletions: np.ndarray, cfg: FeatureConfig, rng: np.random.Generator
                  ) -> dict[str, np.ndarray]:
    n, length = msa.shape
    order = np.concatenate([[0], rng.permutation(np.arange(1, n))]) if n > 1 else np.zeros(1, np.int64)
    centres = order[:cfg.max_msa_clusters]
    extra = order[cfg.max_msa_clusters:]
    c_msa, c_del = msa[centres], deletions[centres]
    # Assign every non-centre sequence to its nearest centre (Hamming distance on non-gap columns).
    onehot = np.eye(rc.MSA_CLASSES, dtype=np.float32)
    profile = onehot[c_msa].copy()
    del_sum = c_del.copy()
    counts = np.ones(len(centres), np.float32)
    if len(extra):
        e_hot = onehot[msa[extra]]
        weights = np.ones(rc.MSA_CLASSES, np.float32)
        weights[rc.GAP] = 0.0
        agreement = np.einsum("elc,slc->es", e_hot * weights, onehot[c_msa])
        nearest = agreement.argmax(1)
        np.add.at(profile, nearest, e_hot)
        np.add.at(del_sum, nearest, deletions[extra])
        np.add.at(counts, nearest, 1.0)
    profile /= counts[:, None, None]
    del_mean = del_sum / counts[:, None]
    # Masked MSA on the centres: 70% mask token, 10% random residue, 10% from the profile, 10% kept.
    true_msa = c_msa.copy()
    bert_mask = (rng.random(c_msa.shape) < cfg.masked_msa_fraction).astype(np.float32)
    choice = rng.random(c_msa.shape)
    uniform = rng.integers(0, 20, c_msa.shape)
    from_profile = np.array([[rng.choice(rc.MSA_CLASSES, p=p / p.sum()) for p in row] for row in profile]) \
        if bert_mask.any() else c_msa
    replaced = np.where(choice < 0.7, rc.MASK_TOKEN, np.where(choice < 0.8, uniform,
                                                              np.where(choice < 0.9, from_profile, c_msa)))
    c_msa_in = np.where(bert_mask > 0, replaced, c_msa)
    has_del = (c_del > 0).astype(np.float32)
    del_val = np.arctan(c_del / 3.0) * (2 / np.pi)
    msa_feat = np.concatenate([onehot[c_msa_in], has_del[..., None], del_val[..., None], profile,
                               (np.arctan(del_mean / 3.0) * (2 / np.pi))[..., None]], -1)
    e_msa, e_del = msa[extra[:cfg.max_extra_msa]], deletions[extra[:cfg.max_extra_msa]]
    extra_feat = np.concatenate([onehot[e_msa], (e_del > 0).astype(np.float32)[..., None],
                                 (np.arctan(e_del / 3.0) * (2 / np.pi))[..., None]], -1)
    return {"msa_feat": msa_feat.astype(np.float32), "msa_mask": np.ones(c_msa.shape, np.float32),
            "true_msa": true_msa, "bert_mask": bert_mask,
            "extra_msa_feat": extra_feat.reshape(-1, length, 25).astype(np.float32),
            "extra_msa_mask": np.ones((len(e_msa), length), np.float32)}


def ground_truth(chain: ProteinChain, start: int, end: int) -> dict[str, torch.Tensor]:
    aatype = torch.as_tensor(chain.aatype[start:end])
    atom37 = torch.as_tensor(chain.atom37[start:end])
    mask37 = torch.as_tensor(chain.atom37_mask[start:end])
    atom14, mask14 = atom37_to_atom14(atom37, mask37, aatype)
    frames = backbone_frame(atom14[:, 0], atom14[:, 1], atom14[:, 2])
    frame_mask = mask14[:, :3].prod(-1)
    sc, alt, tmask = true_torsions(atom14, mask14, aatype)
    swap = torch.as_tensor(rc.TABLES["ambiguous_swap"])[aatype]
    return {"all_atom_positions": atom37, "all_atom_mask": mask37, "atom14_gt_positions": atom14,
            "atom14_gt_exists": mask14, "atom14_alt_gt_positions": torch.gather(atom14, 1, swap[..., None].expand(-1, -1, 3)),
            "backbone_rot": frames.rot, "backbone_trans": frames.trans, "backbone_mask": frame_mask,
            "torsion_sin_cos": sc, "alt_torsion_sin_cos": alt, "torsion_mask": tmask,
            **dict(zip(("pseudo_beta", "pseudo_beta_mask"), pseudo_beta(atom14, aatype, mask14)))}


# Which axes of each feature are residues (padded to crop_size), MSA rows (padded to the config's depth).
_RES_AXIS = {"msa_feat": 1, "msa_mask": 1, "true_msa": 1, "bert_mask": 1, "extra_msa_feat": 1, "extra_msa_mask": 1,
             "template_aatype": 1, "template_all_atom_positions": 1, "template_all_atom_mask": 1,
             "template_pseudo_beta": 1, "template_pseudo_beta_mask": 1, "template_torsion_sin_cos": 1,
             "template_alt_torsion_sin_cos": 1, "template_torsion_mask": 1}
_NO_RES_AXIS = {"template_mask"}
_ROW_LIMIT = {"msa_feat": "max_msa_clusters", "msa_mask": "max_msa_clusters", "true_msa": "max_msa_clusters",
              "bert_mask": "max_msa_clusters", "extra_msa_feat": "max_extra_msa", "extra_msa_mask": "max_extra_msa"}


def pad_features(feats: dict[str, torch.Tensor], cfg: FeatureConfig) -> dict[str, torch.Tensor]:
    """Zero-pad residues to crop_size and MSA rows to their maximum, so samples stack."""
    out = {}
    for key, value in feats.items():
        if key in _NO_RES_AXIS:
            out[key] = value
            continue
        res_axis = _RES_AXIS.get(key, 0)
        pads = [(0, 0)] * value.dim()
        pads[res_axis] = (0, cfg.crop_size - value.shape[res_axis])
        if key in _ROW_LIMIT:
            rows = max(getattr(cfg, _ROW_LIMIT[key]), 1)
            pads[0] = (0, rows - value.shape[0])
        flat = [p for pair in reversed(pads) for p in pair]
        out[key] = torch.nn.functional.pad(value, flat)
    if "backbone_rot" in out:  # padded frames: identity rotations, so nothing divides by zero
        pad_rows = torch.arange(cfg.crop_size) >= feats["backbone_rot"].shape[0]
        out["backbone_rot"][pad_rows] = torch.eye(3)
    out["aatype"] = out["aatype"].long()
    return out
