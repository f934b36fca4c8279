"""Noise schedules: the betas and the quantities derived from them, computed once in float64.

Notation follows Ho et al. 2020 ("Denoising Diffusion Probabilistic Models", arXiv:2006.11239):
    alpha_t = 1 - beta_t,   alpha_bar_t = prod_{s<=t} alpha_s,
    q(x_t | x_0) = N(sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I)                                   (eq. 4)
Indices here run t = 0 .. T-1 (the paper's t = 1 .. T).
"""

from __future__ import annotations

import copy
import math

import torch

from fastddpm.diffusion.continuous import ContinuousProcess, make_process


def linear_betas(num_timesteps: int, beta_start: float = 1e-4, beta_end: float = 0.02) -> torch.Tensor:
    """Ho et al. 2020, sec. 4: betas increasing linearly from `beta_start` to `beta_end`, as given (make_schedule
    decides them: DiffusionConfig.linear_beta_range)."""
    return torch.linspace(beta_start, beta_end, num_timesteps, dtype=torch.float64)


def cosine_betas(num_timesteps: int, s: float = 0.008, max_beta: float = 0.999) -> torch.Tensor:
    """Nichol & Dhariwal 2021 ("Improved DDPM", arXiv:2102.09672), eq. 17:
    alpha_bar(t) = f(t) / f(0),  f(t) = cos(((t/T + s) / (1 + s)) * pi/2)^2,
    beta_t = 1 - alpha_bar_t / alpha_bar_{t-1},
    clipped to max_beta = 0.999 to avoid the singularity at t = T."""
    steps = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    alpha_bar = f / f[0]
    betas = 1 - alpha_bar[1:] / alpha_bar[:-1]
    return betas.clamp(max=max_beta)


class NoiseSchedule:
    """The per-timestep constants of a schedule, as float32 tensors on one device (float64 underneath)."""

    def __init__(self, betas: torch.Tensor):
        betas = betas.to(torch.float64)
        if betas.ndim != 1 or not bool(((betas > 0) & (betas < 1)).all()):
            raise ValueError("betas must be a 1-D tensor with every value in (0, 1)")
        self.num_timesteps = betas.numel()
        alphas = 1.0 - betas
        alpha_bar = torch.cumprod(alphas, dim=0)
        alpha_bar_prev = torch.cat([torch.ones(1, dtype=torch.float64), alpha_bar[:-1]])
        self._f64 = {
            "betas": betas,
            "alphas": alphas,
            "alpha_bar": alpha_bar,
            "alpha_bar_prev": alpha_bar_prev,
            "sqrt_alpha_bar": alpha_bar.sqrt(),
            "sqrt_one_minus_alpha_bar": (1.0 - alpha_bar).sqrt(),
            # Posterior q(x_{t-1} | x_t, x_0) variance, beta_tilde_t (Ho et al. eq. 7).
            "posterior_variance": betas * (1.0 - alpha_bar_prev) / (1.0 - alpha_bar),
        }
        self._place("cpu")

    def _place(self, device: torch.device | str) -> None:
        for name, value in self._f64.items():
            setattr(self, name, value.to(device=device, dtype=torch.float32))
        self.device = torch.device(device)

    def to(self, device: torch.device | str) -> "NoiseSchedule":
        """This schedule on `device`: itself if already there, else a new object. A schedule's tensors are never
        replaced in place, so a captured CUDA graph that reads them stays valid."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        here = self.device
        if here.type == "cuda" and here.index is None:
            here = torch.device("cuda", torch.cuda.current_device())
        if device == here:
            return self
        moved = copy.copy(self)
        moved._place(device)
        return moved

    def float64(self, name: str) -> torch.Tensor:
        """A constant in float64 on the CPU, for samplers that want the exact values."""
        return self._f64[name]


def make_schedule(kind: str, num_timesteps: int, beta_start: float | None = None,
                  beta_end: float | None = None) -> NoiseSchedule:
    """The schedule `kind` over `num_timesteps`; the linear one's betas as DiffusionConfig.linear_beta_range gives
    them: unset, Ho et al.'s scaled by 1000 / T; given, as written."""
    if kind == "linear":
        from fastddpm.config import DiffusionConfig

        d = DiffusionConfig(num_timesteps=num_timesteps, beta_start=beta_start, beta_end=beta_end)
        return NoiseSchedule(linear_betas(num_timesteps, *d.linear_beta_range()))
    if kind == "cosine":
        return NoiseSchedule(cosine_betas(num_timesteps))
    raise ValueError(f"unknown schedule {kind!r}: choose 'linear' or 'cosine'")


def schedule_from_config(cfg) -> NoiseSchedule | ContinuousProcess:
    """From a DiffusionConfig: DDPM's schedule, or the continuous process of --objective edm / flow."""
    process = make_process(cfg)
    if process is not None:
        return process
    return make_schedule(cfg.schedule, cfg.num_timesteps, cfg.beta_start, cfg.beta_end)


def draw_t(schedule: NoiseSchedule | ContinuousProcess, batch_size: int, *, generator: torch.Generator | None,
           device) -> torch.Tensor:
    """Training's per-image noise draw: DDPM's integer timesteps, uniform over 0..T-1; a continuous objective's
    standard normal z, which it maps to its level (continuous.ContinuousProcess.level)."""
    if isinstance(schedule, ContinuousProcess):
        return torch.randn((batch_size,), generator=generator, device=device)
    return torch.randint(0, schedule.num_timesteps, (batch_size,), generator=generator, device=device)
