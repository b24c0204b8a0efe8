"""Rigid transforms (rotation + translation) on tensors with any leading shape.

A residue's backbone frame, a side-chain group's frame and the structure module's per-residue
update are all `Rigid`s: `x_global = R @ x_local + t`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rigid:
    rot: torch.Tensor    # [..., 3, 3]
    trans: torch.Tensor  # [..., 3]

    @staticmethod
    def identity(shape: tuple[int, ...], device=None, dtype=torch.float32) -> "Rigid":
        rot = torch.eye(3, device=device, dtype=dtype).expand(*shape, 3, 3).clone()
        return Rigid(rot, torch.zeros(*shape, 3, device=device, dtype=dtype))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Local -> global for points x [..., 3] (broadcast against the frame's shape)."""
        return torch.einsum("...ij,...j->...i", self.rot, x) + self.trans

    def invert_apply(self, x: torch.Tensor) -> torch.Tensor:
        """Global -> local."""
        return torch.einsum("...ji,...j->...i", self.rot, x - self.trans)

    def compose(self, other: "Rigid") -> "Rigid":
        """self ∘ other: first other, then self."""
        return Rigid(self.rot @ other.rot, self.apply(other.trans))

    def invert(self) -> "Rigid":
        rot_t = self.rot.transpose(-1, -2)
        return Rigid(rot_t, -torch.einsum("...ij,...j->...i", rot_t, self.trans))

    def unsqueeze(self, dim: int) -> "Rigid":
        """Insert an axis at `dim`, counted among the frame's own (leading) dims."""
        if dim < 0:
            return Rigid(self.rot.unsqueeze(dim - 2), self.trans.unsqueeze(dim - 1))
        return Rigid(self.rot.unsqueeze(dim), self.trans.unsqueeze(dim))

    def scale_translation(self, factor: float) -> "Rigid":
        return Rigid(self.rot, self.trans * factor)

    def detach_rot(self) -> "Rigid":
        """AlphaFold stops gradients through the rotations between structure-module layers."""
        return Rigid(self.rot.detach(), self.trans)

    def __getitem__(self, index) -> "Rigid":
        """Index the frame dims (the trailing 3x3 / 3 are kept): frames[..., k], frames[0]."""
        index = index if isinstance(index, tuple) else (index,)
        return Rigid(self.rot[index + (slice(None), slice(None))], self.trans[index + (slice(None),)])

    @property
    def shape(self) -> torch.Size:
        return self.trans.shape[:-1]


def from_3_points(p_neg_x: torch.Tensor, origin: torch.Tensor, p_xy: torch.Tensor, eps: float = 1e-8) -> Rigid:
    """The frame at `origin` whose x axis points from `p_neg_x` to `origin` and whose xy plane holds
    `p_xy` (positive y side): Gram-Schmidt, as AlphaFold builds backbone and side-chain frames."""
    e0 = origin - p_neg_x
    e0 = e0 / torch.sqrt((e0 ** 2).sum(-1, keepdim=True) + eps)
    e1 = p_xy - origin
    e1 = e1 - e0 * (e0 * e1).sum(-1, keepdim=True)
    e1 = e1 / torch.sqrt((e1 ** 2).sum(-1, keepdim=True) + eps)
    e2 = torch.cross(e0, e1, dim=-1)
    return Rigid(torch.stack([e0, e1, e2], dim=-1), origin)


def backbone_frame(n: torch.Tensor, ca: torch.Tensor, c: torch.Tensor) -> Rigid:
    """A residue's backbone frame: origin CA, x axis along CA->C, N in the xy plane."""
    return from_3_points(2 * ca - c, ca, n)


def rot_x(sin: torch.Tensor, cos: torch.Tensor) -> Rigid:
    """Rotation about the x axis by the angle with this sine and cosine (shape [...])."""
    zero, one = torch.zeros_like(sin), torch.ones_like(sin)
    rot = torch.stack([one, zero, zero, zero, cos, -sin, zero, sin, cos], dim=-1).reshape(*sin.shape, 3, 3)
    return Rigid(rot, torch.zeros(*sin.shape, 3, dtype=sin.dtype, device=sin.device))


def quaternion_update(update: torch.Tensor) -> Rigid:
    """AlphaFold's backbone update: 6 numbers -> (rotation from the quaternion (1, b, c, d),
    normalised; translation)."""
    b, c, d = update[..., 0], update[..., 1], update[..., 2]
    a = torch.ones_like(b)
    norm = torch.sqrt(1 + b * b + c * c + d * d)
    a, b, c, d = a / norm, b / norm, c / norm, d / norm
    rot = torch.stack([
        a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c),
        2 * (b * c + a * d), a * a - b * b + c * c - d * d, 2 * (c * d - a * b),
        2 * (b * d - a * c), 2 * (c * d + a * b), a * a - b * b - c * c + d * d,
    ], dim=-1).reshape(*b.shape, 3, 3)
    return Rigid(rot, update[..., 3:])


def torsion_in_frame(frame: Rigid, point: torch.Tensor) -> torch.Tensor:
    """The angle of `point` about the frame's x axis, measured from its y axis: atan2(z, y)."""
    local = frame.invert_apply(point)
    return torch.atan2(local[..., 2], local[..., 1])
