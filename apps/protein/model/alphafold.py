"""AlphaFold 2: embedders, recycling, templates (`model.templates`, `model/template.py`), extra-MSA
stack, Evoformer, structure module and heads (pLDDT, distogram, masked MSA, experimentally
resolved, and with `pae_head` the predicted aligned error of the `_ptm` models). Algorithm 2 of
the AlphaFold 2 supplement.

The Evoformer and extra-MSA stacks run under an `Axial` (one process, or Dynamic Axial
Parallelism over a group); embedders, structure module and heads run on whole tensors on every
rank. `batch` is the dict of `apps.protein.features.make_features` (stacked over B).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from apps.protein import constants as rc
from apps.protein.model.dap import Axial
from apps.protein.model.evoformer import EvoformerConfig, EvoformerStack
from apps.protein.model.primitives import LayerNorm, fp32, in_fp32, linear, lower_edge_one_hot
from apps.protein.model.structure import StructureConfig, StructureModule
from apps.protein.model.template import (TEMPLATE_KEYS, TemplateAngleEmbedder, TemplateConfig,
                                           TemplateEmbedder)
from apps.protein.sidechains import ideal_tables, pseudo_beta

DISTOGRAM_BINS = 64          # 2.3125 .. 21.6875 Angstrom, as AlphaFold
PLDDT_BINS = 50
PAE_BINS = 64                # 0 .. 31 Angstrom in 0.5 A steps, the last open (AlphaFold's _ptm models)
# AlphaFold's recycled pseudo-beta distogram: 15 bins whose lower edges run 3.25 .. 20.75 A (the last
# open-ended); a distance below 3.25 A (every pair of the first pass, whose positions are all zero)
# is in no bin: an all-zero one-hot.
RECYCLE_LOWER_EDGES = (3.25, 20.75, 15)


@dataclass
class ModelConfig:
    c_m: int = 256
    c_z: int = 128
    c_e: int = 64                    # extra-MSA channels
    c_s: int = 384
    evoformer_blocks: int = 48
    extra_msa_blocks: int = 4
    relpos_k: int = 32
    crop_position_bins: int = 0      # 0: AlphaFold (residues told apart only through relative offsets). N > 0:
                                     # also embed each residue's position in its crop (one-hot, clipped at N-1)
                                     # into the MSA; a toy-scale aid, see crop_position_one_hot
    recycles: int = 3                # extra passes through the network (training samples 0..recycles)
    pae_head: bool = False           # the predicted-aligned-error (pTM) head of AlphaFold's params_model_*_ptm
    templates: bool = False          # the template stack of AlphaFold's params_model_1/2 (template pair stack,
                                     # pointwise attention, torsion-angle MSA rows): model/template.py
    template: TemplateConfig = field(default_factory=TemplateConfig)
    evoformer: EvoformerConfig = field(default_factory=EvoformerConfig)
    structure: StructureConfig = field(default_factory=StructureConfig)

    def synced(self) -> "ModelConfig":
        """Channel sizes the sub-configs share, taken from the top level."""
        self.evoformer.c_m, self.evoformer.c_z = self.c_m, self.c_z
        self.structure.c_s, self.structure.c_z = self.c_s, self.c_z
        return self


def recycling_distance_one_hot(x: torch.Tensor) -> torch.Tensor:
    """[.., i, j, 15]: AlphaFold's recycled distogram of points x [.., L, 3]; a pair closer than
    the first lower edge (3.25 A) gets no bin at all."""
    return lower_edge_one_hot(x, *RECYCLE_LOWER_EDGES)


def crop_position_one_hot(residue_index: torch.Tensor, bins: int) -> torch.Tensor:
    """[B, L, bins]: each residue's position counted from the first residue of its crop, clipped
    to bins - 1 (padding rows are masked downstream).

    Not in AlphaFold, whose single representation starts with residue types and MSA columns
    only: residues of the same type in a single-sequence crop are identical there until the
    model has learnt to route the pair's relative offsets into them, which at toy size costs a few
    hundred steps. With this feature the structure module can place residues from the first steps
    (tiny.yaml reaches lDDT-Ca 0.8 in ~500 steps instead of ~750: apps/protein/README.md). It is
    not invariant to shifting the crop, so the shipped configs leave it off."""
    position = (residue_index - residue_index[:, :1]).clamp(0, bins - 1).long()
    return torch.nn.functional.one_hot(position, bins)


class InputEmbedder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.relpos_k = cfg.relpos_k
        self.z_i, self.z_j = linear(22, cfg.c_z), linear(22, cfg.c_z)
        self.m_target, self.m_msa = linear(22, cfg.c_m), linear(49, cfg.c_m)
        self.relpos = linear(2 * cfg.relpos_k + 1, cfg.c_z)
        self.position_bins = cfg.crop_position_bins
        self.m_position = linear(cfg.crop_position_bins, cfg.c_m) if cfg.crop_position_bins else None

    def forward(self, target_feat, residue_index, msa_feat):
        z = self.z_i(target_feat)[:, :, None] + self.z_j(target_feat)[:, None, :]
        offset = (residue_index[:, :, None] - residue_index[:, None, :]).clamp(-self.relpos_k, self.relpos_k)
        z = z + self.relpos(torch.nn.functional.one_hot(offset + self.relpos_k, 2 * self.relpos_k + 1).to(z.dtype))
        m_single = self.m_target(target_feat)
        if self.m_position is not None:
            m_single = m_single + self.m_position(crop_position_one_hot(residue_index, self.position_bins).to(z.dtype))
        m = self.m_msa(msa_feat) + m_single[:, None]
        return m, z


class RecyclingEmbedder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_m, self.norm_z = LayerNorm(cfg.c_m), LayerNorm(cfg.c_z)
        self.dist = linear(RECYCLE_LOWER_EDGES[2], cfg.c_z)

    def forward(self, m0_prev, z_prev, x_prev):
        """Updates for the first MSA row and the pair, from the previous pass (x: pseudo-beta)."""
        one_hot = recycling_distance_one_hot(fp32(x_prev))     # distances of the fp32 atoms
        return self.norm_m(m0_prev), self.norm_z(z_prev) + self.dist(one_hot.to(self.dist.weight.dtype))


class Heads(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c = 128
        self.plddt = nn.Sequential(LayerNorm(cfg.c_s), linear(cfg.c_s, c, init="relu"), nn.ReLU(),
                                   linear(c, c, init="relu"), nn.ReLU(), linear(c, PLDDT_BINS, init="zeros"))
        self.distogram = linear(cfg.c_z, DISTOGRAM_BINS, init="zeros")
        self.masked_msa = linear(cfg.c_m, rc.MSA_CLASSES, init="zeros")
        self.experimentally_resolved = linear(cfg.c_s, 37, init="zeros")
        self.pae = linear(cfg.c_z, PAE_BINS, init="zeros") if cfg.pae_head else None

    def forward(self, single, z):
        """pLDDT, (symmetric) distogram, experimentally-resolved (per atom37) and, with the pTM head,
        aligned-error logits; the masked-MSA head is applied to the MSA apart."""
        logits = self.distogram(z)
        out = {"plddt_logits": self.plddt(single), "distogram_logits": logits + logits.transpose(1, 2),
               "experimentally_resolved_logits": self.experimentally_resolved(single)}
        if self.pae is not None:
            out["pae_logits"] = self.pae(z)
        return out


# Keys of a training batch (apps.protein.features) that are labels, not inputs: the model leaves them.
LABEL_KEYS = frozenset({"all_atom_positions", "all_atom_mask", "atom14_gt_positions", "atom14_gt_exists",
                        "atom14_alt_gt_positions", "backbone_rot", "backbone_trans", "backbone_mask", "torsion_sin_cos",
                        "alt_torsion_sin_cos", "torsion_mask", "pseudo_beta", "pseudo_beta_mask", "true_msa",
                        "bert_mask"})


@dataclass
class EmbeddedTemplates:
    """The template inputs with what depends on them alone, computed once per forward pass: the
    template pair stack's output [B, T, L, L, c_t] and the torsion-angle MSA rows and their mask."""
    inputs: dict[str, torch.Tensor]
    pair: torch.Tensor
    rows: torch.Tensor
    row_mask: torch.Tensor


def plddt_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Expected lDDT-Ca (0..100) per residue from the pLDDT head's bins."""
    centres = (torch.arange(PLDDT_BINS, device=logits.device, dtype=logits.dtype) + 0.5) / PLDDT_BINS
    return (torch.softmax(logits, -1) * centres).sum(-1) * 100


class AlphaFold(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.synced()
        self.input_embedder = InputEmbedder(cfg)
        self.recycling_embedder = RecyclingEmbedder(cfg)
        if cfg.templates:
            self.template_embedder = TemplateEmbedder(cfg.template, cfg.evoformer, cfg.c_z)
            self.template_angle_embedder = TemplateAngleEmbedder(cfg.c_m)
        self.extra_msa_embedder = linear(25, cfg.c_e)
        self.extra_msa_stack = EvoformerStack(cfg.evoformer, cfg.extra_msa_blocks, c_m=cfg.c_e, global_column=True)
        self.evoformer = EvoformerStack(cfg.evoformer, cfg.evoformer_blocks)
        self.single = linear(cfg.c_m, cfg.c_s)
        self.structure_module = StructureModule(cfg.structure)
        self.heads = Heads(cfg)
        with torch.device("cpu"):  # measured constants, also when the model is built on the meta device
            tables = ideal_tables()
        for name, value in tables.items():
            self.register_buffer(name, value, persistent=False)
        self.axial: Axial = Axial()

    # The ideal-geometry tables stay fp32 when the model is cast to bf16 (`model.to(torch.bfloat16)`,
    # what the precision plugins do): the atoms are built in fp32 from them (an fp32 island).
    FP32_BUFFERS = ("default_frames", "atom14_local")

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in self.FP32_BUFFERS}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            if value.is_meta:
                continue
            moved = self._buffers[name]
            self._buffers[name] = value.to(moved.device) if moved.element_size() < 4 else moved
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """The weights' dtype: fp32, or bf16 after a precision plugin cast the model."""
        return self.single.weight.dtype

    def use_axial(self, axial: Axial) -> "AlphaFold":
        """Run the Evoformer stacks split over a DAP group (`DapAxial`) or in one process (`Axial()`)."""
        self.axial = axial
        return self

    def forward(self, target_feat, residue_index, msa_feat, msa_mask, extra_msa_feat, extra_msa_mask, seq_mask,
                aatype, recycles: int | None = None, **labels) -> dict[str, torch.Tensor]:
        """recycles: extra passes (default cfg.recycles); all but the last run without gradients.
        `labels`: a training batch's ground truth, passed along with the inputs and not used; any
        other keyword is a mistake and stops here. With `model.templates` the template inputs
        (`template_*`, apps.protein.templates) are used when given; without them the prediction is
        AlphaFold's for a query without template hits."""
        unknown = sorted(set(labels) - LABEL_KEYS - set(TEMPLATE_KEYS))
        if unknown:
            raise TypeError(f"AlphaFold.forward got unknown inputs {unknown}: the inputs are the features of "
                            "apps.protein.features.make_features (and recycles=)")
        templates = {k: labels[k] for k in TEMPLATE_KEYS if k in labels}
        if templates and not self.cfg.templates:
            raise ValueError("the batch has template features but the model has no template stack: set "
                             "model.templates=true (or build the features without templates)")
        if templates and len(templates) != len(TEMPLATE_KEYS):
            raise ValueError(f"template inputs {sorted(set(TEMPLATE_KEYS) - set(templates))} are missing: pass all of "
                             "apps.protein.templates.template_features' arrays")
        recycles = self.cfg.recycles if recycles is None else recycles
        # Features (one-hots, profiles, 0/1 masks: exact in bf16) in the weights' dtype.
        dtype = self.compute_dtype
        target_feat, msa_feat, extra_msa_feat = target_feat.to(dtype), msa_feat.to(dtype), extra_msa_feat.to(dtype)
        msa_mask, extra_msa_mask, seq_mask = msa_mask.to(dtype), extra_msa_mask.to(dtype), seq_mask.to(dtype)
        b, n = aatype.shape
        prev_m0 = target_feat.new_zeros(b, n, self.cfg.c_m)
        prev_z = target_feat.new_zeros(b, n, n, self.cfg.c_z)
        prev_x = target_feat.new_zeros(b, n, 3, dtype=fp32(target_feat[:0]).dtype)
        inputs = (target_feat, residue_index, msa_feat, msa_mask, extra_msa_feat, extra_msa_mask, seq_mask, aatype)
        template_inputs = templates or None
        if templates and self.cfg.template.cache:
            # The template pair stack and the torsion-angle rows read only the template inputs, so
            # they run once per forward (not once per recycling pass), with the gradient setting of
            # the last pass: its graph is the one the loss backpropagates through, as without the
            # cache; the passes before it read the result under no_grad. A local value, never
            # kept on the module: nothing carries over to the next batch.
            pair_mask = seq_mask[:, :, None] * seq_mask[:, None, :]
            template_inputs = EmbeddedTemplates(
                templates, self.template_embedder.embed(templates, pair_mask, dtype),
                *self.template_angle_embedder(templates, dtype))
        for cycle in range(recycles + 1):
            last = cycle == recycles
            with torch.set_grad_enabled(last and torch.is_grad_enabled()):
                out = self.iteration(*inputs, prev_m0, prev_z, prev_x, template_inputs)
            prev_m0, prev_z = out["msa_first_row"].detach(), out["pair"].detach()
            prev_x = pseudo_beta(out["atom37"], aatype).detach()
        return out

    def iteration(self, target_feat, residue_index, msa_feat, msa_mask, extra_msa_feat, extra_msa_mask, seq_mask,
                  aatype, prev_m0, prev_z, prev_x, templates=None) -> dict[str, torch.Tensor]:
        ax = self.axial
        pair_mask = seq_mask[:, :, None] * seq_mask[:, None, :]
        m, z = self.input_embedder(target_feat, residue_index, msa_feat)
        dm0, dz = self.recycling_embedder(prev_m0, prev_z, prev_x)
        m = torch.cat([m[:, :1] + dm0[:, None], m[:, 1:]], 1)
        z = z + dz
        n_seq = m.shape[1]
        if templates is not None:
            # Algorithm 2: the templates' pair embedding joins z before the extra-MSA stack; their
            # torsion-angle rows join the MSA (after the extra-MSA stack, which does not see them).
            # Whole tensors on every rank, like the other embedders.
            if isinstance(templates, EmbeddedTemplates):      # model.template.cache: embedded once per forward
                z = z + self.template_embedder.attend(z, templates.pair, templates.inputs)
                rows, row_mask = templates.rows, templates.row_mask
            else:
                z = z + self.template_embedder(z, templates, pair_mask)
                rows, row_mask = self.template_angle_embedder(templates, m.dtype)
            m, msa_mask = torch.cat([m, rows], 1), torch.cat([msa_mask, row_mask], 1)
        # Split for the stacks: MSA by rows, pair by its first residue axis.
        z = ax.scatter(z, 1)
        e = ax.scatter(self.extra_msa_embedder(extra_msa_feat), 1)
        _, z = self.extra_msa_stack(e, z, extra_msa_mask, pair_mask, ax)
        m, z = self.evoformer(ax.scatter(m, 1), z, msa_mask, pair_mask, ax)
        # Whole tensors again for the structure module and heads (run on every rank).
        first_row = ax.gather(ax.transpose(m, 2, 1)[:, 0], 1)
        z = ax.gather(z, 1)
        msa_logits = fp32(ax.gather(self.heads.masked_msa(m), 1))[:, :n_seq]   # not of the template rows
        s = self.single(first_row)
        # The structure module and the heads are fp32 islands of a bf16 model (AlphaFold casts the
        # Evoformer's outputs to fp32 before them): z cast once for both.
        z32 = fp32(z)
        out = in_fp32(self.structure_module, s, z32, aatype, seq_mask, {"default_frames": self.default_frames,
                                                                         "atom14_local": self.atom14_local})
        heads = in_fp32(self.heads, out["single"], z32)
        heads["masked_msa_logits"] = msa_logits
        out.update(heads)
        out.update({"msa_first_row": first_row, "pair": z, "plddt": plddt_from_logits(heads["plddt_logits"])})
        return out
