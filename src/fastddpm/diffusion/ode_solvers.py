"""Few-step samplers: solvers of the diffusion probability-flow ODE (and one of the reverse SDE), in 10-50 network
calls instead of 1000.

All four work on the discrete-time model of --objective ddpm (epsilon or v prediction, linear or cosine betas), and
on the levels of EDM and flow matching (fastddpm.diffusion.continuous), which hand them their (alpha, sigma).
At timestep t the noisy image is x_t = alpha_t x_0 + sigma_t eps with alpha_t = sqrt(alpha_bar_t), sigma_t =
sqrt(1 - alpha_bar_t); the half log-SNR is lambda_t = log(alpha_t / sigma_t). Every solver asks the network for the
data prediction x0_hat(x_t, t) (clipped to [-1, 1] when `clip`), and the last step lands on sigma = 0, where the
image is the last x0_hat ("lower-order final step", as the references do it).

DPM-Solver++(2M) (Lu et al. 2022, arXiv:2211.01095, alg. 2), with h_i = lambda_{i+1} - lambda_i:
    x_{i+1} = (sigma_{i+1} / sigma_i) x_i - alpha_{i+1} (e^{-h_i} - 1) D_i,
    D_i = x0_i + (h_i / (2 h_{i-1})) (x0_i - x0_{i-1})          (first step: D_0 = x0_0, which is DDIM)

SDE-DPM-Solver++(2M) (Lu et al. 2022, arXiv:2211.01095, sec. 5 / app. B; diffusers' "sde-dpmsolver++", midpoint),
the same multistep data prediction for the reverse SDE instead of the ODE: each step forgets part of x_i and
injects fresh noise z_i, so errors made early are washed out as in ancestral DDPM:
    x_{i+1} = (sigma_{i+1} / sigma_i) e^{-h_i} x_i + alpha_{i+1} (1 - e^{-2 h_i}) D_i
              + sigma_{i+1} sqrt(1 - e^{-2 h_i}) z_i

UniPC (Zhao et al. 2023, arXiv:2302.04867), order 2 with B(h) = e^{-h} - 1 ("bh2"), data prediction. Its
predictor UniP-2 is DPM-Solver++(2M)'s update. Its corrector UniC reuses the network call the next step makes anyway at
x_{i+1}: it refits the step from x_i with that new x0, raising the order at no extra cost.

Heun (Karras et al. 2022 "EDM", arXiv:2206.00364, alg. 1 without churn), in the variance-exploding variables
    x~ = x / alpha,  sigma~ = sigma / alpha,  d = (x~ - x0_hat) / sigma~:
    Euler to sigma~_{i+1}, evaluate there, and step again with the mean of the two slopes (Euler on the last step).
K steps cost 2K - 1 network calls. (Computed in the VP variables, see heun_2.)

Timesteps ("spacing"): "trailing" is evenly spaced from T-1 down (Lin et al. 2024, arXiv:2305.08891), as DDIM;
"karras" takes the EDM noise levels sigma~_i = (s_max^(1/7) + i/(K-1) (s_min^(1/7) - s_max^(1/7)))^7 (eq. 5, rho = 7)
between the schedule's extremes and rounds each to the nearest trained timestep, so the network only ever sees
timesteps it was trained on and the solver uses their exact noise levels. Steps are dense at low noise there.
"logsnr" spaces the steps evenly in lambda (Lu et al. 2022, arXiv:2206.00927, sec. 3.3: their choice for
low-resolution images), rounded likewise; each DPM-Solver step then has the same h. All three start at the
noisiest timestep with lambda >= LAMBDA_MIN (all of them on the linear schedule at T = 1000; see below).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fastddpm.config import SPACINGS
from fastddpm.diffusion.schedule import NoiseSchedule

# The solvers start at the noisiest trained timestep with lambda >= -5.1 (sigma~ = sigma / alpha <= 164): the cosine
# schedule's clipped last betas put its final timesteps at sigma~ = 640 and 20,000, where a step in sigma~ (Heun) or
# a multistep difference in lambda is ill-conditioned (diffusers' `lambda_min_clipped`, -5.1 for cosine; EDM's VP
# ends at sigma = sqrt(e^(beta_d / 2 + beta_min) - 1) = 152, Karras et al. 2022, table 1). Starting there from pure
# noise errs by alpha <= 0.006 of x_0.
# The linear schedule's lambda at T-1 is -5.06 at T = 1000: it keeps every timestep. Its betas scaled to a smaller T
# (DiffusionConfig.linear_beta_range) end lower: at T = 100 lambda is -5.40 and the solvers start at timestep 96.
LAMBDA_MIN = -5.1


def check_eta(eta: float) -> None:
    """DDIM's eta (Song et al. 2021, eq. 16) scales the step's posterior standard deviation: 0 is deterministic, 1
    DDPM's variance. Outside [0, 1] the formula has no meaning (eta < 0 cancels the noise it should add, eta > 1
    asks for more variance than the step has), so it is refused rather than clamped."""
    if not (math.isfinite(eta) and 0.0 <= eta <= 1.0):
        raise ValueError(f"eta={eta} must be a number in [0, 1] (0: deterministic DDIM, 1: DDPM's variance)")


def trailing_timesteps(num_timesteps: int, steps: int, first: int | None = None) -> list[int]:
    """Evenly spaced 'trailing' timesteps from `first` (default T-1) down (Lin et al. 2024, arXiv:2305.08891,
    table 2).

    Trailing spacing always starts at the noisiest step, so the sampler begins where training noise ends;
    steps == T gives every timestep.
    """
    first = num_timesteps - 1 if first is None else first
    if not 1 <= steps <= first + 1:
        raise ValueError(f"steps={steps} must be between 1 and the number of diffusion timesteps ({first + 1})")
    # diffusers' arithmetic (a float stride, rounded half to even), so that its "trailing" schedulers walk the same
    # timesteps to the last rounding tie; less the step at t = -1 that its stride adds for some counts
    return (np.round(np.arange(first + 1, 0, -(first + 1) / steps))[:steps].astype(np.int64) - 1).tolist()


def first_timestep(schedule: NoiseSchedule, lambda_min: float = LAMBDA_MIN) -> int:
    """The noisiest timestep whose half log-SNR is >= lambda_min."""
    ab = schedule.float64("alpha_bar")
    lam_T = 0.5 * (ab.log() - (1 - ab).log())  # decreasing in t
    return int((lam_T >= lambda_min).nonzero().max())


def karras_timesteps(schedule: NoiseSchedule, steps: int, rho: float = 7.0, first: int | None = None) -> list[int]:
    """Timesteps at the EDM noise levels (Karras et al. 2022, eq. 5) between those of `first` (default T-1) and
    t = 0, rounded to trained timesteps, noisiest first. Where two levels round to the same timestep (many
    steps, the dense low-noise end) it is kept once, so the result may have fewer than `steps` entries."""
    T = schedule.num_timesteps
    first = T - 1 if first is None else first
    if not 1 <= steps <= first + 1:
        raise ValueError(f"steps={steps} must be between 1 and the number of diffusion timesteps ({first + 1})")
    ab = schedule.float64("alpha_bar").numpy()
    log_sigma_T = np.log(np.sqrt((1 - ab) / ab))  # increasing in t
    if math.isinf(rho):  # the limit rho -> inf: even steps in log sigma~ = -lambda (logsnr_timesteps)
        log_sigmas = log_sigma_T[first] + np.linspace(0, 1, steps) * (log_sigma_T[0] - log_sigma_T[first])
    else:
        lo, hi = math.exp(log_sigma_T[0]) ** (1 / rho), math.exp(log_sigma_T[first]) ** (1 / rho)
        log_sigmas = np.log((hi + np.linspace(0, 1, steps) * (lo - hi)) ** rho)
    t = np.interp(log_sigmas, log_sigma_T, np.arange(T)).round().astype(np.int64)
    return list(dict.fromkeys(t.tolist()))


def logsnr_timesteps(schedule: NoiseSchedule, steps: int, first: int | None = None) -> list[int]:
    """Timesteps evenly spaced in the half log-SNR lambda between those of `first` (default T-1) and t = 0, rounded
    to trained timesteps and kept once each, noisiest first (diffusers' `use_lu_lambdas`)."""
    return karras_timesteps(schedule, steps, rho=math.inf, first=first)


def solver_timesteps(schedule: NoiseSchedule, steps: int, spacing: str = "trailing",
                     first: int | None = None) -> list[int]:
    """The timesteps a sampler visits, noisiest first, starting at `first` (default T-1)."""
    if spacing == "trailing":
        return trailing_timesteps(schedule.num_timesteps, steps, first)
    if spacing == "karras":
        return karras_timesteps(schedule, steps, first=first)
    if spacing == "logsnr":
        return logsnr_timesteps(schedule, steps, first=first)
    raise ValueError(f"unknown spacing {spacing!r}: choose one of {', '.join(SPACINGS)}")


def noise_levels(schedule: NoiseSchedule, timesteps: list[int]) -> tuple[list[float], list[float], list[float]]:
    """(alpha, sigma, lambda) at each timestep and, appended, at the end of sampling (1, 0, +inf); host floats
    computed in float64, so the solvers' coefficients cost no device work and no sync."""
    ab = schedule.float64("alpha_bar")
    alpha = [math.sqrt(float(ab[t])) for t in timesteps] + [1.0]
    sigma = [math.sqrt(1.0 - float(ab[t])) for t in timesteps] + [0.0]
    lam = [math.log(a / s) for a, s in zip(alpha[:-1], sigma[:-1])] + [math.inf]
    return alpha, sigma, lam


def dpmpp_2m(denoise, x: torch.Tensor, alpha: list[float], sigma: list[float], lam: list[float]) -> torch.Tensor:
    """DPM-Solver++(2M) from x at level 0 through the levels of `noise_levels`; denoise(x, i) -> x0_hat at level i."""
    steps = len(alpha) - 1
    x0_prev = h_prev = None
    for i in range(steps):
        x0 = denoise(x, i)
        if i == steps - 1:  # sigma_{i+1} = 0: the first-order step lands on x0_hat
            return x0
        h = lam[i + 1] - lam[i]
        d = x0 if x0_prev is None else x0 + (0.5 * h / h_prev) * (x0 - x0_prev)
        x = (sigma[i + 1] / sigma[i]) * x - (alpha[i + 1] * math.expm1(-h)) * d
        x0_prev, h_prev = x0, h
    return x


def dpmpp_2m_sde(denoise, x: torch.Tensor, alpha: list[float], sigma: list[float], lam: list[float],
                 noise) -> torch.Tensor:
    """SDE-DPM-Solver++(2M) over the levels of `noise_levels`; denoise(x, i) -> x0_hat at level i, noise() -> a
    standard normal tensor like x (drawn once per step but the last, which lands on x0_hat with no noise)."""
    steps = len(alpha) - 1
    x0_prev = h_prev = None
    for i in range(steps):
        x0 = denoise(x, i)
        if i == steps - 1:
            return x0
        h = lam[i + 1] - lam[i]
        d = x0 if x0_prev is None else x0 + (0.5 * h / h_prev) * (x0 - x0_prev)
        keep = -math.expm1(-2.0 * h)  # 1 - e^{-2h}, exact for small h
        x = ((sigma[i + 1] / sigma[i]) * math.exp(-h)) * x + (alpha[i + 1] * keep) * d \
            + (sigma[i + 1] * math.sqrt(keep)) * noise()
        x0_prev, h_prev = x0, h
    return x


def _unic_coefficients(h: float, r1: float | None) -> tuple[float, float]:
    """UniC's (rho_D1, rho_new) for B(h) = e^{-h} - 1 (Zhao et al. 2023, UniC-p). Order 1 (r1 None): (0, 1/2).
    Order 2: solve [[1, 1], [r1, 1]] rho = (phi_2 / B, 2 phi_3 / B), phi_2 = (e^{-h}-1)/(-h) - 1,
    phi_3 = phi_2 / (-h) - 1/2, for the step from level s to s+1 of size h, with r1 = (lambda_{s-1} - lambda_s) / h."""
    if r1 is None:
        return 0.0, 0.5
    hh = -h
    b_h = math.expm1(hh)
    phi_2 = b_h / hh - 1.0
    phi_3 = phi_2 / hh - 0.5
    b1, b2 = phi_2 / b_h, 2.0 * phi_3 / b_h
    rho_d1 = (b1 - b2) / (1.0 - r1)
    return rho_d1, b1 - rho_d1


def unipc_2(denoise, x: torch.Tensor, alpha: list[float], sigma: list[float], lam: list[float]) -> torch.Tensor:
    """UniPC (bh2, order 2, data prediction): UniP-2 predictor + UniC corrector, one network call per step."""
    steps = len(alpha) - 1
    x0s: list[torch.Tensor] = []  # x0_hat at levels 0 .. i
    x_prev = None  # the (corrected) image at level i - 1, where the last predictor started
    for i in range(steps):
        x0 = denoise(x, i)
        if i == steps - 1:  # the final step lands on x0_hat; correcting x first would not change it
            return x0
        if i > 0:  # UniC: refit the step from level i-1 to i with the x0_hat just computed at level i
            h = lam[i] - lam[i - 1]
            r1 = (lam[i - 2] - lam[i - 1]) / h if i >= 2 else None  # order 2 once two x0_hat precede level i
            rho_d1, rho_new = _unic_coefficients(h, r1)
            m0 = x0s[-1]
            correction = rho_new * (x0 - m0)
            if r1 is not None:
                correction = correction + (rho_d1 / r1) * (x0s[-2] - m0)
            b_h = math.expm1(-h)
            x = (sigma[i] / sigma[i - 1]) * x_prev - (alpha[i] * b_h) * (m0 + correction)
        x0s = x0s[-1:] + [x0]
        x_prev = x
        h = lam[i + 1] - lam[i]
        # UniP-2 (order 1 on the first step): the same update as DPM-Solver++(2M)
        d = x0 if len(x0s) < 2 else x0 + (0.5 * h / (lam[i] - lam[i - 1])) * (x0 - x0s[-2])
        x = (sigma[i + 1] / sigma[i]) * x - (alpha[i + 1] * math.expm1(-h)) * d
    return x


def heun_2(denoise, x: torch.Tensor, alpha: list[float], sigma: list[float]) -> torch.Tensor:
    """EDM's deterministic Heun sampler (alg. 1, S_churn = 0) over the given levels, written in the VP image x:
    the VE slope d = (x~ - x0_hat) / sigma~ is the predicted noise (x - alpha x0_hat) / sigma, the Euler step
    x~ + (sigma~' - sigma~) d is DDIM's alpha' x0_hat + sigma' d, and the correction adds
    alpha' (sigma~' - sigma~) (d' - d) / 2. This form never holds x~ = x / alpha = x0 + sigma~ eps, whose scale is
    sigma~ (up to e^-LAMBDA_MIN = 164 where the solvers start, first_timestep; 80 at EDM's sigma_max): it works on
    the image at unit scale, as the other solvers do."""
    steps = len(alpha) - 1
    for i in range(steps):
        x0 = denoise(x, i)
        if i == steps - 1:  # the final Euler step to sigma = 0 lands on x0_hat
            return x0
        d = (x - alpha[i] * x0) * (1.0 / sigma[i])
        x_euler = alpha[i + 1] * x0 + sigma[i + 1] * d
        d_next = (x_euler - alpha[i + 1] * denoise(x_euler, i + 1)) * (1.0 / sigma[i + 1])
        x = x_euler + (0.5 * (sigma[i + 1] - alpha[i + 1] * sigma[i] / alpha[i])) * (d_next - d)
    return x


def ddim_levels(denoise, x: torch.Tensor, alpha: list[float], sigma: list[float], eta: float = 0.0,
                noise=None) -> torch.Tensor:
    """DDIM (Song et al. 2021, eq. 12) over any levels x = alpha x_0 + sigma eps, not only variance-preserving ones:
        x_{i+1} = alpha_{i+1} x0_hat + sqrt(sigma_{i+1}^2 - s_i^2) eps_hat + s_i z,
        s_i^2 = eta^2 (sigma_i^2 - (alpha_i / alpha_{i+1})^2 sigma_{i+1}^2) sigma_{i+1}^2 / sigma_i^2
    (the posterior variance of the step from level i to i+1, times eta^2; eta = 0 is deterministic). With eta = 0
    it is Euler's method on the probability-flow ODE written in the objective's own variables: for EDM Euler in
    sigma, for flow matching Euler in t (x_{i+1} = x_i + (t_{i+1} - t_i) v). noise() -> a standard normal like x."""
    check_eta(eta)
    steps = len(alpha) - 1
    for i in range(steps):
        x0 = denoise(x, i)
        if i == steps - 1:
            return x0
        eps = (x - alpha[i] * x0) * (1.0 / sigma[i])
        s2 = 0.0
        if eta > 0:
            s2 = eta * eta * max(0.0, sigma[i] ** 2 - (alpha[i] / alpha[i + 1]) ** 2 * sigma[i + 1] ** 2) \
                * sigma[i + 1] ** 2 / sigma[i] ** 2
        x = alpha[i + 1] * x0 + math.sqrt(max(0.0, sigma[i + 1] ** 2 - s2)) * eps
        if s2 > 0:
            x = x + math.sqrt(s2) * noise()
    return x
