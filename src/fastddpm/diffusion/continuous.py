"""Continuous-time objectives: EDM and flow matching, on the view of the forward process the three objectives share,

    x_t = alpha(t) x_0 + sigma(t) eps,

so that the network's output is turned into x0_hat one way per objective and the few-step solvers of ode_solvers
(which take the levels' (alpha, sigma) and a denoiser) run on each. DDPM (fastddpm.diffusion.schedule) is the
discrete case, alpha_t = sqrt(alpha_bar_t), sigma_t = sqrt(1 - alpha_bar_t) at T integer timesteps.

EDM (Karras et al. 2022, arXiv:2206.00364), variance exploding: alpha = 1, sigma = the noise level.
  Table 1's preconditioning, D(x; sigma) = c_skip x + c_out F(c_in x, c_noise):
    c_skip = sd^2 / (sigma^2 + sd^2),  c_out = sigma sd / sqrt(sigma^2 + sd^2),  c_in = 1 / sqrt(sigma^2 + sd^2),
    c_noise = ln(sigma) / 4  (fed to the U-Net times NOISE_INPUT_SCALE, below),  sd = sigma_data = 0.5
  training: ln sigma ~ N(P_mean, P_std^2), P_mean = -1.2, P_std = 1.2, and the loss weight
  lambda(sigma) = 1 / c_out^2 of sec. 5, which makes the loss || F - (x_0 - c_skip x) / c_out ||^2 (their eq. 8);
  sampling: sigma from 80 to 0.002 at the levels of eq. 5 (rho = 7).
Flow matching / rectified flow (Lipman et al. 2022, arXiv:2210.02747; Liu et al. 2022, arXiv:2209.03003):
  alpha = 1 - t, sigma = t, t in [0, 1]; the network predicts the velocity v = eps - x_0, so x0_hat = x - t v;
  training: t logit-normal, t = sigmoid(m + s z), z ~ N(0, 1), m = 0, s = 1 (Esser et al. 2024, arXiv:2403.03206,
  sec. 3.1); sampling: t evenly from 1 to 1/1000 (diffusers' FlowMatchEulerDiscreteScheduler), optionally shifted
  t' = shift t / (1 + (shift - 1) t) (their eq. 23), then 0.

Training draws z ~ N(0, 1) for each image (the batch's `t`), and each objective maps z to its noise level: one
draw for both, a function of (seed, step) as every other draw.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

# The U-Nets embed their noise input with sinusoids built for DDPM's integer timesteps 0..999, which take any real
# input: both continuous objectives hand it their own noise input times 1000. Flow's t lands on that scale (as in
# diffusers and Stable Diffusion 3); EDM's, 1000 c_noise = 250 ln(sigma), runs from about -1,550 to 1,100 over
# sigma 0.002..80: off that range, but monotone in sigma, so each noise level keeps its own embedding.
NOISE_INPUT_SCALE = 1000.0
OBJECTIVES = ("ddpm", "edm", "flow")
# samplers that run on a continuous objective: DDPM's ancestral sampler walks the T discrete timesteps of its own
# schedule (use DDIM with eta = 1 for ancestral sampling on EDM or flow)
CONTINUOUS_SAMPLERS = ("euler", "ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun")
# The half log-SNR the lambda-based solvers start at, at the least (ode_solvers.LAMBDA_MIN): flow's t = 1 has
# alpha = 0, where lambda is -inf
LAMBDA_MIN = -5.1


def _col(v_B: torch.Tensor, ndim: int) -> torch.Tensor:
    return v_B.reshape(-1, *([1] * (ndim - 1)))


class ContinuousProcess(ABC):
    """What an objective needs to train and sample: its level from a standard normal draw, (alpha, sigma) at a
    level, the network's input at a level, x0_hat from the network's output, and the training target."""

    name: str  # the objective's name (config.default_spacing picks its samplers' timesteps by it)

    @abstractmethod
    def level(self, z_B: torch.Tensor) -> torch.Tensor:
        """Training's noise level for each standard normal draw z."""

    @abstractmethod
    def alpha_sigma(self, level: torch.Tensor | float):
        """(alpha, sigma) at `level`: x = alpha x_0 + sigma eps."""

    @abstractmethod
    def net_input(self, x: torch.Tensor, level_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the image the network sees, its noise input) at x and level."""

    @abstractmethod
    def x0(self, out: torch.Tensor, x: torch.Tensor, level_B: torch.Tensor) -> torch.Tensor:
        """x0_hat from the network's output at x and level."""

    @abstractmethod
    def target(self, x0: torch.Tensor, noise: torch.Tensor, x: torch.Tensor, level_B: torch.Tensor) -> torch.Tensor:
        """What the network's output regresses in training."""

    @abstractmethod
    def sampling_levels(self, steps: int, spacing: str, *, finite_lambda: bool) -> list[float]:
        """`steps` levels, noisiest first (sampling then ends at level 0); finite_lambda: start where
        log(alpha / sigma) >= LAMBDA_MIN, as the lambda-based solvers need."""

    def to(self, device) -> "ContinuousProcess":
        return self  # host floats only: nothing to move


class EDM(ContinuousProcess):
    name = "edm"

    def __init__(self, *, sigma_data: float = 0.5, p_mean: float = -1.2, p_std: float = 1.2,
                 sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0):
        self.sigma_data, self.p_mean, self.p_std = sigma_data, p_mean, p_std
        self.sigma_min, self.sigma_max, self.rho = sigma_min, sigma_max, rho

    def level(self, z_B):
        return (self.p_mean + self.p_std * z_B.float()).exp()

    def alpha_sigma(self, level):
        return (torch.ones_like(level) if isinstance(level, torch.Tensor) else 1.0), level

    def _c(self, sigma_B: torch.Tensor, ndim: int):
        s, sd = _col(sigma_B.float(), ndim), self.sigma_data
        norm = (s * s + sd * sd).sqrt()
        return sd * sd / (s * s + sd * sd), s * sd / norm, 1.0 / norm  # c_skip, c_out, c_in

    def net_input(self, x, level_B):
        _, _, c_in = self._c(level_B, x.ndim)
        return c_in * x, level_B.float().log() * (NOISE_INPUT_SCALE / 4)

    def x0(self, out, x, level_B):
        c_skip, c_out, _ = self._c(level_B, x.ndim)
        return c_skip * x + c_out * out

    def target(self, x0, noise, x, level_B):
        c_skip, c_out, _ = self._c(level_B, x.ndim)
        return (x0 - c_skip * x) / c_out

    def sampling_levels(self, steps, spacing, *, finite_lambda):
        return _levels_in_sigma_tilde(self.sigma_max, self.sigma_min, steps, spacing, self.rho,
                                      uniform=lambda k: [self.sigma_max + (self.sigma_min - self.sigma_max) * i
                                                         / max(k - 1, 1) for i in range(k)])


class Flow(ContinuousProcess):
    name = "flow"

    def __init__(self, *, shift: float = 1.0, logit_mean: float = 0.0, logit_std: float = 1.0,
                 num_train_timesteps: int = 1000):
        self.shift, self.logit_mean, self.logit_std = shift, logit_mean, logit_std
        self.t_min = 1.0 / num_train_timesteps

    def level(self, z_B):
        return torch.sigmoid(self.logit_mean + self.logit_std * z_B.float())

    def alpha_sigma(self, level):
        return 1 - level, level

    def net_input(self, x, level_B):
        return x, level_B.float() * NOISE_INPUT_SCALE

    def x0(self, out, x, level_B):
        return x - _col(level_B.float(), x.ndim) * out

    def target(self, x0, noise, x, level_B):
        return noise - x0

    def _shifted(self, t: float) -> float:
        return self.shift * t / (1 + (self.shift - 1) * t)

    def sampling_levels(self, steps, spacing, *, finite_lambda):
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        t_max = 1.0
        if finite_lambda:  # the lambda-based solvers start where alpha / sigma = e^LAMBDA_MIN, after the shift:
            t_lambda_min = 1.0 / (1.0 + math.exp(LAMBDA_MIN))  # so t_max is the shift's inverse of that level
            t_max = t_lambda_min / (self.shift - (self.shift - 1) * t_lambda_min)
        if spacing == "trailing":  # evenly in t, then shifted, as diffusers' FlowMatchEulerDiscreteScheduler
            # (which spaces its levels between the shifted ends, then shifts them: t_min is shifted twice)
            lo = self._shifted(self.t_min)
            ts = [t_max + (lo - t_max) * i / max(steps - 1, 1) for i in range(steps)]
        else:  # in sigma~ = t / (1 - t), the noise-to-signal ratio, as EDM's levels
            tilde = _levels_in_sigma_tilde(t_max / (1 - t_max) if t_max < 1 else 1.0 / self.t_min,
                                           self.t_min / (1 - self.t_min), steps, spacing, 7.0, uniform=None)
            ts = [s / (1 + s) for s in tilde]
        return [self._shifted(t) for t in ts]


def _levels_in_sigma_tilde(hi: float, lo: float, steps: int, spacing: str, rho: float, uniform) -> list[float]:
    """`steps` noise levels from hi down to lo: 'karras' at EDM's eq. 5, 'logsnr' evenly in log sigma (evenly in
    lambda), 'trailing' evenly in the objective's own level (`uniform`)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    frac = [i / max(steps - 1, 1) for i in range(steps)]
    if spacing == "karras":
        a, b = hi ** (1 / rho), lo ** (1 / rho)
        return [(a + f * (b - a)) ** rho for f in frac]
    if spacing == "logsnr":
        return [math.exp(math.log(hi) + f * (math.log(lo) - math.log(hi))) for f in frac]
    if spacing == "trailing" and uniform is not None:
        return uniform(steps)
    raise ValueError(f"unknown spacing {spacing!r}: choose trailing, karras or logsnr")


def make_process(cfg) -> ContinuousProcess | None:
    """The continuous process of a DiffusionConfig, or None for DDPM (its NoiseSchedule is the process)."""
    objective = getattr(cfg, "objective", "ddpm")
    if objective == "edm":
        return EDM(sigma_data=cfg.sigma_data, p_mean=cfg.edm_p_mean, p_std=cfg.edm_p_std)
    if objective == "flow":
        return Flow(shift=cfg.flow_shift)
    if objective == "ddpm":
        return None
    raise ValueError(f"unknown objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")


def continuous_loss(model, process: ContinuousProcess, x0: torch.Tensor, z_B: torch.Tensor, noise: torch.Tensor,
                    y_B: torch.Tensor | None = None) -> torch.Tensor:
    """Mean-squared error of the network's output against the objective's target, in float32; z_B: a standard
    normal draw per image that the objective maps to its noise level."""
    level_B = process.level(z_B)
    alpha, sigma = process.alpha_sigma(level_B)
    x = _col(alpha, x0.ndim) * x0 + _col(sigma, x0.ndim) * noise
    x_in, c_noise_B = process.net_input(x, level_B)
    out = model(x_in, c_noise_B) if y_B is None else model(x_in, c_noise_B, y_B)
    return F.mse_loss(out.float(), process.target(x0, noise, x, level_B).float())
