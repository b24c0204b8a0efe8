"""The protein recipe's config: one dataclass per section, filled from YAML + `key=value`.

    python -m apps.protein.train --config apps/protein/configs/tiny.yaml train.max_steps=50

Relative paths are resolved against the repository root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.config import ConfigError, load_config, parse_config_args, resolve_path
from phalanx.train import TrainConfig

from apps.protein.features import FeatureConfig
from apps.protein.losses import LossWeights
from apps.protein.model import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def resolve(path: str | Path) -> Path:
    return resolve_path(path, REPO)


@dataclass
class EMAConfig:
    enabled: bool = True
    decay: float = 0.999              # AlphaFold: 0.999
    warmup: bool = True               # decay ramps as (1+n)/(10+n), so early averages follow the weights


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: FeatureConfig = field(default_factory=FeatureConfig)
    loss: LossWeights = field(default_factory=LossWeights)
    ema: EMAConfig = field(default_factory=EMAConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    samples_per_epoch: int = 0        # repeat the training chains to this many samples per epoch (0: once)
    threads: int = 0                  # torch threads per rank (0: phalanx.launch's share of the cores)
    dap_size: int = 1                 # Dynamic Axial Parallelism: ranks that split one sample's activations
    eval_recycles: int = 1            # recycling passes when evaluating
    max_train_chains: int = 0         # use only the first N training chains (0: all 12; tests use fewer)
    eval_heldout: bool = True         # also score the held-out chains at every eval
    init_from: str = ""               # start from these weights (fine-tuning, AlphaFold's second stage): a
                                      # training output_dir or checkpoints/step-* directory (its trained
                                      # weights, not the EMA average), or AlphaFold .npz / OpenFold .pt
                                      # parameters; ignored when output_dir already holds a checkpoint (resume)

    def validate(self) -> None:
        def need(ok: bool, key: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"config '{key}'={value!r}: {why}")

        m, d = self.model, self.data
        need(d.crop_size >= 8, "data.crop_size", d.crop_size, "must be at least 8 residues")
        need(d.max_msa_clusters >= 1, "data.max_msa_clusters", d.max_msa_clusters, "must be at least 1 (the query)")
        need(0.0 <= d.masked_msa_fraction < 1.0, "data.masked_msa_fraction", d.masked_msa_fraction, "must be in [0, 1)")
        need(m.crop_position_bins >= 0, "model.crop_position_bins", m.crop_position_bins, "must be 0 (off) or more")
        need(m.recycles >= 0, "model.recycles", m.recycles, "must be 0 or more")
        need(m.evoformer_blocks >= 1, "model.evoformer_blocks", m.evoformer_blocks, "must be at least 1")
        need(m.structure.layers >= 1, "model.structure.layers", m.structure.layers, "must be at least 1")
        need(0.0 <= self.ema.decay < 1.0, "ema.decay", self.ema.decay, "must be in [0, 1)")
        need(self.dap_size >= 1, "dap_size", self.dap_size, "must be at least 1")
        if m.templates:
            t = m.template
            need(d.max_templates >= 1, "data.max_templates", d.max_templates,
                 "must be at least 1 with model.templates=true (AlphaFold: 4)")
            need(t.blocks >= 1, "model.template.blocks", t.blocks, "must be at least 1")
            need(t.heads >= 1 and t.c_t % t.heads == 0, "model.template.heads", t.heads,
                 f"must divide model.template.c_t={t.c_t}")
            need(d.templates_from != "search" or not d.template_dir or Path(d.template_dir).is_dir(),
                 "data.template_dir", d.template_dir, "no such directory: give a folder of mmCIF files for "
                 "data.templates_from=search, or leave it empty for the shipped structures")
        rows = d.max_msa_clusters + (d.max_templates if m.templates else 0)
        need(rows % self.dap_size == 0, "data.max_msa_clusters" + (" + data.max_templates" if m.templates else ""), rows,
             f"MSA rows (clusters, and one per template slot with model.templates) must be a multiple of "
             f"dap_size={self.dap_size}")
        for key, size in (("data.crop_size", d.crop_size), ("data.max_extra_msa", d.max_extra_msa)):
            need(size % self.dap_size == 0, key, size, f"must be a multiple of dap_size={self.dap_size} "
                 "(DAP splits residues and MSA rows evenly over its ranks)")


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> RecipeConfig:
    cfg = load_config(RecipeConfig, resolve(path) if path is not None else None, overrides)
    cfg.train.output_dir = str(resolve(cfg.train.output_dir))
    cfg.model.synced()
    cfg.data.use_templates = cfg.model.templates
    if cfg.init_from:
        cfg.init_from = str(resolve(cfg.init_from))
    if cfg.data.template_dir:
        cfg.data.template_dir = str(resolve(cfg.data.template_dir))
    cfg.validate()
    return cfg


def parse_args(description: str, argv: list[str] | None = None, extra=None):
    return parse_config_args(description, load_recipe, argv, example="apps/protein/configs/tiny.yaml", extra=extra)
