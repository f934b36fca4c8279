"""Reverse-process samplers: DDPM ancestral sampling and DDIM here; DPM-Solver++(2M), its SDE variant, UniPC and
Heun in fastddpm.diffusion.ode_solvers; `sample` runs any of them, with classifier-free guidance for conditional models.
On an EDM or flow-matching model (its `schedule` is a fastddpm.diffusion.continuous process) `continuous_sample`
runs every one but DDPM's over the process's own levels; `euler` is DDIM without noise on any objective.

DDPM (Ho et al. 2020, arXiv:2006.11239): x_{t-1} ~ q(x_{t-1} | x_t, x0_hat), the Gaussian posterior of eq. 6-7,
    mean = c0_t x0_hat + ct_t x_t,  c0_t = sqrt(a_{t-1}) beta_t / (1 - a_t),
    ct_t = sqrt(alpha_t)(1 - a_{t-1}) / (1 - a_t)
with variance beta_tilde_t (eq. 7, "fixed small") or beta_t ("fixed large"); a_t = alpha_bar_t.
Writing the mean through x0_hat is the same as eq. 11 and lets x0_hat be clipped to the data range.

DDIM (Song et al. 2021, arXiv:2010.02502, eq. 12), over a sub-sequence of timesteps tau:
    x_prev = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - sigma^2) eps_hat + sigma z,
    sigma  = eta * sqrt((1 - a_prev) / (1 - a_t)) * sqrt(1 - a_t / a_prev)                              (eq. 16)
eta = 0 is deterministic DDIM; eta = 1 matches DDPM's variance on the sub-sequence.
"""

from __future__ import annotations

import math

import torch

from fastddpm.config import SAMPLERS, SPACINGS, default_spacing
from fastddpm.device import autocast
from fastddpm.diffusion.continuous import CONTINUOUS_SAMPLERS, ContinuousProcess
from fastddpm.diffusion.guidance import guided
from fastddpm.diffusion.objective import predict_eps_and_x0
from fastddpm.diffusion.ode_solvers import (check_eta, ddim_levels, dpmpp_2m, dpmpp_2m_sde, first_timestep, heun_2,
                                            noise_levels, solver_timesteps, unipc_2)
from fastddpm.diffusion.schedule import NoiseSchedule
from fastddpm.rng import ImageNoise


def network_calls(sampler: str, steps: int, num_timesteps: int, *,
                  schedule: NoiseSchedule | ContinuousProcess | None = None, spacing: str | None = None) -> int:
    """Network evaluations (NFE) per image of one sampling run: what a sampler costs. DDPM always walks all T
    timesteps; Heun evaluates twice per step but once on the last; the others once per step.
    Given the model's `schedule` (and `spacing`, None: the sampler's own, as `sample` resolves it) it is the count
    `sample` makes: on a DDPM schedule karras and logsnr spacing round their levels to trained timesteps and keep
    each once, so many steps take fewer than asked (dpmpp-2m 100 karras on the cosine schedule: 88). Without
    `schedule` it is the count for `steps` distinct timesteps, an upper bound."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")
    if sampler == "ddpm":
        return num_timesteps
    if isinstance(schedule, NoiseSchedule):
        steps = len(sampler_timesteps(schedule, sampler, steps, spacing))
    # a continuous process's levels are not rounded: always `steps` of them
    return 2 * steps - 1 if sampler == "heun" else steps


def _model_out(model, x_t: torch.Tensor, t: int, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    t_B = torch.full((x_t.shape[0],), t, device=x_t.device, dtype=torch.long)
    with autocast(x_t.device.type, autocast_dtype):
        return model(x_t, t_B).float()


def _eps_x0(schedule, prediction, out, x_t, t, clip):
    t_B = torch.full((x_t.shape[0],), t, device=x_t.device, dtype=torch.long)
    eps, x0 = predict_eps_and_x0(schedule, prediction, out, x_t, t_B)
    if clip:
        # Clip x0_hat to the data range and re-derive eps from it, so the update stays consistent.
        x0 = x0.clamp(-1.0, 1.0)
        a, s = schedule.sqrt_alpha_bar[t], schedule.sqrt_one_minus_alpha_bar[t]
        eps = (x_t - a * x0) / s
    return eps, x0


@torch.no_grad()
def ddpm_sample(model, schedule: NoiseSchedule, shape: tuple[int, ...], *, prediction: str = "epsilon",
                noise: ImageNoise, device: torch.device | str, variance: str = "posterior",
                clip: bool = True, autocast_dtype: torch.dtype | None = None, progress=None) -> torch.Tensor:
    """Ancestral sampling over all T steps. Returns images in [-1, 1], float32, shape `shape`."""
    sched = schedule.to(device)
    x = noise.randn(shape)
    ab = sched.float64("alpha_bar")
    ab_prev = sched.float64("alpha_bar_prev")
    betas = sched.float64("betas")
    alphas = sched.float64("alphas")
    var = sched.float64("posterior_variance") if variance == "posterior" else betas
    for t in reversed(range(sched.num_timesteps)):
        out = _model_out(model, x, t, autocast_dtype)
        _, x0 = _eps_x0(sched, prediction, out, x, t, clip)
        c0 = float(ab_prev[t].sqrt() * betas[t] / (1 - ab[t]))
        ct = float(alphas[t].sqrt() * (1 - ab_prev[t]) / (1 - ab[t]))
        x = c0 * x0 + ct * x
        if t > 0:
            x = x + float(var[t].sqrt()) * noise.randn(shape)
        if progress is not None:
            progress.update(1)
    return x


@torch.no_grad()
def ddim_sample(model, schedule: NoiseSchedule, shape: tuple[int, ...], *, steps: int = 50, eta: float = 0.0,
                prediction: str = "epsilon", noise: ImageNoise, device: torch.device | str,
                clip: bool = True, autocast_dtype: torch.dtype | None = None, progress=None,
                spacing: str = "trailing") -> torch.Tensor:
    """DDIM over `steps` timesteps (ode_solvers.solver_timesteps). Returns images in [-1, 1], float32, shape `shape`."""
    check_eta(eta)
    sched = schedule.to(device)
    ab = sched.float64("alpha_bar")
    ts = solver_timesteps(sched, steps, spacing)
    x = noise.randn(shape)
    for i, t in enumerate(ts):
        out = _model_out(model, x, t, autocast_dtype)
        eps, x0 = _eps_x0(sched, prediction, out, x, t, clip)
        a_t = ab[t]
        a_prev = ab[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, dtype=torch.float64)
        sigma = eta * ((1 - a_prev) / (1 - a_t)).sqrt() * (1 - a_t / a_prev).sqrt()
        x = float(a_prev.sqrt()) * x0 + float((1 - a_prev - sigma**2).clamp(min=0).sqrt()) * eps
        if eta > 0 and i + 1 < len(ts):
            x = x + float(sigma) * noise.randn(shape)
        if progress is not None:
            progress.update(1)
    return x


@torch.no_grad()
def ode_sample(model, schedule: NoiseSchedule, shape: tuple[int, ...], *, solver: str, steps: int,
               spacing: str | None = None, prediction: str = "epsilon", noise: ImageNoise,
               device: torch.device | str, clip: bool = True, autocast_dtype: torch.dtype | None = None,
               progress=None) -> torch.Tensor:
    """DPM-Solver++(2M), SDE-DPM-Solver++(2M), UniPC or Heun (fastddpm.diffusion.ode_solvers) over `steps`
    timesteps. Returns images in [-1, 1], float32, shape `shape`; the SDE solver's noise comes from `noise`
    after the initial noise, one draw per step."""
    sched = schedule.to(device)
    ts = sampler_timesteps(sched, solver, steps, spacing)
    alpha, sigma, lam = noise_levels(sched, ts)
    x = noise.randn(shape)

    def denoise(x_t: torch.Tensor, i: int) -> torch.Tensor:
        out = _model_out(model, x_t, ts[i], autocast_dtype)
        t_B = torch.full((x_t.shape[0],), ts[i], device=x_t.device, dtype=torch.long)
        _, x0 = predict_eps_and_x0(sched, prediction, out, x_t, t_B)
        if progress is not None:
            progress.update(1)
        return x0.clamp(-1.0, 1.0) if clip else x0

    if solver == "dpmpp-2m":
        return dpmpp_2m(denoise, x, alpha, sigma, lam)
    if solver == "dpmpp-2m-sde":
        return dpmpp_2m_sde(denoise, x, alpha, sigma, lam,
                            noise=lambda: noise.randn(shape))
    if solver == "unipc":
        return unipc_2(denoise, x, alpha, sigma, lam)
    if solver == "heun":
        return heun_2(denoise, x, alpha, sigma)
    raise ValueError(f"unknown solver {solver!r}: choose dpmpp-2m, dpmpp-2m-sde, unipc or heun")


# DDPM samplers that walk any of the T timesteps; the solvers in log-SNR or sigma start at first_timestep
_EVERY_TIMESTEP = ("ddim", "euler")


def max_steps(schedule: NoiseSchedule, sampler: str) -> int:
    """The most steps `sampler` takes on a DDPM schedule: all T for ddim and euler, from first_timestep (the noisiest
    with half log-SNR >= ode_solvers.LAMBDA_MIN) down for the solvers."""
    return schedule.num_timesteps if sampler in _EVERY_TIMESTEP else first_timestep(schedule) + 1


def sampler_timesteps(schedule: NoiseSchedule, sampler: str, steps: int, spacing: str | None = None) -> list[int]:
    """The timesteps `sample` evaluates the network at (Heun also at each one after the first, a second time);
    spacing None: the sampler's own (config.default_spacing)."""
    spacing = spacing or default_spacing(sampler)
    if sampler == "ddpm":
        return list(range(schedule.num_timesteps - 1, -1, -1))
    if sampler in _EVERY_TIMESTEP:
        return solver_timesteps(schedule, steps, spacing)
    return solver_timesteps(schedule, steps, spacing, first=first_timestep(schedule))


def sample(model, schedule: NoiseSchedule, shape: tuple[int, ...], *, sampler: str = "ddim", steps: int = 50,
           eta: float = 0.0, prediction: str = "epsilon", seed: int = 0, first_image: int = 0,
           device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None, progress=None,
           labels: torch.Tensor | None = None, guidance: float = 1.0, num_classes: int = 0,
           spacing: str | None = None, clip: bool = True) -> torch.Tensor:
    """Draw images with a sampler (SAMPLERS); the result is a function of (weights, seed, sampler settings, device
    type). Image i of the batch is image `first_image` + i of the draw seeded `seed`: its noise, the initial x_T
    and every later draw, comes from its own generator (fastddpm.rng.ImageNoise), so it does not depend on the
    batch it is drawn in nor on the batch size (up to float rounding in the network's batched arithmetic). Every
    sampler starts from the same x_T. torch's CPU and CUDA generators draw different numbers for one seed. A
    conditional model samples `labels` ((B,) integer class ids, each in 0 .. num_classes, where num_classes is the
    null class; None: unconditional) with classifier-free guidance W = `guidance` >= 0
    (fastddpm.diffusion.guidance); `num_classes` is the model's. `eta` in [0, 1] is DDIM's (Song et al. eq. 16).
    `clip` clamps every x0 prediction to the data range [-1, 1]. `spacing` None: the sampler's own on this model's
    objective (config.default_spacing)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")
    check_eta(eta)
    if not (math.isfinite(guidance) and guidance >= 0):
        raise ValueError(f"guidance={guidance} must be a finite number >= 0 (0: unconditional, 1: plain "
                         "conditional, above 1: guided)")
    continuous = isinstance(schedule, ContinuousProcess)
    if continuous and sampler not in CONTINUOUS_SAMPLERS:
        raise ValueError(f"--sampler {sampler} walks the discrete timesteps of --objective ddpm; this "
                         f"{schedule.name} model samples with {', '.join(CONTINUOUS_SAMPLERS)} "
                         "(ancestral: ddim with --eta 1)")
    spacing = spacing or default_spacing(sampler, schedule.name if continuous else "ddpm")
    if spacing not in SPACINGS:
        raise ValueError(f"unknown spacing {spacing!r}: choose one of {', '.join(SPACINGS)}")
    if labels is not None:
        if not num_classes:
            raise ValueError("class labels need a conditional model: num_classes is 0")
        check_labels(labels, shape[0], num_classes)
        model = guided(model, labels.to(device), guidance, num_classes)
    if first_image < 0:
        raise ValueError(f"first_image={first_image} must be >= 0 (the index of the batch's first image in the draw)")
    noise = ImageNoise(device, seed, first_image, shape[0])
    common = dict(prediction=prediction, noise=noise, device=device, clip=clip,
                  autocast_dtype=autocast_dtype, progress=progress)
    if continuous:
        return continuous_sample(model, schedule, shape, sampler=sampler, steps=steps, eta=eta, spacing=spacing,
                                 **common)
    if sampler == "ddpm":
        return ddpm_sample(model, schedule, shape, **common)
    if sampler == "euler":  # DDIM with eta = 0 is Euler's method on the probability-flow ODE
        return ddim_sample(model, schedule, shape, steps=steps, eta=0.0, spacing=spacing, **common)
    if sampler == "ddim":
        return ddim_sample(model, schedule, shape, steps=steps, eta=eta, spacing=spacing, **common)
    return ode_sample(model, schedule, shape, solver=sampler, steps=steps, spacing=spacing, **common)


def check_labels(labels: torch.Tensor, batch_size: int, num_classes: int) -> None:
    """`labels` are (batch_size,) integer class ids in 0 .. num_classes (num_classes itself: the null class,
    unconditional), else a ValueError naming the bad value: an id past the embedding table would otherwise be an
    IndexError on the CPU and a device-side assert on CUDA, and at W = 0 would pass unnoticed."""
    if not isinstance(labels, torch.Tensor) or labels.dtype == torch.bool or labels.is_floating_point() \
            or labels.is_complex():
        raise ValueError(f"labels must be an integer tensor of class ids, got "
                         f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    if tuple(labels.shape) != (batch_size,):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for a batch of {batch_size}: give one class id per "
                         f"image, shape ({batch_size},) (torch.full(({batch_size},), y) for one class)")
    bad = labels[(labels < 0) | (labels > num_classes)]  # note: a host sync where labels are on the GPU
    if bad.numel():
        raise ValueError(f"label {int(bad[0])} is out of range: this model has classes 0-{num_classes - 1} and "
                         f"{num_classes} for its null class (unconditional)")


@torch.no_grad()
def continuous_sample(model, process: ContinuousProcess, shape: tuple[int, ...], *, sampler: str, steps: int,
                      eta: float = 0.0, spacing: str, prediction: str = "epsilon", noise: ImageNoise,
                      device: torch.device | str, clip: bool = True, autocast_dtype: torch.dtype | None = None,
                      progress=None) -> torch.Tensor:
    """Any of CONTINUOUS_SAMPLERS on an EDM or flow-matching model (fastddpm.diffusion.continuous), over `steps`
    levels of the process, noisiest first, then to sigma = 0. Starts from sigma_0 times the seed's noise (the
    x_0 part, alpha_0 x_0, is left out, as EDM's sampler does). `prediction` is the objective's own."""
    check_eta(eta)
    lambda_based = sampler in ("dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun")
    levels = process.sampling_levels(steps, spacing, finite_lambda=lambda_based)
    pairs = [process.alpha_sigma(float(v)) for v in levels]
    alpha, sigma = [float(a) for a, _ in pairs] + [1.0], [float(s) for _, s in pairs] + [0.0]
    lam = [math.log(a / s) for a, s in zip(alpha[:-1], sigma[:-1])] + [math.inf] if lambda_based else None
    x = sigma[0] * noise.randn(shape)
    draw = lambda: noise.randn(shape)  # noqa: E731

    def denoise(x_t: torch.Tensor, i: int) -> torch.Tensor:
        level_B = torch.full((x_t.shape[0],), levels[i], device=x_t.device, dtype=torch.float32)
        x_in, c_noise_B = process.net_input(x_t, level_B)
        with autocast(x_t.device.type, autocast_dtype):
            out = model(x_in, c_noise_B).float()
        x0 = process.x0(out, x_t, level_B)
        if progress is not None:
            progress.update(1)
        return x0.clamp(-1.0, 1.0) if clip else x0

    if sampler in ("euler", "ddim"):
        return ddim_levels(denoise, x, alpha, sigma, eta=0.0 if sampler == "euler" else eta, noise=draw)
    if sampler == "dpmpp-2m":
        return dpmpp_2m(denoise, x, alpha, sigma, lam)
    if sampler == "dpmpp-2m-sde":
        return dpmpp_2m_sde(denoise, x, alpha, sigma, lam, noise=draw)
    if sampler == "unipc":
        return unipc_2(denoise, x, alpha, sigma, lam)
    return heun_2(denoise, x, alpha, sigma)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 pixels, rounding to nearest. Computed in float32: bfloat16 and float16 have too few
    mantissa bits to hold (x + 1) * 127.5 to within 0.5, so they would round some pixels to a neighbour."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
