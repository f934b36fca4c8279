"""Diffusion math against the papers: golden schedule numbers, the forward process, and samplers checked
against an oracle denoiser whose answer is known exactly."""

import math

import pytest
import torch

from fastddpm.diffusion import (
    cosine_betas,
    ddim_sample,
    trailing_timesteps,
    ddpm_sample,
    linear_betas,
    make_schedule,
    predict_eps_and_x0,
    q_sample,
    sample,
    to_uint8,
    training_target,
)
from fastddpm.rng import ImageNoise


def test_linear_schedule_golden_numbers():
    s = make_schedule("linear", 1000)
    b, ab = s.float64("betas"), s.float64("alpha_bar")
    assert b[0].item() == pytest.approx(1e-4, abs=0, rel=1e-12)
    assert b[-1].item() == pytest.approx(0.02, rel=1e-12)
    # alpha_bar_t = prod(1 - beta_s); values computed independently with numpy in float64.
    assert ab[0].item() == pytest.approx(0.9999, rel=1e-12)
    assert ab[99].item() == pytest.approx(0.89701814567496, rel=1e-10)
    assert ab[499].item() == pytest.approx(0.07858724288177824, rel=1e-10)
    # Ho et al.: at t = T the signal is almost gone, sqrt(alpha_bar_T) ~ 0.0064.
    assert ab[999].item() == pytest.approx(4.035829765375676e-05, rel=1e-9)


def test_cosine_schedule_golden_numbers():
    b = cosine_betas(1000)
    s = make_schedule("cosine", 1000)
    ab = s.float64("alpha_bar")
    assert b[0].item() == pytest.approx(4.128422482196914e-05, rel=1e-9)
    assert b[499].item() == pytest.approx(0.0031458862304780677, rel=1e-9)
    assert b[-1].item() == 0.999  # clipped (Nichol & Dhariwal: beta_t <= 0.999)
    assert ab[0].item() == pytest.approx(0.999958715775178, rel=1e-10)
    assert ab[499].item() == pytest.approx(0.49384359044063775, rel=1e-9)


def test_posterior_variance_matches_eq7():
    s = make_schedule("linear", 1000)
    b, ab = s.float64("betas"), s.float64("alpha_bar")
    t = 500
    expected = (1 - ab[t - 1]) / (1 - ab[t]) * b[t]
    assert s.float64("posterior_variance")[t].item() == pytest.approx(expected.item(), rel=1e-12)
    assert s.float64("posterior_variance")[0].item() == 0.0


def test_q_sample_is_eq4_and_has_unit_variance_at_the_end():
    s = make_schedule("linear", 1000)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(4096, 1, 2, 2, generator=g) * 2 - 1
    noise = torch.randn(x0.shape, generator=g)
    t = torch.full((4096,), 999)
    xt = q_sample(s, x0, t, noise)
    a = math.sqrt(4.035829765375676e-05)
    torch.testing.assert_close(xt, a * x0 + math.sqrt(1 - a * a) * noise, rtol=1e-5, atol=1e-6)
    assert xt.std().item() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
def test_prediction_conversions_round_trip(prediction):
    s = make_schedule("cosine", 1000)
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand(8, 1, 4, 4, generator=g) * 2 - 1
    eps = torch.randn(x0.shape, generator=g)
    t = torch.randint(0, 1000, (8,), generator=g)
    xt = q_sample(s, x0, t, eps)
    target = training_target(s, prediction, x0, t, eps)
    eps_hat, x0_hat = predict_eps_and_x0(s, prediction, target, xt, t)
    torch.testing.assert_close(eps_hat, eps, rtol=1e-4, atol=1e-4)
    # x0 from eps divides by sqrt(alpha_bar), which is tiny at large t: compare where it is well conditioned.
    ok = s.sqrt_alpha_bar[t] > 0.1
    torch.testing.assert_close(x0_hat[ok], x0[ok], rtol=1e-4, atol=1e-4)


def test_trailing_timesteps_trailing():
    ts = trailing_timesteps(1000, 50)
    assert ts[0] == 999 and ts[-1] == 19 and len(ts) == 50
    assert all(a - b == 20 for a, b in zip(ts, ts[1:]))
    assert trailing_timesteps(1000, 1000) == list(range(999, -1, -1))
    with pytest.raises(ValueError, match="steps=0"):
        trailing_timesteps(1000, 0)


class OracleDenoiser(torch.nn.Module):
    """The exact epsilon (or v) for data that is a single image x*: eps = (x_t - sqrt(a) x*) / sqrt(1 - a)."""

    def __init__(self, schedule, x_star, prediction="epsilon"):
        super().__init__()
        self.s, self.x_star, self.prediction = schedule, x_star, prediction

    def forward(self, x_t, t):
        a = self.s.sqrt_alpha_bar[t].view(-1, 1, 1, 1)
        sig = self.s.sqrt_one_minus_alpha_bar[t].view(-1, 1, 1, 1)
        eps = (x_t - a * self.x_star) / sig
        return eps if self.prediction == "epsilon" else a * eps - sig * self.x_star


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
@pytest.mark.parametrize("sampler,steps", [("ddim", 50), ("ddim", 10), ("ddpm", 1000), ("dpmpp-2m", 10),
                                           ("unipc", 10), ("heun", 10)])
def test_samplers_recover_the_data_under_an_oracle(sampler, steps, prediction):
    s = make_schedule("linear", 1000)
    x_star = torch.linspace(-0.9, 0.9, 16).view(1, 1, 4, 4)
    model = OracleDenoiser(s, x_star, prediction)
    x = sample(model, s, (3, 1, 4, 4), sampler=sampler, steps=steps, prediction=prediction, seed=3)
    torch.testing.assert_close(x, x_star.expand(3, -1, -1, -1), rtol=0, atol=2e-3)


def test_ddim_eta1_over_all_steps_equals_ddpm():
    """Song et al. 2021: with eta = 1 on the full sequence, DDIM's update is the DDPM posterior step."""
    torch.manual_seed(0)
    s = make_schedule("linear", 200)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3, padding=1))

    def model(x, t):
        return torch.tanh(net(x)) + 0.001 * t.view(-1, 1, 1, 1)

    a = ddpm_sample(model, s, (2, 1, 6, 6), noise=ImageNoise("cpu", 7, 0, 2), device="cpu")
    b = ddim_sample(model, s, (2, 1, 6, 6), steps=200, eta=1.0, noise=ImageNoise("cpu", 7, 0, 2), device="cpu")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sampling_is_deterministic_for_a_seed():
    s = make_schedule("linear", 100)
    net = torch.nn.Conv2d(1, 1, 3, padding=1)
    model = lambda x, t: net(x)  # noqa: E731
    a = sample(model, s, (2, 1, 8, 8), sampler="ddim", steps=10, eta=0.5, seed=11)
    b = sample(model, s, (2, 1, 8, 8), sampler="ddim", steps=10, eta=0.5, seed=11)
    c = sample(model, s, (2, 1, 8, 8), sampler="ddim", steps=10, eta=0.5, seed=12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_to_uint8_rounds_the_data_range():
    x = torch.tensor([-1.0, -2.0, 0.0, 1.0, 5.0, 127.5 / 127.5 - 1 + 1 / 127.5])
    assert to_uint8(x).tolist() == [0, 0, 128, 255, 255, 128]


def test_linear_betas_validate():
    assert linear_betas(10, 0.1, 0.2).shape == (10,)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("sigmoid", 10)
