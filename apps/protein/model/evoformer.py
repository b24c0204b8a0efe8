"""The Evoformer (AlphaFold 2, algorithms 6-15), written for Dynamic Axial Parallelism.

Shapes: MSA m [B, S, R, c_m], pair z [B, R, R, c_z]. Each operation receives its activations in
the split it works in and says, through `ax` (an `Axial`), what it must gather or transpose:

- row mode: m split along S (rows), z split along its first residue axis i;
- column mode: m split along R; the column attention and the outer product mean run there.

With `Axial()` (one process) every split is the whole tensor and the code is plain AlphaFold.
Masks come in full and each operation takes its slice with `ax.scatter`.

`chunk_size` bounds memory at length: attention runs over that many rows at a time, and the outer
product mean and both triangle multiplications compute that many residue rows i of their output at
a time (`chunked`), so the [i, j, c, c] outer product and the [i, j, c_hidden_mul] triangle
operands and products never exist for all rows at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from apps.protein.model.dap import Axial
from apps.protein.model.primitives import Attention, LayerNorm, SharedDropout, Transition, chunked, fp32, linear
from phalanx_kernels import masked_softmax


@dataclass
class EvoformerConfig:
    c_m: int = 256           # MSA channels
    c_z: int = 128           # pair channels
    heads_msa: int = 8
    c_hidden_msa: int = 32
    heads_pair: int = 4
    c_hidden_pair: int = 32
    c_hidden_mul: int = 128  # triangle multiplication channels
    c_hidden_opm: int = 32   # outer product mean channels
    c_hidden_extra: int = 8  # per-head channels of the extra-MSA stack's row and global column attention
                             # (AlphaFold: c_e = 64 over 8 heads)
    transition_n: int = 4
    chunk_size: int | None = None  # rows per chunk of attention, outer product mean and triangle
                                   # multiplication (None: all at once)
    # AlphaFold's dropout (supplement algorithm 6, also in the extra-MSA stack; off in eval mode):
    # row-wise on the MSA row attention's update, row-wise on both triangle multiplications and the
    # starting-node triangle attention, column-wise on the ending-node attention; none elsewhere.
    dropout_msa_row: float = 0.15
    dropout_pair: float = 0.25

    def __post_init__(self):
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):
            raise ValueError(f"evoformer.chunk_size={self.chunk_size!r}: give a positive number of rows per chunk "
                             "(e.g. 64), or null to compute all rows at once")
        for key in ("dropout_msa_row", "dropout_pair"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"evoformer.{key}={getattr(self, key)!r}: give a dropout probability in [0, 1) "
                                 "(0 turns it off)")


def pair_bias(ax: Axial, norm: LayerNorm, proj: nn.Linear, z: torch.Tensor) -> torch.Tensor:
    """[B, 1, H, R, R] attention bias from the row-split pair representation (gathered whole)."""
    return ax.gather(proj(norm(z)), 1).permute(0, 3, 1, 2).unsqueeze(1)


class MSARowAttentionWithPairBias(nn.Module):
    def __init__(self, cfg: EvoformerConfig, c_m: int, c_hidden: int):
        super().__init__()
        self.norm_m, self.norm_z = LayerNorm(c_m), LayerNorm(cfg.c_z)
        self.bias = linear(cfg.c_z, cfg.heads_msa, bias=False)
        self.attn = Attention(c_m, c_hidden, cfg.heads_msa)

    def forward(self, m, z, msa_mask, ax: Axial, chunk_size=None):
        """m: row mode [B, S/n, R, c]; msa_mask full [B, S, R]."""
        bias = pair_bias(ax, self.norm_z, self.bias, z)
        return self.attn(self.norm_m(m), ax.scatter(msa_mask, 1), bias, chunk_size)


class MSAColumnAttention(nn.Module):
    def __init__(self, cfg: EvoformerConfig, c_m: int):
        super().__init__()
        self.norm = LayerNorm(c_m)
        self.attn = Attention(c_m, cfg.c_hidden_msa, cfg.heads_msa)

    def forward(self, m, msa_mask, ax: Axial, chunk_size=None):
        """m: column mode [B, S, R/n, c]."""
        mask = ax.scatter(msa_mask, 2).transpose(1, 2)
        out = self.attn(self.norm(m).transpose(1, 2), mask, None, chunk_size)
        return out.transpose(1, 2)


class MSAColumnGlobalAttention(nn.Module):
    """The extra-MSA stack's column attention (algorithm 19): one averaged query per column and
    single-head keys/values, linear in the (large) number of extra sequences."""

    def __init__(self, cfg: EvoformerConfig, c_m: int):
        super().__init__()
        self.heads, self.c_hidden = cfg.heads_msa, cfg.c_hidden_extra
        c_hidden = cfg.c_hidden_extra
        self.norm = LayerNorm(c_m)
        self.q = linear(c_m, self.heads * c_hidden, bias=False)
        self.k = linear(c_m, c_hidden, bias=False)
        self.v = linear(c_m, c_hidden, bias=False)
        self.g = linear(c_m, self.heads * c_hidden, init="gating")
        self.o = linear(self.heads * c_hidden, c_m, init="zeros")

    def forward(self, m, msa_mask, ax: Axial, chunk_size=None):
        x = self.norm(m).transpose(1, 2)                               # [B, R/n, S, c]
        mask = ax.scatter(msa_mask, 2).transpose(1, 2)                 # [B, R/n, S]
        # The mean over up to 5,120 sequences: sum and count in fp32 (bf16 counts exactly only to 256).
        q_avg = ((fp32(x) * fp32(mask)[..., None]).sum(-2) / (fp32(mask).sum(-1, keepdim=True) + 1e-10)).to(x.dtype)
        q = self.q(q_avg).view(*q_avg.shape[:-1], self.heads, self.c_hidden) * self.c_hidden ** -0.5
        k, v = self.k(x), self.v(x)                                    # [B, R/n, S, c]
        logits = torch.einsum("brhc,brsc->brhs", q, k)
        w = masked_softmax(logits, mask[..., None, :])
        o = torch.einsum("brhs,brsc->brhc", w, v)
        g = torch.sigmoid(self.g(x)).view(*x.shape[:-1], self.heads, self.c_hidden)
        out = (g * o[..., None, :, :]).reshape(*x.shape[:-1], self.heads * self.c_hidden)
        return self.o(out).transpose(1, 2)


class OuterProductMean(nn.Module):
    def __init__(self, cfg: EvoformerConfig, c_m: int):
        super().__init__()
        c = cfg.c_hidden_opm
        self.norm = LayerNorm(c_m)
        self.a, self.b = linear(c_m, c), linear(c_m, c)
        self.o = linear(c * c, cfg.c_z, init="zeros")

    def forward(self, m, msa_mask, ax: Axial, chunk_size=None):
        """m: column mode [B, S, R/n, c] -> pair update, row mode [B, R/n, R, c_z]; chunk_size rows i
        of the update at a time."""
        x = self.norm(m)
        mask_local = ax.scatter(msa_mask, 2)[..., None]
        a, b = self.a(x) * mask_local, self.b(x) * mask_local
        b = ax.gather(b, 2)
        # Pairs of residues both present, counted over up to 512 MSA rows: in fp32 (bf16 counts
        # exactly only to 256).
        norm = torch.einsum("bsi,bsj->bij", fp32(mask_local[..., 0]), fp32(msa_mask))

        def rows(part):
            outer = torch.einsum("bsic,bsjd->bijcd", a[:, :, part], b)
            outer = self.o(outer.reshape(*outer.shape[:3], -1))
            return (fp32(outer) / (norm[:, part, :, None] + 1e-3)).to(outer.dtype)
        return chunked(rows, a.shape[2], chunk_size)


class TriangleMultiplication(nn.Module):
    """outgoing: z_ij += sum_k a_ik b_jk; incoming: z_ij += sum_k a_ki b_kj (algorithms 11, 12)."""

    def __init__(self, cfg: EvoformerConfig, outgoing: bool):
        super().__init__()
        c, h = cfg.c_z, cfg.c_hidden_mul
        self.outgoing = outgoing
        self.norm_in, self.norm_out = LayerNorm(c), LayerNorm(h)
        self.a_p, self.a_g = linear(c, h), linear(c, h, init="gating")
        self.b_p, self.b_g = linear(c, h), linear(c, h, init="gating")
        self.g, self.o = linear(c, c, init="gating"), linear(h, c, init="zeros")

    def forward(self, z, pair_mask, ax: Axial, chunk_size=None):
        """z: row mode [B, R/n, R, c]; pair_mask full [B, R, R]. chunk_size: rows i of the update
        (and of the left operand a) computed at a time; the right operand b is whole."""
        zn = self.norm_in(z)
        if self.outgoing:
            src, mask = zn, ax.scatter(pair_mask, 1)[..., None]
        else:  # a_ki needs every k of this rank's columns i: switch to column mode
            src, mask = ax.transpose(zn, 2, 1), ax.scatter(pair_mask, 2)[..., None]
        b = torch.sigmoid(self.b_g(src)) * self.b_p(src) * mask
        b = ax.gather(b, 1 if self.outgoing else 2)

        def rows(part):
            # outgoing: a_ik are rows i of src; incoming: a_ki are its (local) columns i
            sel = (slice(None), part) if self.outgoing else (slice(None), slice(None), part)
            a = torch.sigmoid(self.a_g(src[sel])) * self.a_p(src[sel]) * mask[sel]
            if self.outgoing:
                out = torch.einsum("bikc,bjkc->bijc", a, b)
            else:
                out = torch.einsum("bkic,bkjc->bijc", a, b)
            return torch.sigmoid(self.g(zn[:, part])) * self.o(self.norm_out(out))
        return chunked(rows, zn.shape[1], chunk_size)


class TriangleAttention(nn.Module):
    """Around the starting node (rows of z) or the ending node (the same on z transposed)."""

    def __init__(self, cfg: EvoformerConfig, starting: bool):
        super().__init__()
        self.starting = starting
        self.norm = LayerNorm(cfg.c_z)
        self.bias = linear(cfg.c_z, cfg.heads_pair, bias=False)
        self.attn = Attention(cfg.c_z, cfg.c_hidden_pair, cfg.heads_pair)

    def forward(self, z, pair_mask, ax: Axial, chunk_size=None):
        if self.starting:
            x, mask = self.norm(z), ax.scatter(pair_mask, 1)
        else:  # rows of z^T are columns of z: column mode, then swap the axes locally
            x = ax.transpose(self.norm(z), 2, 1).transpose(1, 2)
            mask = ax.scatter(pair_mask.transpose(1, 2), 1)
        bias = ax.gather(self.bias(x), 1).permute(0, 3, 1, 2).unsqueeze(1)
        out = self.attn(x, mask, bias, chunk_size)
        if self.starting:
            return out
        return ax.transpose(out.transpose(1, 2), 1, 2)


class EvoformerBlock(nn.Module):
    """One block: MSA stack (row attention, column attention, transition, outer product mean),
    then the pair stack (two triangle multiplications, two triangle attentions, transition)."""

    def __init__(self, cfg: EvoformerConfig, c_m: int | None = None, global_column: bool = False):
        super().__init__()
        c_m = c_m or cfg.c_m
        # The extra-MSA stack (global column attention) has narrower heads than the main stack.
        self.row_attn = MSARowAttentionWithPairBias(cfg, c_m, cfg.c_hidden_extra if global_column else cfg.c_hidden_msa)
        self.col_attn = MSAColumnGlobalAttention(cfg, c_m) if global_column else MSAColumnAttention(cfg, c_m)
        self.msa_transition = Transition(c_m, cfg.transition_n)
        self.opm = OuterProductMean(cfg, c_m)
        self.tri_mul_out = TriangleMultiplication(cfg, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(cfg, outgoing=False)
        self.tri_att_start = TriangleAttention(cfg, starting=True)
        self.tri_att_end = TriangleAttention(cfg, starting=False)
        self.pair_transition = Transition(cfg.c_z, cfg.transition_n)
        self.chunk_size = cfg.chunk_size
        # m row mode [B, S/n, R, c] and z row mode [B, R/n, R, c]: "row-wise" shares a mask over
        # axis 1 (every MSA row / every pair row i), "column-wise" over axis 2 (every column j).
        self.drop_msa_row = SharedDropout(cfg.dropout_msa_row, shared_dim=1)
        self.drop_pair_row = SharedDropout(cfg.dropout_pair, shared_dim=1)
        self.drop_pair_col = SharedDropout(cfg.dropout_pair, shared_dim=2)

    def forward(self, m, z, msa_mask, pair_mask, ax: Axial):
        """m row mode [B, S/n, R, c_m], z row mode [B, R/n, R, c_z] -> the same, updated."""
        c = self.chunk_size
        m = m + self.drop_msa_row(self.row_attn(m, z, msa_mask, ax, c), ax)
        m = ax.transpose(m, 2, 1)                      # -> column mode
        m = m + self.col_attn(m, msa_mask, ax, c)
        m = m + self.msa_transition(m)
        z = z + self.opm(m, msa_mask, ax, c)
        m = ax.transpose(m, 1, 2)                      # -> row mode
        z = z + self.drop_pair_row(self.tri_mul_out(z, pair_mask, ax, c), ax)
        z = z + self.drop_pair_row(self.tri_mul_in(z, pair_mask, ax, c), ax)
        z = z + self.drop_pair_row(self.tri_att_start(z, pair_mask, ax, c), ax)
        z = z + self.drop_pair_col(self.tri_att_end(z, pair_mask, ax, c), ax)
        z = z + self.pair_transition(z)
        return m, z


class EvoformerStack(nn.Module):
    def __init__(self, cfg: EvoformerConfig, blocks: int, c_m: int | None = None, global_column: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(EvoformerBlock(cfg, c_m, global_column) for _ in range(blocks))

    def forward(self, m, z, msa_mask, pair_mask, ax: Axial):
        for block in self.blocks:
            m, z = block(m, z, msa_mask, pair_mask, ax)
        return m, z
