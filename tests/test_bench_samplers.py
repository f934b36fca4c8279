"""`bench samplers`: the points it draws (sampler, steps, seed) and the step counts it refuses before any sampling.
The whole command on a trained checkpoint is tested in tests/test_samplers.py."""

import pytest

from fastddpm.bench.samplers import SamplerBenchSettings, check_points, points
from fastddpm.config import ConfigError, apply_overrides, get_preset


def _settings(**kw) -> SamplerBenchSettings:
    return SamplerBenchSettings(checkpoint="unused", **kw)


def test_ddpm_named_among_the_samplers_is_its_one_point_over_all_timesteps():
    """DDPM walks all T steps whatever the step count: `--samplers ddim,ddpm --steps 5,10` draws DDPM once, as
    (ddpm, T), not as rows labelled 5 and 10 steps that each ran 1,000."""
    s = _settings(samplers=("ddim", "ddpm"), steps=(5, 10), spread_points=("ddpm-50",), spread_seeds=(1,))
    assert points(s, 1000) == [("ddim", 5, 0), ("ddim", 10, 0), ("ddpm", 1000, 0), ("ddpm", 1000, 1)]


def test_points_a_model_cannot_be_sampled_at_are_left_out_and_said_before_any_sampling():
    """A model trained with 50 timesteps and the default grid: ddim-100 (grid and spread point) exceeds its T, and the
    ODE solvers walk at most 46 of its timesteps. Those points are left out with the reason, the rest are drawn; the
    spread point ddim-100 used to reach the solver mid-table and end the run in a traceback."""
    s = _settings()
    cfg = apply_overrides(get_preset("tiny"), {"diffusion.num_timesteps": 50}, source="test")
    lines = []
    todo = check_points(points(s, 50), s, cfg, lines.append)
    assert ("ddim", 50, 0) in todo and ("ddim", 50, 2) in todo and ("ddpm", 50, 0) in todo
    assert ("dpmpp-2m", 20, 1) in todo and ("heun", 20, 0) in todo
    assert not any(k == 100 for _, k, _ in todo) and ("dpmpp-2m", 50, 0) not in todo
    assert any(line.startswith("bench samplers: ddim-100 left out: steps=100 must be between 1 and the number of "
                               "diffusion timesteps (50)") for line in lines)
    assert any(line.startswith("bench samplers: dpmpp-2m-50 left out:") and "(46)" in line for line in lines)


def test_no_point_left_is_a_flag_error_naming_the_limit():
    """Nothing this model can walk (dpmpp-2m at 1,000 steps on the cosine schedule, whose solvers start at t = 995):
    a ConfigError (exit code 2) naming the point, the limit and the flag, before the feature network is built."""
    cfg = apply_overrides(get_preset("tiny"), {"diffusion.schedule": "cosine"}, source="test")
    s = _settings(samplers=("dpmpp-2m",), steps=(1000,), ddpm=False, spread_points=())
    with pytest.raises(ConfigError, match=r"no point left.*1000 timesteps.*dpmpp-2m-1000: .*996.*--steps"):
        check_points(points(s, 1000), s, cfg, lambda line: None)
    ok = _settings(samplers=("dpmpp-2m",), steps=(10, 20), ddpm=False, spread_points=())
    assert check_points(points(ok, 1000), ok, cfg, print) == [("dpmpp-2m", 10, 0), ("dpmpp-2m", 20, 0)]
