"""The training objective: noise the data (forward process) and regress the network's target.

Epsilon prediction, Ho et al. 2020 eq. 14 (L_simple):  || eps - eps_theta(sqrt(a_t) x_0 + sqrt(1 - a_t) eps, t) ||^2
v prediction, Salimans & Ho 2022 (arXiv:2202.00512, sec. 4):  v = sqrt(a_t) eps - sqrt(1 - a_t) x_0
where a_t = alpha_bar_t. Both losses are a plain mean over all pixels (Ho et al.'s L_simple), unless min-SNR-gamma
weighting is asked for (Hang et al. 2023, arXiv:2303.09556, sec. 3.4): with SNR_t = a_t / (1 - a_t), each sample's
mean squared error is weighted by min(SNR_t, gamma) / SNR_t for epsilon (the x0-loss weight min(SNR, gamma)
divided by the SNR that converts it to an epsilon loss) and min(SNR_t, gamma) / (SNR_t + 1) for v.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastddpm.diffusion.continuous import ContinuousProcess, continuous_loss
from fastddpm.diffusion.schedule import NoiseSchedule


def _per_sample(values_T: torch.Tensor, t_B: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather schedule values at t and shape them (B, 1, 1, 1) to broadcast over images."""
    return values_T[t_B].reshape(-1, *([1] * (ndim - 1)))


def q_sample(schedule: NoiseSchedule, x0: torch.Tensor, t_B: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps  (Ho et al. eq. 4)."""
    a = _per_sample(schedule.sqrt_alpha_bar, t_B, x0.ndim)
    s = _per_sample(schedule.sqrt_one_minus_alpha_bar, t_B, x0.ndim)
    return a * x0 + s * noise


def training_target(
    schedule: NoiseSchedule, prediction: str, x0: torch.Tensor, t_B: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    if prediction == "epsilon":
        return noise
    if prediction == "v":
        a = _per_sample(schedule.sqrt_alpha_bar, t_B, x0.ndim)
        s = _per_sample(schedule.sqrt_one_minus_alpha_bar, t_B, x0.ndim)
        return a * noise - s * x0
    raise ValueError(f"unknown prediction {prediction!r}: choose 'epsilon' or 'v'")


def min_snr_weights(schedule: NoiseSchedule, prediction: str, t_B: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-sample loss weights (B,) of min-SNR-gamma weighting, in float32."""
    snr = (schedule.sqrt_alpha_bar[t_B] / schedule.sqrt_one_minus_alpha_bar[t_B]).float() ** 2
    if prediction == "epsilon":
        return (gamma / snr).clamp(max=1.0)  # = min(SNR, gamma) / SNR, with no 0/0 where SNR underflows
    if prediction == "v":
        return snr.clamp(max=gamma) / (snr + 1.0)
    raise ValueError(f"unknown prediction {prediction!r}: choose 'epsilon' or 'v'")


def diffusion_loss(model, schedule: NoiseSchedule, prediction: str, x0: torch.Tensor, t_B: torch.Tensor,
                   noise: torch.Tensor, min_snr_gamma: float | None = None,
                   y_B: torch.Tensor | None = None) -> torch.Tensor:
    """Mean-squared error between the model output at (x_t, t) and the target, in float32; with min_snr_gamma,
    each sample's error is weighted first (see the module docstring). y_B: class ids of a conditional model.
    A continuous objective (EDM, flow: `schedule` is its process) takes t_B as its standard normal draws."""
    if isinstance(schedule, ContinuousProcess):
        return continuous_loss(model, schedule, x0, t_B, noise, y_B)
    x_t = q_sample(schedule, x0, t_B, noise)
    out = model(x_t, t_B) if y_B is None else model(x_t, t_B, y_B)
    target = training_target(schedule, prediction, x0, t_B, noise)
    if min_snr_gamma is None:
        return F.mse_loss(out.float(), target.float())
    per_sample = (out.float() - target.float()).pow(2).flatten(1).mean(1)  # (B,)
    return (per_sample * min_snr_weights(schedule, prediction, t_B, min_snr_gamma)).mean()


def predict_eps_and_x0(schedule: NoiseSchedule, prediction: str, model_out: torch.Tensor, x_t: torch.Tensor,
                       t_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert the network output into (eps_hat, x0_hat) at x_t, for either parameterisation."""
    a = _per_sample(schedule.sqrt_alpha_bar, t_B, x_t.ndim)
    s = _per_sample(schedule.sqrt_one_minus_alpha_bar, t_B, x_t.ndim)
    if prediction == "epsilon":
        eps = model_out
        x0 = (x_t - s * eps) / a
    elif prediction == "v":
        # x_0 = a x_t - s v,  eps = s x_t + a v   (Salimans & Ho 2022, since a^2 + s^2 = 1)
        x0 = a * x_t - s * model_out
        eps = s * x_t + a * model_out
    else:
        raise ValueError(f"unknown prediction {prediction!r}: choose 'epsilon' or 'v'")
    return eps, x0
