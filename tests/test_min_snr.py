"""Min-SNR-gamma loss weighting (Hang et al. 2023): the weights against the formula, the weighted loss against a
hand computation, no change when off, the fast step equal to the plain one, and the config check."""

import copy

import pytest
import torch

from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.device import resolve_precision
from fastddpm.diffusion import diffusion_loss, make_schedule, min_snr_weights
from fastddpm.models import UNet
from fastddpm.trainer.ema import EMA
from fastddpm.trainer.step import TrainStep, make_optimizer, train_step

CPU = torch.device("cpu")


class _Const(torch.nn.Module):
    """A 'model' whose output is a fixed tensor, so the loss is computable by hand."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x, t):
        return self.out


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_weights_follow_the_formula(kind):
    s = make_schedule(kind, 1000)
    t = torch.tensor([0, 10, 100, 300, 500, 999])
    ab = s.float64("alpha_bar")[t]
    snr = ab / (1 - ab)
    gamma = 5.0
    torch.testing.assert_close(min_snr_weights(s, "epsilon", t, gamma).double(),
                               torch.minimum(snr, torch.tensor(gamma, dtype=torch.float64)) / snr, rtol=1e-5, atol=0)
    torch.testing.assert_close(min_snr_weights(s, "v", t, gamma).double(),
                               torch.minimum(snr, torch.tensor(gamma, dtype=torch.float64)) / (snr + 1),
                               rtol=1e-5, atol=0)
    w = min_snr_weights(s, "epsilon", t, gamma)
    assert w[0] < 1e-2 and w[-1] == 1.0  # low noise (high SNR) is down-weighted; high noise keeps weight 1
    with pytest.raises(ValueError, match="prediction"):
        min_snr_weights(s, "x0", t, gamma)


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
def test_weighted_loss_is_the_weighted_mean_of_per_sample_errors(prediction):
    s = make_schedule("linear", 1000)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.rand(4, 1, 8, 8, generator=g) * 2 - 1, torch.randn(4, 1, 8, 8, generator=g)
    out = torch.randn(4, 1, 8, 8, generator=g)
    t = torch.tensor([5, 200, 600, 990])
    loss = diffusion_loss(_Const(out), s, prediction, x0, t, noise, min_snr_gamma=5.0)
    from fastddpm.diffusion import training_target

    per_sample = ((out - training_target(s, prediction, x0, t, noise)) ** 2).mean(dim=(1, 2, 3))
    expected = (per_sample * min_snr_weights(s, prediction, t, 5.0)).mean()
    torch.testing.assert_close(loss, expected)
    plain = diffusion_loss(_Const(out), s, prediction, x0, t, noise)
    torch.testing.assert_close(plain, per_sample.mean())  # off = the seed's plain mean, unchanged
    if prediction == "epsilon":  # a gamma above every SNR weights nothing: the plain loss again
        torch.testing.assert_close(diffusion_loss(_Const(out), s, prediction, x0, t, noise, min_snr_gamma=1e9), plain)


def test_fast_step_equals_plain_step_with_min_snr():
    from conftest import read_fmnist

    from fastddpm.trainer.batches import ResidentBatches

    cfg = get_preset("tiny").model
    cfg.image_channels, cfg.image_size = 1, 28
    torch.manual_seed(0)
    plain = UNet(cfg)
    fast = copy.deepcopy(plain)
    schedule = make_schedule("linear", 1000)
    batch = ResidentBatches(read_fmnist(32)[0], batch_size=16, num_timesteps=1000, seed=3, device=CPU).get(0)
    fp32 = resolve_precision("fp32", CPU)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
    loss_plain = train_step(plain, opt_plain, None, schedule, "epsilon", batch, fp32, 1.0, min_snr_gamma=5.0)
    opt_fast = make_optimizer(fast, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=True,
                              capturable=False)
    step = TrainStep(model=fast, optimizer=opt_fast, scaler=None, ema=EMA(fast, 0.999), schedule=schedule,
                     prediction="epsilon", precision=fp32, grad_clip=1.0, device=CPU, min_snr_gamma=5.0)
    loss_fast = step([batch], lr=1e-3, step=0)
    assert abs(loss_fast.item() - loss_plain.item()) <= 1e-6
    unweighted = train_step(copy.deepcopy(fast), torch.optim.SGD(fast.parameters(), lr=0.0), None, schedule,
                            "epsilon", batch, fp32, None)
    assert loss_plain.item() < unweighted.item()  # weights are <= 1, and < 1 for low-noise timesteps
    for pp, pf in zip(plain.parameters(), fast.parameters()):
        torch.testing.assert_close(pf, pp, rtol=0, atol=1e-6)


def test_config_default_off_and_validated():
    assert get_preset("seed-1layer").train.min_snr_gamma is None
    assert apply_overrides(get_preset("tiny"), {"train.min_snr_gamma": "5"}).train.min_snr_gamma == 5.0
    with pytest.raises(ConfigError, match="min_snr_gamma=0.0 must be > 0"):
        apply_overrides(get_preset("tiny"), {"train.min_snr_gamma": 0})
