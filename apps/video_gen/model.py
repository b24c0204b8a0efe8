"""The video diffusion model and its rectified-flow objective.

The transformer is diffusers' `WanTransformer3DModel` (3D RoPE, AdaLN-modulated blocks with
cross-attention to the prompt), built tiny from the config or loaded from a local directory.
`VideoFlowModel` wraps it with the text encoder; its forward is the training loss, so `fit`
trains it with any plugin (DDP, ZeRO-2, FSDP2):

    t ~ logit-normal, shifted by sqrt(tokens / base)      x_t = (1 - t) x0 + t noise
    loss = mean over samples of MSE(v_theta(x_t, t, text), noise - x0)

`velocity_tokens` runs the transformer's own submodules in the order of its forward, but returns
the output in token layout, so that under sequence parallelism each rank computes only its own
tokens' outputs and loss (Ulysses attention inside). The loss is compared in token layout; the
MSE is the same as in video layout.

Sequence parallelism (data x sequence, `sequence_parallel.SequenceLayout`): the ranks of one SP
group hold the same micro-batch (the data is dealt to the dp groups, and the group's ranks draw
the same timesteps, noise and caption dropout), each computes only its 1/sp of the tokens and
returns sp x the loss of its shard, so the group's mean is the micro-batch's loss. The plugin's
gradient average over every rank is then the data-parallel average over the dp groups of the
full-sequence gradients: exactly the gradient of one process on the same global batch.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.embeddings import PixArtAlphaTextProjection
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.diffusion import (drop_captions, flow_interpolate, flow_velocity_target, logit_normal_timesteps,
                               resolution_shift, shift_timesteps, uniform_timesteps)
from phalanx.sequence import token_shard

from . import sequence_parallel
from .config import FlowConfig, ModelConfig
from .first_frame import condition_channels, first_frame_condition, first_frame_mask, predicted_elements

TIME_SCALE = 1000.0  # Wan embeds timesteps on the 0..1000 scale


# Text encoders whose padding states are zeroed before cross-attention, as Wan's pipelines do (they
# cut T5's states at the prompt's length and pad with zeros). Not the from-scratch CLIP: it is causal,
# and its padding positions each summarise the whole caption (see `PooledTextConditioning`).
ZERO_PADDING_TYPES = ("t5", "umt5", "mt5")

POSITION_CHANNELS = 3  # (frame, row, column) planes: see `position_planes`
MOTION_CHANNELS = 2    # (frame x row, frame x column) planes: see `position_planes`


def build_transformer(mcfg: ModelConfig, channels: int, text_dim: int):
    """A tiny Wan transformer; with `mcfg.position_channels` it takes 3 more input channels than it
    outputs (the position planes, see `VideoFlowModel`), with `mcfg.i2v` channels + 1 more (the clean
    first frame and its mask, `first_frame.py`)."""
    from diffusers import WanTransformer3DModel

    extra = (POSITION_CHANNELS if mcfg.position_channels else 0) + (MOTION_CHANNELS if mcfg.motion_channels else 0)
    extra += condition_channels(channels) if mcfg.i2v else 0
    return WanTransformer3DModel(patch_size=tuple(mcfg.patch_size), num_attention_heads=mcfg.num_heads,
                                 attention_head_dim=mcfg.head_dim, in_channels=channels + extra, out_channels=channels,
                                 text_dim=text_dim, freq_dim=mcfg.freq_dim, ffn_dim=mcfg.ffn_dim,
                                 num_layers=mcfg.num_layers, rope_max_seq_len=256)


def load_pretrained_transformer(directory: str, text_dim: int, patch_size: list[int]):
    """A diffusers WanTransformer3DModel from `model.transformer_dir` (or its transformer/ subfolder),
    offline, checked against the text encoder and model.patch_size: one ConfigError naming the fix."""
    from diffusers import WanTransformer3DModel

    from phalanx.config import ConfigError

    from .config import resolve

    path = resolve(directory)
    if not (path / "config.json").is_file() and (path / "transformer" / "config.json").is_file():
        path = path / "transformer"
    key = f"config 'model.transformer_dir'={directory!r}"
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} holds no config.json; point it at a diffusers WanTransformer3DModel "
                          "directory (saved with save_pretrained) or a Wan pipeline directory with transformer/")
    try:
        transformer = WanTransformer3DModel.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{key}: could not load a WanTransformer3DModel from {path} ({exc})") from exc
    c = transformer.config
    if c.text_dim != text_dim:
        raise ConfigError(f"{key}: the transformer reads text states of {c.text_dim} dims but the text encoder gives "
                          f"{text_dim}; set model.text_encoder_dir to the encoder it was trained with")
    if list(c.patch_size) != list(patch_size):
        raise ConfigError(f"{key}: its patch size is {list(c.patch_size)}; set model.patch_size={list(c.patch_size)} "
                          "(the buckets are checked against it)")
    return transformer


class PooledTextConditioning(ModelMixin, ConfigMixin):
    """The prompt, pooled, added to Wan's time embedding: global conditioning of every AdaLN
    modulation (shift, scale and gate of each block and of the output), as SD3 and Flux add their
    pooled text embedding to the timestep embedding. Wan itself hears the prompt only through
    cross-attention; this module is what the library lacks (`model.pooled_text`).

    The pool is the mean of the text encoder's states over all positions (the CLIP encoder is
    causal, so the padding positions after the caption each summarise the whole caption), or with
    `tokens` (`model.pooled_text: flat`) the states flattened: the mean dilutes a single word (the
    direction word changed the mean by 0.85 on a norm-8 state, its own position by 9.0), but flat has
    text_dim x max_tokens inputs (4096 x 512 with UMT5-XXL); with `queries` (`model.pooled_text:
    attention`) learned queries pick positions by attention, text_dim x queries inputs. With
    `position_planes` it also gives a prompt-dependent position embedding (`model.prompt_position`)."""

    @register_to_config
    def __init__(self, text_dim: int, dim: int, tokens: int = 0, position_planes: int = 0, queries: int = 0):
        super().__init__()
        if tokens and queries:
            raise ValueError("PooledTextConditioning pools flat (tokens) or by attention (queries), not both")
        width = text_dim * max(tokens, queries, 1)
        self.query = nn.Parameter(torch.randn(queries, text_dim) * text_dim ** -0.5) if queries else None
        self.proj = PixArtAlphaTextProjection(width, dim, act_fn="silu")
        self.position = nn.Linear(width, position_planes * dim) if position_planes else None

    def pool(self, text_states: torch.Tensor) -> torch.Tensor:
        """[B, L, text_dim] -> [B, width]: the mean over positions; the states flattened (`tokens`: width
        text_dim x tokens); or (`queries`) each of `queries` learned vectors' attention-weighted mean of the
        states, concatenated: width text_dim x queries, whatever the prompt length (`model.pooled_text: attention`)."""
        if self.query is not None:
            scores = torch.einsum("qd,bld->bql", self.query.to(text_states.dtype), text_states)
            weights = (scores / text_states.shape[-1] ** 0.5).softmax(dim=-1)
            return torch.einsum("bql,bld->bqd", weights, text_states).flatten(1)
        return text_states.flatten(1) if self.config.tokens else text_states.mean(dim=1)

    def forward(self, text_states: torch.Tensor, planes: torch.Tensor | None = None):
        """[B, L, text_dim] (the text encoder's states) -> [B, dim], added to the time embedding; with
        `planes`, also the prompt-dependent position embedding (`position_embedding`), from one pool.
        One forward for both, so that every parameter is read inside this module's forward (Gemini
        gathers a module's chunks around its forward)."""
        pooled = self.pool(text_states)
        if planes is None:
            return self.proj(pooled)
        return self.proj(pooled), self.position_embedding(pooled, planes)

    def position_embedding(self, pooled: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
        """A prompt-dependent absolute position embedding [B, tokens, dim]: sum_k plane_k(token) U_k(prompt),
        U = a linear map of the pooled prompt, planes [B, tokens, k] (each token's mean plane values).

        Why (issue 16): what a direction word changes in the clip is a fixed spatio-temporal pattern
        (~ -frame x column for "left"); through cross-attention or AdaLN, Wan must learn it as a product
        of two learned factors (word x position), which 600 steps did not find even when trained only at
        high noise. Here it is linear in the weights: a regression the optimiser solves at once."""
        u = self.position(pooled).unflatten(1, (planes.shape[-1], -1))   # [B, k, dim] (`pooled`: see pool)
        return torch.einsum("blk,bkd->bld", planes.to(u.dtype), u)


def default_zero_padding(text_encoder: nn.Module, pooled_text: PooledTextConditioning | None) -> bool:
    """Whether the padding states are zeroed (`model.zero_text_padding: null`): always for the T5 family
    (Wan's own encoders); for other encoders (the from-scratch CLIP) when there is no pooled-text module,
    i.e. the prompt reaches Wan through cross-attention only, as in WanPipeline. With the pooled module the
    CLIP's padding states are kept: its mean pool reads them (the documented toy configs)."""
    kind = getattr(getattr(text_encoder, "config", None), "model_type", None)
    return kind in ZERO_PADDING_TYPES or pooled_text is None


def velocity_skip(t: torch.Tensor, data_std: float) -> torch.Tensor:
    """c(t) = Cov(v, x_t) / Var(x_t) for x0 ~ N(0, s^2), noise ~ N(0, 1), x_t = (1 - t) x0 + t noise,
    v = noise - x0: (t - (1 - t) s^2) / ((1 - t)^2 s^2 + t^2); 1 at t = 1, -1 at t = 0."""
    s2 = data_std ** 2
    return (t - (1 - t) * s2) / ((1 - t) ** 2 * s2 + t ** 2)


def position_planes(shape: tuple[int, ...], device=None, dtype=torch.float32, motion: bool = False) -> torch.Tensor:
    """[B, 3, F, H, W]: each pixel's frame, row and column, scaled to (-1, 1) at the pixel centres.

    Wan knows positions only through 3D RoPE in self-attention, which is relative: from pure noise
    (high t) a token cannot tell the first frame from the last or the left edge from the right, so
    what the prompt's motion implies there ("moving left": bright on the right early, on the left
    late) cannot be predicted from the word alone. These planes, concatenated to the input, give
    every token its absolute place in the clip (`model.position_channels`).

    With `motion`, [B, 5, F, H, W]: also frame x row and frame x column (`model.motion_channels`).
    What a direction word changes in the clip is exactly such a product: the conditional mean of
    "moving left" minus the mean over directions is ~ -frame x column (bright on the right early, on
    the left late). The product planes alone did not make the word learned (issue 16's probe); with
    `PooledTextConditioning.position_embedding` they make that pattern linear in the weights."""
    b, _, f, h, w = shape

    def axis(n: int) -> torch.Tensor:
        return (torch.arange(n, device=device, dtype=dtype) + 0.5) / n * 2 - 1

    grid = torch.stack(torch.meshgrid(axis(f), axis(h), axis(w), indexing="ij"))
    if motion:
        grid = torch.cat([grid, grid[:1] * grid[1:2], grid[:1] * grid[2:3]])
    return grid.unsqueeze(0).expand(b, -1, -1, -1, -1)


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, tokens, pt*ph*pw*C], the inverse of Wan's output unpatchify."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, (f // pt) * (h // ph) * (w // pw), -1)


def unpatchify(tokens: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    b, c, f, h, w = shape
    pt, ph, pw = patch
    x = tokens.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, c)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, c, f, h, w)


class VideoFlowModel(nn.Module):
    """Transformer + text encoder; `forward(video, prompt_ids, t?, noise?)` -> rectified-flow loss."""

    def __init__(self, transformer: nn.Module, text_encoder: nn.Module, empty_prompt_ids: torch.Tensor,
                 pad_token_id: int, fcfg: FlowConfig, caption_dropout: float = 0.0,
                 pooled_text: PooledTextConditioning | None = None, zero_padding: bool | None = None,
                 i2v: bool = False):
        super().__init__()
        self.transformer, self.text_encoder, self.pooled_text = transformer, text_encoder, pooled_text
        self.fcfg, self.caption_dropout, self.pad_token_id = fcfg, caption_dropout, pad_token_id
        self.register_buffer("empty_prompt_ids", empty_prompt_ids.reshape(1, -1).clone(), persistent=False)
        self._processors = sequence_parallel.install(transformer)
        self._sp_group = None
        self.i2v = i2v  # first-frame conditioning (`first_frame.py`): its channels come right after x_t
        extra = transformer.config.in_channels - transformer.config.out_channels
        extra -= condition_channels(transformer.config.out_channels) if i2v else 0
        if extra not in (0, POSITION_CHANNELS, POSITION_CHANNELS + MOTION_CHANNELS):
            raise ValueError(f"the transformer takes {transformer.config.in_channels} input channels and gives "
                             f"{transformer.config.out_channels}: expected equal counts, or {POSITION_CHANNELS} more "
                             f"inputs for the position planes (model.position_channels), or "
                             f"{POSITION_CHANNELS + MOTION_CHANNELS} with the motion planes (model.motion_channels)")
        self.position_channels = extra > 0
        self.motion_channels = extra == POSITION_CHANNELS + MOTION_CHANNELS
        self.text_frozen = False
        self.zero_padding = default_zero_padding(text_encoder, pooled_text) if zero_padding is None else zero_padding

    def freeze_text_encoder(self) -> "VideoFlowModel":
        """Fixed text encoder weights (`model.freeze_text_encoder`): no gradients (the optimizer skips
        them), eval mode (no dropout) and no autograd graph through it."""
        self.text_encoder.requires_grad_(False).eval()
        self.text_frozen = True
        return self

    def train(self, mode: bool = True) -> "VideoFlowModel":
        super().train(mode)
        if self.text_frozen:
            self.text_encoder.eval()
        return self

    @property
    def sp_group(self):
        """The sequence-parallel group while training with sp > 1 (None: off). The attention
        processors keep it too, so activation checkpointing recomputes blocks the same way in backward."""
        return self._sp_group

    @sp_group.setter
    def sp_group(self, group) -> None:
        self._sp_group = group
        self._set_attention_group(group)

    def _set_attention_group(self, group) -> None:
        for proc in self._processors:
            proc.group = group

    def get_output_embeddings(self) -> nn.Module:
        """The module whose own weights the output layer reads without its forward running: the
        transformer's `scale_shift_table` (the final modulation, see `velocity_tokens`). Gemini gathers
        such a module's chunks for the whole step from the first forward on (it asks every module for
        its output embeddings); it would otherwise learn them only after that forward."""
        return self.transformer

    @property
    def device(self) -> torch.device:
        """Where the weights are (the run's device once `fit` placed the model): inputs go here."""
        return self.empty_prompt_ids.device

    @property
    def patch(self) -> tuple[int, int, int]:
        return tuple(self.transformer.config.patch_size)

    def encode_prompts(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """[B, L, text_dim]: the text encoder's states; a T5-family encoder's padding states zeroed
        (`zero_padding`), so cross-attention reads exactly what Wan's pipelines give it."""
        mask = (prompt_ids != self.pad_token_id).long()
        with torch.no_grad() if self.text_frozen else contextlib.nullcontext():
            states = self.text_encoder(input_ids=prompt_ids, attention_mask=mask).last_hidden_state
        return states * mask.unsqueeze(-1).to(states.dtype) if self.zero_padding else states

    def tokens(self, shape: tuple[int, ...]) -> int:
        pt, ph, pw = self.patch
        return (shape[-3] // pt) * (shape[-2] // ph) * (shape[-1] // pw)

    def sample_timesteps(self, batch: int, shape: tuple[int, ...], device) -> torch.Tensor:
        f = self.fcfg
        t = logit_normal_timesteps(batch, f.logit_mean, f.logit_std, device=device) if f.timesteps == "logit_normal" \
            else uniform_timesteps(batch, device=device)
        if f.high_noise_share > 0:
            high = logit_normal_timesteps(batch, f.high_noise_logit_mean, f.high_noise_logit_std, device=device)
            t = torch.where(torch.rand(batch, device=device) < f.high_noise_share, high, t)
        if f.shift_base_tokens:
            t = shift_timesteps(t, resolution_shift(self.tokens(shape), f.shift_base_tokens, f.max_shift))
        return t

    def velocity_tokens(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, group=None,
                        cond: torch.Tensor | None = None) -> torch.Tensor:
        """v_theta(x_t, t) in token layout: all tokens, or this rank's shard when `group` is given.
        `cond` [B, C + 1, F, H, W]: the first-frame condition of an i2v model (`first_frame_condition`)."""
        tr = self.transformer
        dtype = tr.patch_embedding.weight.dtype  # bf16/fp16 when the plugin computes in low precision
        x, text = x.to(dtype), text.to(dtype)
        cos, sin = tr.rope(x)
        if self.i2v:
            if cond is None:
                raise ValueError("this model is conditioned on the first frame (model.i2v): pass the clip's first "
                                 "frame (VideoPipeline(..., first_frame=...))")
            x = torch.cat([x, cond.to(dtype)], dim=1)
        if self.position_channels:
            planes = position_planes(tuple(x.shape), x.device, x.dtype, self.motion_channels)
            x = torch.cat([x, planes], dim=1)
        h = tr.patch_embedding(x).flatten(2).transpose(1, 2)
        pooled_emb = None
        if self.pooled_text is not None and self.pooled_text.position is not None:
            k = self.pooled_text.config.position_planes
            planes = position_planes((x.shape[0], 0, *x.shape[2:]), x.device, x.dtype, motion=k > POSITION_CHANNELS)
            per_token = patchify(planes, self.patch).unflatten(-1, (-1, k)).mean(2)          # [B, tokens, k]
            pooled_emb, position = self.pooled_text(text, per_token)
            h = h + position.to(h.dtype)
        elif self.pooled_text is not None:
            pooled_emb = self.pooled_text(text)
        embedder = tr.condition_embedder
        temb, tproj, text_h, _ = embedder(t * TIME_SCALE, text, None)
        if pooled_emb is not None:
            temb = temb + pooled_emb.to(temb.dtype)
            tproj = embedder.time_proj(embedder.act_fn(temb))
        text = text_h
        tproj = tproj.unflatten(1, (6, -1))
        if group is not None:
            part = token_shard(h.shape[1], group)
            h, cos, sin = h[:, part], cos[:, part], sin[:, part]
        h = h.contiguous()
        self._set_attention_group(group)
        try:
            for block in tr.blocks:
                if tr.gradient_checkpointing and torch.is_grad_enabled():
                    h = checkpoint(block, h, text, tproj, (cos, sin), use_reentrant=False)
                else:
                    h = block(h, text, tproj, (cos, sin))
        finally:
            self._set_attention_group(self._sp_group)
        shift, scale = (tr.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        h = (tr.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        out = tr.proj_out(h)
        if self.fcfg.skip_data_std > 0:
            skip = patchify(x[:, :out.shape[-1] // math.prod(self.patch)], self.patch)
            if group is not None:
                skip = skip[:, token_shard(skip.shape[1], group)]
            out = out + velocity_skip(t, self.fcfg.skip_data_std).view(-1, 1, 1).to(out.dtype) * skip
        return out

    def velocity(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
                 cond: torch.Tensor | None = None) -> torch.Tensor:
        """v_theta in video layout [B, C, F, H, W] (sampling)."""
        return unpatchify(self.velocity_tokens(x, t, text, cond=cond), tuple(x.shape), self.patch)

    def per_sample_loss(self, video, prompt_ids, t, noise, group=None) -> torch.Tensor:
        """[B]: each sample's squared error on this rank's tokens (all tokens without `group`) divided
        by the sample's total element count, so the shards' values add up to the per-sample MSE. An i2v
        model is given the clean first frame and scored on the other frames only."""
        x_t = flow_interpolate(video, noise, t)
        cond = first_frame_condition(video, video.shape[2]) if self.i2v else None
        pred = self.velocity_tokens(x_t, t, self.encode_prompts(prompt_ids), group, cond=cond)
        target = patchify(flow_velocity_target(video, noise), self.patch)
        mine = token_shard(target.shape[1], group)  # every token without a group
        error = (pred.float() - target.float()[:, mine]).pow(2)
        count = video[0].numel()
        if self.i2v:  # zero weight on the given first frame
            given = first_frame_mask(tuple(video.shape), video.device).expand(-1, video.shape[1], -1, -1, -1)
            error = error * (1 - patchify(given, self.patch))[:, mine]
            count = predicted_elements(tuple(video.shape))
        return error.flatten(1).sum(1) / count

    def forward(self, video: torch.Tensor, prompt_ids: torch.Tensor, t: torch.Tensor | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            prompt_ids = drop_captions(prompt_ids, self.empty_prompt_ids, self.caption_dropout)
        if t is None:
            t = self.sample_timesteps(video.shape[0], tuple(video.shape), video.device)
        if noise is None:
            noise = torch.randn_like(video)
        if self.sp_group is None:
            return self.per_sample_loss(video, prompt_ids, t, noise).mean()
        return self.shard_loss(video, prompt_ids, t, noise)

    def shard_loss(self, video, prompt_ids, t, noise) -> torch.Tensor:
        """sp x the loss of this rank's token shard of the micro-batch its SP group shares: the mean
        over the group is the micro-batch's loss (the shards' squared errors add up to the whole)."""
        # backward must run while sp_group is set: checkpointed blocks recompute their attention there
        group = self.sp_group
        return self.per_sample_loss(video, prompt_ids, t, noise, group=group).mean() * dist.get_world_size(group)

    @contextlib.contextmanager
    def sequence_parallel(self, group):
        previous, self.sp_group = self.sp_group, group
        try:
            yield self
        finally:
            self.sp_group = previous
