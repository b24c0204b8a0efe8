"""The structure module (AlphaFold 2, algorithms 20-24): invariant point attention, backbone frame
updates, torsion angles, and atoms from torsions (apps.protein.sidechains).

A bf16 model runs this module as an fp32 island (`primitives.in_fp32`, called by `AlphaFold`), as
AlphaFold casts the Evoformer's bf16 outputs back to fp32 before it: frames, points, rigid
operations, torsions and atoms, and the single representation they are integrated from."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from apps.protein.model.primitives import LayerNorm, linear
from apps.protein.rigid import Rigid, quaternion_update
from apps.protein.sidechains import atom14_positions, atom14_to_atom37, group_frames
from phalanx_kernels import masked_softmax


@dataclass
class StructureConfig:
    c_s: int = 384
    c_z: int = 128
    c_ipa: int = 16
    heads: int = 12
    query_points: int = 4
    value_points: int = 8
    layers: int = 8                  # iterations, weights shared
    c_resnet: int = 128
    resnet_blocks: int = 2
    position_scale: float = 10.0     # backbone translations are predicted in nanometres
    dropout: float = 0.1             # AlphaFold's dropout on the single representation after IPA and after
                                     # the transition (algorithm 20; off in eval mode)


class InvariantPointAttention(nn.Module):
    """Attention whose logits and outputs are invariant to a global rotation/translation of the
    frames: scalar q.k, a pair bias, and distances between query and key points placed in each
    residue's frame; the outputs are brought back into the receiving residue's frame."""

    def __init__(self, cfg: StructureConfig):
        super().__init__()
        h, c, pq, pv = cfg.heads, cfg.c_ipa, cfg.query_points, cfg.value_points
        self.h, self.c, self.pq, self.pv = h, c, pq, pv
        self.q, self.kv = linear(cfg.c_s, h * c), linear(cfg.c_s, 2 * h * c)
        self.q_pts, self.kv_pts = linear(cfg.c_s, h * pq * 3), linear(cfg.c_s, h * (pq + pv) * 3)
        self.bias = linear(cfg.c_z, h)
        self.head_weights = nn.Parameter(torch.full((h,), math.log(math.e - 1)))  # softplus -> 1
        self.o = linear(h * (c + pv * 4 + cfg.c_z), cfg.c_s, init="zeros")

    def forward(self, s: torch.Tensor, z: torch.Tensor, frames: Rigid, mask: torch.Tensor) -> torch.Tensor:
        """s [B, L, c_s], z [B, L, L, c_z], frames [B, L], mask [B, L]."""
        b, n, _ = s.shape
        h, c, pq, pv = self.h, self.c, self.pq, self.pv
        q = self.q(s).view(b, n, h, c)
        k, v = self.kv(s).view(b, n, h, 2 * c).split(c, -1)
        # Points: predicted in each residue's local frame, compared in the global one.
        q_pts = frames.unsqueeze(2).apply(self.q_pts(s).view(b, n, h * pq, 3)).view(b, n, h, pq, 3)
        kv_pts = frames.unsqueeze(2).apply(self.kv_pts(s).view(b, n, h * (pq + pv), 3)).view(b, n, h, pq + pv, 3)
        k_pts, v_pts = kv_pts.split([pq, pv], dim=-2)
        w_c = math.sqrt(2.0 / (9.0 * pq))
        gamma = F.softplus(self.head_weights).view(1, h, 1, 1)
        logits = torch.einsum("bihc,bjhc->bhij", q, k) / math.sqrt(c) + self.bias(z).permute(0, 3, 1, 2)
        dist2 = ((q_pts[:, :, None] - k_pts[:, None, :]) ** 2).sum(-1).sum(-1)   # [B, i, j, H]
        logits = (logits - 0.5 * gamma * w_c * dist2.permute(0, 3, 1, 2)) * math.sqrt(1.0 / 3)
        a = masked_softmax(logits, mask[:, None, None, :])                       # [B, H, i, j]
        o = torch.einsum("bhij,bjhc->bihc", a, v)
        o_pts_global = torch.einsum("bhij,bjhpx->bihpx", a, v_pts)
        o_pts = frames.unsqueeze(2).unsqueeze(3).invert_apply(o_pts_global)               # [B, i, H, Pv, 3]
        o_norm = torch.sqrt((o_pts ** 2).sum(-1) + 1e-8)
        o_pair = torch.einsum("bhij,bijc->bihc", a, z)
        feats = [o.reshape(b, n, -1), o_pts.reshape(b, n, -1), o_norm.reshape(b, n, -1), o_pair.reshape(b, n, -1)]
        return self.o(torch.cat(feats, -1))


class AngleResnet(nn.Module):
    """Seven torsions (omega, phi, psi, chi1-4) as unnormalised (sin, cos) pairs."""

    def __init__(self, cfg: StructureConfig):
        super().__init__()
        c = cfg.c_resnet
        self.inp, self.inp_initial = linear(cfg.c_s, c), linear(cfg.c_s, c)
        self.blocks = nn.ModuleList(nn.ModuleList([linear(c, c, init="relu"), linear(c, c, init="zeros")])
                                    for _ in range(cfg.resnet_blocks))
        self.out = linear(c, 14)

    def forward(self, s, s_initial):
        a = self.inp(F.relu(s)) + self.inp_initial(F.relu(s_initial))
        for fc1, fc2 in self.blocks:
            a = a + fc2(F.relu(fc1(F.relu(a))))
        raw = self.out(F.relu(a)).view(*s.shape[:-1], 7, 2)
        norm = torch.sqrt((raw ** 2).sum(-1, keepdim=True).clamp(min=1e-12))
        return raw, raw / norm


class StructureModule(nn.Module):
    def __init__(self, cfg: StructureConfig):
        super().__init__()
        self.cfg = cfg
        self.norm_s, self.norm_z = LayerNorm(cfg.c_s), LayerNorm(cfg.c_z)
        self.inp = linear(cfg.c_s, cfg.c_s)
        self.ipa = InvariantPointAttention(cfg)
        self.norm_ipa = LayerNorm(cfg.c_s)
        self.transition = nn.ModuleList([linear(cfg.c_s, cfg.c_s, init="relu"), linear(cfg.c_s, cfg.c_s, init="relu"),
                                         linear(cfg.c_s, cfg.c_s, init="zeros")])
        self.norm_transition = LayerNorm(cfg.c_s)
        self.dropout = nn.Dropout(cfg.dropout)
        self.backbone_update = linear(cfg.c_s, 6, init="zeros")
        self.angles = AngleResnet(cfg)

    def forward(self, s, z, aatype, mask, tables):
        """-> per-layer frames [layers, B, L] and angles, final single, atom14/atom37 positions."""
        s_initial = self.norm_s(s)
        z = self.norm_z(z)
        s = self.inp(s_initial)
        b, n = s.shape[:2]
        frames = Rigid.identity((b, n), s.device, s.dtype)
        out_rot, out_trans, out_angles, out_raw, out_sc = [], [], [], [], []
        for layer in range(self.cfg.layers):
            # IPA works in nanometres, as AlphaFold's fold iteration: in Angstrom its point-distance
            # logits are 100x too large (near-one-hot attention that barely trains) and real AF2
            # parameters would see points 10x too far apart.
            s = self.norm_ipa(self.dropout(s + self.ipa(s, z, frames.scale_translation(1.0 / self.cfg.position_scale),
                                                        mask)))
            t = s
            t = F.relu(self.transition[0](t))
            t = F.relu(self.transition[1](t))
            s = self.norm_transition(self.dropout(s + self.transition[2](t)))
            update = self.backbone_update(s)
            update = torch.cat([update[..., :3], update[..., 3:] * self.cfg.position_scale], -1)
            frames = frames.compose(quaternion_update(update))
            raw, angles = self.angles(s, s_initial)
            out_rot.append(frames.rot)
            out_trans.append(frames.trans)
            out_raw.append(raw)
            out_angles.append(angles)
            if layer < self.cfg.layers - 1:
                frames = frames.detach_rot()
        groups = group_frames(frames, angles, aatype, tables)
        atom14 = atom14_positions(groups, aatype, tables)
        atom37, atom37_mask = atom14_to_atom37(atom14, aatype)
        return {"frames_rot": torch.stack(out_rot), "frames_trans": torch.stack(out_trans),
                "angles": torch.stack(out_angles), "unnormalized_angles": torch.stack(out_raw), "single": s,
                "group_rot": groups.rot, "group_trans": groups.trans, "atom14": atom14,
                "atom37": atom37, "atom37_mask": atom37_mask * mask[..., None]}
