"""AlphaFold 2's templates (supplement 1.7.1; algorithm 2 lines 7-13, algorithms 16 and 17).

Per template t (structures aligned to the query, `apps.protein.templates`):

- pair features [L, L, 88] (`template_pair_features`): the pseudo-beta distogram (39 bins with
  lower edges 3.25 .. 50.75 A, the last open), the pseudo-beta pair mask, the template's residue
  type one-hot of j then of i (22 classes: 20, X, gap), the unit vector from residue i's CA to j's
  CA in i's backbone frame (zeros unless `unit_vector`: AlphaFold's released models were trained
  with them zeroed, `use_template_unit_vector: False`) and the backbone pair mask; everything
  multiplied by the backbone pair mask;
- `embedding2d` (88 -> c_t), the template pair stack (triangle attention around the starting and
  the ending node, outgoing and incoming triangle multiplication, pair transition; 2 blocks),
  a final LayerNorm;
- the pointwise attention: each pair (i, j) of the pair representation attends over the templates'
  (i, j) entries (4 heads, no gating), masked by `template_mask`, and the result is multiplied by
  "any template present", so a query without templates gets exactly nothing;
- torsion-angle features [L, 57] (residue type one-hot 22, sin/cos of the 7 torsions 14, their
  alternative 14, torsion mask 7) -> Linear -> ReLU -> Linear: one extra MSA row per template,
  masked where the template's psi is unknown.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from apps.protein.model.dap import Axial
from apps.protein.model.evoformer import EvoformerConfig, TriangleAttention, TriangleMultiplication
from apps.protein.model.primitives import LayerNorm, SharedDropout, Transition, linear, lower_edge_one_hot
from apps.protein.rigid import backbone_frame
from phalanx_kernels import masked_softmax

TEMPLATE_DISTOGRAM = (3.25, 50.75, 39)   # lower edges of AlphaFold's template distogram (A), bin count
PAIR_FEATURES = 88
ANGLE_FEATURES = 57
TEMPLATE_CLASSES = 22                    # 20 residues, X, gap (a query residue no template residue aligns to)
# The batch's template inputs (apps.protein.templates.template_features), stacked [B, T, ...].
TEMPLATE_KEYS = ("template_aatype", "template_all_atom_positions", "template_all_atom_mask", "template_mask",
                 "template_pseudo_beta", "template_pseudo_beta_mask", "template_torsion_sin_cos",
                 "template_alt_torsion_sin_cos", "template_torsion_mask")


@dataclass
class TemplateConfig:
    c_t: int = 64                 # template pair channels
    blocks: int = 2               # template pair stack blocks
    heads: int = 4                # triangle attention of the pair stack, and the pointwise attention (c_t / heads each)
    c_hidden_mul: int = 64        # triangle multiplication channels
    transition_n: int = 2
    unit_vector: bool = False     # AlphaFold's released models: False (the unit-vector features are zeros)
    cache: bool = True            # run the template pair stack (and the torsion-angle rows) once per forward
                                  # and reuse them in every recycling pass: they read only the template
                                  # inputs; only the pointwise attention, which reads z, runs every pass


def template_pair_features(aatype: torch.Tensor, positions: torch.Tensor, atom_mask: torch.Tensor,
                           pseudo_beta: torch.Tensor, pseudo_beta_mask: torch.Tensor,
                           unit_vector: bool = True) -> torch.Tensor:
    """[.., L, L, 88] from one or more templates: aatype [.., L] (0..21), atom37 positions
    [.., L, 37, 3] and mask [.., L, 37], pseudo-beta [.., L, 3] and its mask [.., L]."""
    dtype = positions.dtype
    dgram = lower_edge_one_hot(pseudo_beta, *TEMPLATE_DISTOGRAM)
    pb_2d = (pseudo_beta_mask[..., :, None] * pseudo_beta_mask[..., None, :]).to(dtype)
    length = aatype.shape[-1]
    one_hot = torch.nn.functional.one_hot(aatype.long(), TEMPLATE_CLASSES).to(dtype)
    aa_j = one_hot[..., None, :, :].expand(*aatype.shape[:-1], length, length, TEMPLATE_CLASSES)
    aa_i = one_hot[..., :, None, :].expand(*aatype.shape[:-1], length, length, TEMPLATE_CLASSES)
    n, ca, c = positions[..., 0, :], positions[..., 1, :], positions[..., 2, :]
    bb = (atom_mask[..., 0] * atom_mask[..., 1] * atom_mask[..., 2]).to(dtype)
    bb_2d = bb[..., :, None] * bb[..., None, :]
    if unit_vector:
        # CA of j in the backbone frame of i (origin CA, x along CA->C, N in the xy plane), normalised.
        local = backbone_frame(n, ca, c).unsqueeze(-1).invert_apply(ca[..., None, :, :])
        unit = local * torch.rsqrt(1e-6 + (local ** 2).sum(-1, keepdim=True)) * bb_2d[..., None]
    else:
        unit = dgram.new_zeros(*dgram.shape[:-1], 3)
    feats = torch.cat([dgram, pb_2d[..., None], aa_j, aa_i, unit, bb_2d[..., None]], -1)
    return feats * bb_2d[..., None]


def template_angle_features(aatype: torch.Tensor, sin_cos: torch.Tensor, alt_sin_cos: torch.Tensor,
                            torsion_mask: torch.Tensor) -> torch.Tensor:
    """[.., L, 57]: residue type one-hot (22), the 7 torsions' sin/cos (14), their pi-shifted
    alternatives (14) and the torsion mask (7), as AlphaFold's template_single_embedding reads them."""
    one_hot = torch.nn.functional.one_hot(aatype.long(), TEMPLATE_CLASSES).to(sin_cos.dtype)
    return torch.cat([one_hot, sin_cos.flatten(-2), alt_sin_cos.flatten(-2), torsion_mask.to(sin_cos.dtype)], -1)


def template_stack_config(evoformer: EvoformerConfig, cfg: TemplateConfig) -> EvoformerConfig:
    """The Evoformer's pair-operation config at the template stack's sizes (chunking and the pair
    dropout rate are the Evoformer's: AlphaFold drops 0.25 in the template stack too)."""
    return replace(evoformer, c_z=cfg.c_t, heads_pair=cfg.heads, c_hidden_pair=cfg.c_t // cfg.heads,
                   c_hidden_mul=cfg.c_hidden_mul, transition_n=cfg.transition_n)


class TemplatePairBlock(nn.Module):
    """Algorithm 16: triangle attention (starting, ending node), triangle multiplication (outgoing,
    incoming), pair transition -- attention first, unlike the Evoformer's pair stack."""

    def __init__(self, cfg: EvoformerConfig):
        super().__init__()
        self.tri_att_start = TriangleAttention(cfg, starting=True)
        self.tri_att_end = TriangleAttention(cfg, starting=False)
        self.tri_mul_out = TriangleMultiplication(cfg, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(cfg, outgoing=False)
        self.pair_transition = Transition(cfg.c_z, cfg.transition_n)
        self.chunk_size = cfg.chunk_size
        self.drop_row = SharedDropout(cfg.dropout_pair, shared_dim=1)
        self.drop_col = SharedDropout(cfg.dropout_pair, shared_dim=2)

    def forward(self, t, pair_mask):
        ax, c = Axial(), self.chunk_size
        t = t + self.drop_row(self.tri_att_start(t, pair_mask, ax, c), ax)
        t = t + self.drop_col(self.tri_att_end(t, pair_mask, ax, c), ax)
        t = t + self.drop_row(self.tri_mul_out(t, pair_mask, ax, c), ax)
        t = t + self.drop_row(self.tri_mul_in(t, pair_mask, ax, c), ax)
        return t + self.pair_transition(t)


class TemplatePairStack(nn.Module):
    def __init__(self, cfg: EvoformerConfig, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(TemplatePairBlock(cfg) for _ in range(blocks))
        self.norm = LayerNorm(cfg.c_z)

    def forward(self, t, pair_mask):
        for block in self.blocks:
            t = block(t, pair_mask)
        return self.norm(t)


class TemplatePointwiseAttention(nn.Module):
    """Algorithm 17: z_ij attends over the templates' t_ij (no gating; masked templates excluded)."""

    def __init__(self, c_z: int, c_t: int, heads: int):
        super().__init__()
        self.heads, self.c_hidden = heads, c_t // heads
        self.q = linear(c_z, c_t, bias=False)
        self.k = linear(c_t, c_t, bias=False)
        self.v = linear(c_t, c_t, bias=False)
        self.g = None
        self.o = linear(c_t, c_z, init="zeros")

    def forward(self, z, t, template_mask):
        """z [B, L, L, c_z], t [B, T, L, L, c_t], template_mask [B, T] -> update of z."""
        h, c = self.heads, self.c_hidden
        q = self.q(z).unflatten(-1, (h, c)) * c ** -0.5
        k, v = self.k(t).unflatten(-1, (h, c)), self.v(t).unflatten(-1, (h, c))
        logits = torch.einsum("bijhc,btijhc->bijht", q, k)
        w = masked_softmax(logits, template_mask[:, None, None, None, :])
        out = torch.einsum("bijht,btijhc->bijhc", w, v).flatten(-2)
        present = (template_mask.sum(-1) > 0).to(z.dtype)          # no template: no update at all
        return self.o(out) * present[:, None, None, None]


class TemplateEmbedder(nn.Module):
    """The templates' contribution to the pair representation (algorithm 2, lines 9-11)."""

    def __init__(self, cfg: TemplateConfig, evoformer: EvoformerConfig, c_z: int):
        super().__init__()
        self.unit_vector = cfg.unit_vector
        self.pair_embedding = linear(PAIR_FEATURES, cfg.c_t, init="relu")
        self.pair_stack = TemplatePairStack(template_stack_config(evoformer, cfg), cfg.blocks)
        self.pointwise = TemplatePointwiseAttention(c_z, cfg.c_t, cfg.heads)

    def embed(self, batch: dict[str, torch.Tensor], pair_mask, dtype: torch.dtype) -> torch.Tensor:
        """The template pair stack's output t [B, T, L, L, c_t]: a function of the template inputs
        and the residue mask only (not of the pair representation), so one result serves every
        recycling pass (`AlphaFold.forward` with `model.template.cache`)."""
        b, n_t = batch["template_mask"].shape
        feats = template_pair_features(batch["template_aatype"], batch["template_all_atom_positions"].float(),
                                       batch["template_all_atom_mask"], batch["template_pseudo_beta"].float(),
                                       batch["template_pseudo_beta_mask"], self.unit_vector)
        t = self.pair_embedding(feats.to(dtype))                          # [B, T, L, L, c_t]
        flat = t.flatten(0, 1)
        mask = pair_mask[:, None].expand(b, n_t, *pair_mask.shape[1:]).flatten(0, 1)
        return self.pair_stack(flat, mask).unflatten(0, (b, n_t))

    def attend(self, z, t, batch: dict[str, torch.Tensor]):
        """The pointwise attention of z over the embedded templates t: the update of z."""
        return self.pointwise(z, t, batch["template_mask"].to(z.dtype))

    def forward(self, z, batch: dict[str, torch.Tensor], pair_mask):
        """z [B, L, L, c_z]; batch: the template inputs [B, T, ...]; pair_mask [B, L, L]."""
        return self.attend(z, self.embed(batch, pair_mask, z.dtype), batch)


class TemplateAngleEmbedder(nn.Module):
    """template_single_embedding -> ReLU -> template_projection: [B, T, L, 57] -> [B, T, L, c_m]."""

    def __init__(self, c_m: int):
        super().__init__()
        self.fc1 = linear(ANGLE_FEATURES, c_m, init="relu")
        self.fc2 = linear(c_m, c_m, init="relu")

    def forward(self, batch: dict[str, torch.Tensor], dtype: torch.dtype):
        """(template MSA rows [B, T, L, c_m], their mask [B, T, L]: the psi torsion's, and none for
        an absent template)."""
        feats = template_angle_features(batch["template_aatype"], batch["template_torsion_sin_cos"].to(dtype),
                                        batch["template_alt_torsion_sin_cos"].to(dtype), batch["template_torsion_mask"])
        rows = self.fc2(torch.relu(self.fc1(feats)))
        mask = batch["template_torsion_mask"][..., 2] * batch["template_mask"][..., None]
        return rows, mask.to(dtype)
