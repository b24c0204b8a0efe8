"""The objective: targets (epsilon / v), Min-SNR weights, prior preservation batches and loss."""
from __future__ import annotations

import torch

from apps.diffusion.components import build_noise_scheduler
from apps.diffusion.config import NoiseConfig
from apps.diffusion.data import LatentCaptionDataset, PriorPreservationDataset, collate_prior
from apps.diffusion.loss import DiffusionTrainModel


class EchoUNet(torch.nn.Module):
    """Predicts a fixed multiple of its input: enough to check what the loss compares it with."""
    dtype = torch.float32

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x, t, hidden):
        return type("Out", (), {"sample": x * self.scale})()


class TextStub(torch.nn.Module):
    def forward(self, ids):
        return (ids.float().unsqueeze(-1),)


def make(ncfg: NoiseConfig, **kw) -> DiffusionTrainModel:
    return DiffusionTrainModel(EchoUNet(), TextStub(), build_noise_scheduler(ncfg), ncfg,
                               empty_prompt_ids=torch.zeros(4, dtype=torch.long), **kw)


def test_epsilon_and_v_targets_and_min_snr_weights():
    torch.manual_seed(0)
    x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    t = torch.tensor([10, 500, 990])
    ids = torch.ones(3, 4, dtype=torch.long)
    for prediction in ("epsilon", "v_prediction"):
        ncfg = NoiseConfig(prediction_type=prediction, snr_gamma=5.0)
        model = make(ncfg)
        a = model.alphas_cumprod[t].view(3, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        target = noise if prediction == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
        snr = (a / (1 - a)).flatten()
        weight = snr.clamp(max=5.0) / (snr if prediction == "epsilon" else snr + 1)
        expected = (((0.5 * noisy - target) ** 2).mean(dim=(1, 2, 3)) * weight).mean()
        got = model(x0, ids, timesteps=t, noise=noise)
        torch.testing.assert_close(got, expected)
        # v-prediction target agrees with diffusers' own scheduler
        if prediction == "v_prediction":
            torch.testing.assert_close(target, model.noise_scheduler.get_velocity(x0, noise, t))


def test_prior_preservation_batches_and_loss():
    inst = LatentCaptionDataset(torch.randn(3, 2, 4, 4), torch.full((3, 4), 7), scaling_factor=1.0)
    prior = LatentCaptionDataset(torch.randn(5, 2, 4, 4), torch.full((5, 4), 9), scaling_factor=1.0)
    data = PriorPreservationDataset(inst, prior)
    assert len(data) == 5
    batch = collate_prior([data[i] for i in range(4)])
    # instances first, then as many class images; flags say which is which
    assert batch["latents"].shape == (8, 2, 4, 4)
    assert batch["is_prior"].tolist() == [False] * 4 + [True] * 4
    assert (batch["prompt_ids"][:4] == 7).all() and (batch["prompt_ids"][4:] == 9).all()
    torch.testing.assert_close(batch["latents"][3], inst.latents[0])  # wraps around the 3 instances

    model = make(NoiseConfig(), prior_loss_weight=0.3)
    noise, t = torch.randn(8, 2, 4, 4), torch.full((8,), 400)
    per = torch.stack([model(batch["latents"][i:i + 1], batch["prompt_ids"][i:i + 1], timesteps=t[:1],
                             noise=noise[i:i + 1]) for i in range(8)])
    got = model(batch["latents"], batch["prompt_ids"], batch["is_prior"], timesteps=t, noise=noise)
    torch.testing.assert_close(got, per[:4].mean() + 0.3 * per[4:].mean())


def test_caption_dropout_uses_the_empty_prompt_only_in_training():
    torch.manual_seed(0)  # dropout 0.999 on 2 captions: fixed so the test never flakes
    model = make(NoiseConfig(), caption_dropout=0.999)
    seen = []
    model.text_encoder.forward = lambda ids: (seen.append(ids.clone()) or (ids.float().unsqueeze(-1),))
    ids = torch.ones(2, 4, dtype=torch.long)
    model.train()(torch.randn(2, 2, 4, 4), ids)
    model.eval()(torch.randn(2, 2, 4, 4), ids)
    assert (seen[0] == 0).all() and (seen[1] == 1).all()
