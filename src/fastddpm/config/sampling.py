"""Sampler names, what `auto` samples each objective's models with, and the timestep spacings (the math:
fastddpm.diffusion.samplers and .ode_solvers). Imports nothing: the config's schema and the commands' flags read it.
"""

from __future__ import annotations

SAMPLERS = ("ddpm", "ddim", "euler", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun")
# What `auto` samples DDPM and EDM models with: SDE-DPM-Solver++(2M) in 20 network calls
# (benchmarks/RESULTS.md, "Few-step samplers"). On the CPU demo's checkpoints (2,000 samples) it beats every ODE
# sampler at any number of calls: unconditional FID 7.9 against 12.1-12.5 for the best ODE points (UniPC-20) and 6.5
# for DDPM over all 1,000 steps; conditional 2.17 at W = 2 (3 seeds) against UniPC-20's best, 2.56 at W = 3. 50 steps
# gain ~1.4 (unconditional) at 2.5x the time: --steps 50. The ODE solvers level off where a stochastic sampler does
# not: each step's fresh noise washes out the errors of the steps before. (Not yet measured on a GPU-trained model.)
DEFAULT_SAMPLER = "dpmpp-2m-sde"
DEFAULT_SAMPLER_STEPS = 20
# A flow-matching model's own pair: Heun with 10 steps (19 network calls). On the unconditional CPU demo (three
# training seeds, 2,000 samples each) it scored FID 5.17, 4.95 and 5.30 against SDE-DPM-Solver++(2M) 20 steps' 5.72,
# 5.48 and 6.52 and UniPC 10 steps' 5.70, 5.30 and 5.77 (benchmarks/RESULTS.md, "Objectives on the CPU demo"): flow's
# nearly straight paths suit a deterministic second-order solver, where DDPM's and EDM's models score best with the
# SDE solver. `auto` (the default of `sample`, `eval`, the grids and --eval-every) is the objective's pair.
OBJECTIVE_SAMPLING = {"flow": ("heun", 10)}
# A guided flow model's pair (a conditional model sampled with classifier-free guidance W > 1): UniPC with 10 steps.
# On the conditional CPU demo at W = 2 (three training seeds, 2,000 samples each) it scored FID 1.90, 1.75 and 1.91
# against Heun-10's 2.26, 2.03 and 2.04 (class accuracy 94.0-94.5% against 93.3-95.0%), and SDE-DPM-Solver++(2M) 20
# steps' 3.85, 3.24 and 3.39, in about half Heun's network calls (10 against 19, each a forward of the doubled batch
# under guidance). Unguided (W <= 1) a conditional flow model keeps Heun, as measured unconditionally. DDPM and EDM
# models keep the SDE solver guided too: the DDPM model's best at W = 2 was SDE-20 (1.96) against UniPC-10's 4.12.
GUIDED_OBJECTIVE_SAMPLING = {"flow": ("unipc", 10)}
SAMPLER_CHOICES = ("auto", *SAMPLERS)
# `sample`'s and `eval`'s help for the two flags
SAMPLER_HELP = (f"default auto: the model's objective's best on the CPU demo, heun for flow (unipc when guided, "
                f"W > 1), {DEFAULT_SAMPLER} for ddpm and edm")
STEPS_HELP = (f"sampler steps (default: 10 where --sampler auto picks heun or unipc, else {DEFAULT_SAMPLER_STEPS}, a "
              "sampler named by --sampler included, or as many as a short schedule takes; DDPM uses all T and takes "
              "no --steps; Heun makes 2K-1 network calls)")
SPACINGS = ("trailing", "karras", "logsnr")


def resolve_sampling(sampler: str, steps: int | None, objective: str, *, guided: bool = False) -> tuple[str, int]:
    """The (sampler, steps) to run for a model of `objective`, `guided` where its samples are drawn with
    classifier-free guidance W > 1: `auto` is the objective's pair (GUIDED_OBJECTIVE_SAMPLING when guided, else
    OBJECTIVE_SAMPLING, else DEFAULT_SAMPLER with DEFAULT_SAMPLER_STEPS) and `steps`, where given, replaces its
    steps; a named sampler runs `steps`, or DEFAULT_SAMPLER_STEPS where none are given."""
    if sampler == "auto":
        pairs = {**OBJECTIVE_SAMPLING, **GUIDED_OBJECTIVE_SAMPLING} if guided else OBJECTIVE_SAMPLING
        auto_sampler, auto_steps = pairs.get(objective, (DEFAULT_SAMPLER, DEFAULT_SAMPLER_STEPS))
        return auto_sampler, auto_steps if steps is None else steps
    return sampler, DEFAULT_SAMPLER_STEPS if steps is None else steps


def default_spacing(sampler: str, objective: str = "ddpm") -> str:
    """A sampler's own timesteps on a model of `objective`: Karras et al.'s noise levels (rho = 7) for Heun, which is
    defined with them (its steps in sigma need them: uniform steps put one huge step at high noise), and for every
    sampler of an EDM model, whose noise levels they are; evenly spaced 'trailing' timesteps for the others."""
    return "karras" if sampler == "heun" or objective == "edm" else "trailing"
