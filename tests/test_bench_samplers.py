"""`bench samplers`: the points it draws (sampler, steps, seed) and the step counts it refuses before any sampling.
The whole command on a trained checkpoint is tested in tests/test_samplers.py."""

import pytest

from fastddpm.bench import cli as bench_cli
from fastddpm.bench.samplers import QUICK, SamplerBenchSettings, check_points, points, samplers_figure
from fastddpm.config import ConfigError, apply_overrides, get_preset


def _settings(**kw) -> SamplerBenchSettings:
    return SamplerBenchSettings(checkpoint="unused", **kw)


def _cli_settings(*flags: str) -> SamplerBenchSettings:
    from fastddpm.cli import build_parser

    args = build_parser()[0].parse_args(["bench", "samplers", "RUN", *flags])
    return bench_cli.samplers_settings(args)


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
    with pytest.raises(ConfigError, match=r"no point asked for is left.*1000 timesteps.*dpmpp-2m-1000: .*996.*--steps"):
        check_points(points(s, 1000), s, cfg, lambda line: None)
    ok = _settings(samplers=("dpmpp-2m",), steps=(10, 20), ddpm=False, spread_points=())
    assert check_points(points(ok, 1000), ok, cfg, print) == [("dpmpp-2m", 10, 0), ("dpmpp-2m", 20, 0)]


def test_a_narrowed_grid_draws_only_the_default_spread_points_inside_it():
    """`--samplers dpmpp-2m --steps 3 --no-ddpm` is one point, not 13 (the default spread points ddim-50, ddim-100,
    dpmpp-2m-10 and dpmpp-2m-20 with 3 seeds each); a default spread point inside the narrowed grid stays, and
    --spread-points is always honoured."""
    cfg = get_preset("tiny")
    lines = []
    one = _cli_settings("--samplers", "dpmpp-2m", "--steps", "3", "--num-samples", "10", "--no-ddpm")
    assert check_points(points(one, 1000), one, cfg, lines.append) == [("dpmpp-2m", 3, 0)]
    assert lines == ["bench samplers: no seed spread measured: none of the default spread points (ddim-50, "
                     "ddim-100, dpmpp-2m-10, dpmpp-2m-20) lies in the grid asked for; add one with --spread-points "
                     "SAMPLER-STEPS"]
    readme = _cli_settings("--samplers", "dpmpp-2m", "--steps", "8,10,12", "--no-ddpm")
    lines.clear()
    assert check_points(points(readme, 1000), readme, cfg, lines.append) == [
        ("dpmpp-2m", 8, 0), ("dpmpp-2m", 10, 0), ("dpmpp-2m", 12, 0), ("dpmpp-2m", 10, 1), ("dpmpp-2m", 10, 2)]
    assert lines == []
    steps = _cli_settings("--steps", "10,50")  # every sampler at 10 and 50: ddim-50 and dpmpp-2m-10 stay
    assert [p for p in points(steps, 1000) if p[2] != 0] == [("ddim", 50, 1), ("ddim", 50, 2), ("dpmpp-2m", 10, 1),
                                                            ("dpmpp-2m", 10, 2)]
    asked = _cli_settings("--samplers", "dpmpp-2m", "--steps", "3", "--no-ddpm", "--spread-points", "ddim-100")
    assert points(asked, 1000) == [("dpmpp-2m", 3, 0), ("ddim", 100, 0), ("ddim", 100, 1), ("ddim", 100, 2)]
    full = _cli_settings()  # nothing narrowed: every default spread point, as before
    assert len(points(full, 1000)) == 5 * 5 + 1 + 4 * 2
    quick = _cli_settings("--quick", "--samplers", "unipc")  # --quick's ddim-4 is not in unipc's grid
    assert points(quick, 1000) == [("unipc", 2, 0), ("unipc", 4, 0)]


def test_every_point_asked_for_left_out_is_a_flag_error_even_where_others_would_fit():
    """`--quick --samplers dpmpp-2m --steps 2000` used to drop its one point and measure --quick's ddim-4 (exit 0);
    `--samplers dpmpp-2m --steps 2000` would measure only the DDPM reference. Both are a ConfigError naming the point
    and why, before anything is measured."""
    cfg = get_preset("tiny")
    for flags in (("--quick",), ()):
        s = _cli_settings(*flags, "--samplers", "dpmpp-2m", "--steps", "2000")
        lines = []
        with pytest.raises(ConfigError, match=r"no point asked for is left to draw on this model \(1000 timesteps\): "
                                              r"dpmpp-2m-2000: steps=2000 must be between 1 and .*--steps"):
            check_points(points(s, 1000), s, cfg, lines.append)
        assert [line for line in lines if "left out" in line] == [
            "bench samplers: dpmpp-2m-2000 left out: steps=2000 must be between 1 and the number of diffusion "
            "timesteps (1000) on this model"]
    # one point asked for that fits (a --spread-points one) is enough: the others are left out as before
    s = _cli_settings("--samplers", "dpmpp-2m", "--steps", "2000", "--no-ddpm", "--spread-points", "ddim-4",
                      "--spread-seeds", "1")
    assert check_points(points(s, 1000), s, cfg, lambda line: None) == [("ddim", 4, 0), ("ddim", 4, 1)]


@pytest.mark.parametrize("objective", ["ddpm", "edm", "flow"])
def test_quick_runs_dpmpp_2m_sde_and_every_default_sampler_on_every_objective(objective):
    """--quick measures dpmpp-2m-sde (the auto sampler of DDPM and EDM models), and neither --quick's samplers nor
    the default ones are refused by any objective's model."""
    cfg = apply_overrides(get_preset("tiny"), {"diffusion.objective": objective}, source="test")
    T = cfg.diffusion.num_timesteps
    quick = _cli_settings("--quick")
    todo = check_points(points(quick, T, objective), quick, cfg, lambda line: None)
    assert {s for s, _, _ in todo} == {"ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun"}
    assert ("dpmpp-2m-sde", 2, 0) in todo and ("dpmpp-2m-sde", 4, 0) in todo and ("ddim", 4, 1) in todo
    assert len(todo) == 5 * 2 + 1 and QUICK["num_samples"] == 20  # still a pipeline check
    default = _settings()
    assert {s for s, _, _ in points(default, T, objective)} >= set(default.samplers)


def _summary(fids: dict[int, float], spread: tuple[float, float] | None = None) -> dict:
    rows = [{"sampler": "dpmpp-2m", "steps": k, "nfe": k, "seeds": 1, "fid": f, "fid_min": f, "fid_max": f}
            for k, f in fids.items()]
    if spread:
        rows[0].update(seeds=3, fid_min=spread[0], fid_max=spread[1])
    return {"summary": rows, "rows": [], "checkpoint": {"file": "/runs/x/ema.safetensors"},
            "settings": {"num_samples": 2000},
            "features": {"label": "fastddpm-features (not comparable to published Inception FID)"}}


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    lo, hi = sorted(ax.get_ylim())
    labels = [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels() if t.get_text()]
    return ax, [(y, text) for y, text in labels if lo <= y <= hi]


def test_the_chart_labels_its_fid_axis_readably_over_the_whole_range():
    """FID 85-147: the y label fits in the figure and the feature space is in the title; the axis is labelled
    across the range (a log axis labelled only 90 and 100, so 147 could not be read)."""
    fig = samplers_figure(_summary({5: 147.0, 10: 101.0, 20: 88.0}, spread=(140.0, 152.0)))
    ax, labels = _drawn(fig)
    assert ax.get_ylabel() == "FID" and "not comparable to published Inception FID" in ax.get_title()
    box, page = ax.yaxis.label.get_window_extent(), fig.bbox
    assert page.y0 <= box.y0 and box.y1 <= page.y1 and page.x0 <= box.x0
    values = [y for y, _ in labels]
    assert len(values) >= 4 and min(values) <= 95 and max(values) >= 140
    assert all(text == f"{y:g}" for y, text in labels)  # plain numbers, no 10^x
    # over more than a decade: a log axis labelled at 1, 2 and 5 of each decade, 5 to 500
    fig = samplers_figure(_summary({3: 480.0, 10: 60.0, 50: 6.0}))
    ax, labels = _drawn(fig)
    assert ax.get_yscale() == "log" and {text for _, text in labels} >= {"10", "20", "50", "100", "200"}


def test_the_nfe_axis_is_labelled_at_the_points_measured():
    """matplotlib's log axis labelled NFE 5-20 at 6, 10 and 20 (5 unlabelled, 6 never measured); the chart labels
    the network-call counts drawn, thinned where the labels would overlap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from fastddpm.charts import spaced_log_ticks

    fig = samplers_figure(_summary({5: 147.0, 10: 101.0, 20: 88.0}))
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ax.get_xscale() == "log" and shown == ["5", "10", "20"]
    assert spaced_log_ticks([4, 2, 2, 8]) == [2, 4, 8]
    # a DDPM point at 1000 calls beside few-step samplers: about 14 labels at most, the ends always
    many = [2, 3, 4, 5, 7, 9, 10, 19, 20, 39, 40, 49, 50, 99, 100, 1000]
    kept = spaced_log_ticks(many)
    assert kept[0] == 2 and kept[-1] == 1000 and len(kept) <= 14 and 19 in kept and 20 not in kept
