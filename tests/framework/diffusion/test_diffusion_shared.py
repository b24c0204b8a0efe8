"""phalanx.diffusion: timestep samplers, targets and losses against hand computation, guidance
dropout, and the media writers (files that decoders open)."""
from __future__ import annotations

import math

import pytest
import torch

from phalanx.diffusion import (add_noise, drop_captions, epsilon_or_v_target, fixed_eval_timesteps, flow_interpolate,
                               flow_loss, guided_prediction, logit_normal_timesteps, min_snr_weights, resolution_shift,
                               save_gif, save_video, shift_timesteps, snr)


def test_flow_matching_loss_by_hand():
    x0 = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    noise = torch.tensor([[0.5, 0.0], [1.0, 1.0]])
    t = torch.tensor([0.25, 0.5])
    xt = flow_interpolate(x0, noise, t)
    torch.testing.assert_close(xt, torch.tensor([[0.875, 1.5], [0.5, 0.0]]))
    pred = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # target noise - x0 = [[-0.5, -2], [1, 2]]; squared errors [[0.25, 4], [0, 1]]
    torch.testing.assert_close(flow_loss(pred, x0, noise), torch.tensor([2.125, 0.5]))
    torch.testing.assert_close(flow_loss(pred, x0, noise, weights=torch.tensor([2.0, 0.0])), torch.tensor([4.25, 0.0]))


def test_ddpm_targets_and_min_snr_by_hand():
    a = torch.tensor([0.9, 0.5, 0.1])
    x0, noise, t = torch.ones(3, 2), torch.full((3, 2), 2.0), torch.tensor([0, 1, 2])
    torch.testing.assert_close(add_noise(x0, noise, a, t)[:, 0], a.sqrt() + 2 * (1 - a).sqrt())
    torch.testing.assert_close(epsilon_or_v_target("v_prediction", x0, noise, a, t)[:, 0], 2 * a.sqrt() - (1 - a).sqrt())
    s = snr(a, t)
    torch.testing.assert_close(s, torch.tensor([9.0, 1.0, 1 / 9]))
    torch.testing.assert_close(min_snr_weights(s, 5.0, "epsilon"), torch.tensor([5 / 9, 1.0, 1.0]))
    torch.testing.assert_close(min_snr_weights(s, 5.0, "v_prediction"), torch.tensor([0.5, 0.5, 0.1]))
    with pytest.raises(ValueError, match="prediction_type"):
        epsilon_or_v_target("x0", x0, noise, a, t)


def test_timestep_samplers_and_shift():
    g = torch.Generator().manual_seed(0)
    t = logit_normal_timesteps(20000, generator=g)
    assert 0 < float(t.min()) and float(t.max()) < 1
    assert abs(float(t.median()) - 0.5) < 0.02                      # sigmoid(N(0,1)) is symmetric about 1/2
    assert abs(float(torch.logit(t).std()) - 1.0) < 0.03
    assert resolution_shift(256, 64) == 2.0 and resolution_shift(10_000, 64, max_shift=3.0) == 3.0
    s = shift_timesteps(torch.tensor([0.0, 0.5, 1.0]), 3.0)
    torch.testing.assert_close(s, torch.tensor([0.0, 0.75, 1.0]))   # 3*0.5 / (1 + 2*0.5)
    torch.testing.assert_close(shift_timesteps(t, 1.0), t)
    assert float(shift_timesteps(t, 2.0).mean()) > float(t.mean())   # more noise for more tokens
    torch.testing.assert_close(fixed_eval_timesteps(4), torch.tensor([0.125, 0.375, 0.625, 0.875]))
    with pytest.raises(ValueError, match="positive"):
        resolution_shift(0, 64)


def test_caption_dropout_and_guidance():
    ids, empty = torch.ones(1000, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    torch.manual_seed(0)
    out = drop_captions(ids, empty, 0.25)
    dropped = (out == 0).all(dim=1).float().mean().item()
    assert abs(dropped - 0.25) < 0.05 and ((out == 0).all(1) | (out == 1).all(1)).all()
    assert drop_captions(ids, empty, 0.0) is ids
    c, u = torch.tensor([2.0]), torch.tensor([1.0])
    assert guided_prediction(c, u, 1.0).item() == 2.0 and guided_prediction(c, u, 3.0).item() == 4.0


def test_video_files_decode(tmp_path):
    import av
    from PIL import Image

    video = torch.linspace(-1, 1, 3 * 5 * 6 * 7).reshape(3, 5, 6, 7)  # odd width: padded for H.264
    mp4, gif = save_video(video, tmp_path / "a.mp4", fps=4), save_gif(video, tmp_path / "a.gif", fps=4, scale=2)
    with av.open(str(mp4)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (6, 8, 3)
    im = Image.open(gif)
    assert im.n_frames == 5 and im.size == (14, 12)
    with pytest.raises(ValueError, match="channels, frames"):
        save_gif(torch.zeros(3, 4, 4), tmp_path / "b.gif")
    assert math.isclose(float(video.min()), -1.0)
