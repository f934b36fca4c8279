"""Self-contained diffusion math: schedules, the training objective, and samplers."""

from fastddpm.diffusion.objective import (diffusion_loss, min_snr_weights, predict_eps_and_x0, q_sample,
                                         training_target)
from fastddpm.config import SAMPLERS, SPACINGS
from fastddpm.diffusion.ode_solvers import karras_timesteps, logsnr_timesteps, solver_timesteps, trailing_timesteps
from fastddpm.diffusion.samplers import (ddim_sample, ddpm_sample, network_calls, ode_sample, sample,
                                        sampler_timesteps, to_uint8)
from fastddpm.diffusion.schedule import NoiseSchedule, cosine_betas, linear_betas, make_schedule, schedule_from_config

__all__ = [
    "NoiseSchedule", "cosine_betas", "linear_betas", "make_schedule", "schedule_from_config",
    "q_sample", "training_target", "diffusion_loss", "min_snr_weights", "predict_eps_and_x0",
    "ddpm_sample", "ddim_sample", "ode_sample", "sample", "to_uint8", "SAMPLERS", "SPACINGS", "network_calls",
    "trailing_timesteps", "karras_timesteps", "logsnr_timesteps", "solver_timesteps", "sampler_timesteps",
]
