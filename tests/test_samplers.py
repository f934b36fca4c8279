"""The few-step samplers (DPM-Solver++(2M), UniPC, Heun) against diffusers' schedulers, the field's reference:
the same model, the same initial noise, fastddpm's own betas (`trained_betas`), the same samples to float
tolerance. Then what makes them worth having: on a problem whose exact answer is known, second order."""

import json
import math

import numpy as np
import pytest
import torch

from fastddpm.cli import main
from fastddpm.config import apply_overrides, get_preset, resolve_model_shape
from fastddpm.diffusion import (
    SAMPLERS,
    karras_timesteps,
    logsnr_timesteps,
    make_schedule,
    network_calls,
    sample,
    sampler_timesteps,
)
from fastddpm.diffusion.continuous import CONTINUOUS_SAMPLERS
from fastddpm.rng import ImageNoise
from fastddpm.trainer.loop import train

from eval_fixtures import fmnist_splits  # noqa: F401 - a session fixture (a real train/test slice)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy 2's copy keyword, inside diffusers

SHAPE = (3, 1, 4, 4)
SEED = 7


def smooth_model(x, t):
    """A deterministic network stand-in: smooth in x, different at every timestep, mixing pixels a little."""
    c = (t.to(x.dtype) / 1000.0).reshape(-1, 1, 1, 1)
    return torch.tanh(0.7 * x + c) * (0.5 + c) + 0.1 * x.mean(dim=(1, 2, 3), keepdim=True)


@pytest.fixture(scope="module")
def diffusers():
    return pytest.importorskip("diffusers", reason="diffusers is a test extra: pip install -e '.[test]'")


def reference(diffusers, name: str, schedule, prediction: str, timesteps: list[int]) -> torch.Tensor:
    """diffusers' scheduler `name` run on `timesteps` from fastddpm's initial noise for SEED."""
    betas = schedule.float64("betas").numpy()
    kw = dict(num_train_timesteps=schedule.num_timesteps, trained_betas=betas, timestep_spacing="trailing",
              prediction_type={"epsilon": "epsilon", "v": "v_prediction"}[prediction])
    if name in ("dpmpp-2m", "dpmpp-2m-sde"):
        algorithm = {"dpmpp-2m": "dpmsolver++", "dpmpp-2m-sde": "sde-dpmsolver++"}[name]
        sch = diffusers.DPMSolverMultistepScheduler(algorithm_type=algorithm, solver_order=2, **kw)
        sch.set_timesteps(timesteps=timesteps)
    elif name == "unipc":  # UniPC takes no custom timesteps: set them as diffusers' own set_timesteps would
        sch = diffusers.UniPCMultistepScheduler(solver_order=2, solver_type="bh2", predict_x0=True, **kw)
        sch.set_timesteps(len(timesteps))
        sch.timesteps = torch.tensor(timesteps)
    elif name == "heun":
        sch = diffusers.HeunDiscreteScheduler(**kw)
        sch.set_timesteps(timesteps=timesteps)
    else:
        sch = diffusers.DDIMScheduler(clip_sample=False, set_alpha_to_one=True, **kw)
        sch.set_timesteps(len(timesteps))
        assert sch.timesteps.tolist() == timesteps
        sch.alphas_cumprod = schedule.float64("alpha_bar")
    # Noise levels from the float64 schedule, in float64 where diffusers computes them: diffusers keeps them in
    # float32, and Heun's variance-exploding variables (x / alpha, up to ~1e4 at the start of a cosine schedule)
    # then lose the digits this comparison is about; fastddpm's float32 arithmetic avoids that form.
    if name != "ddim":
        ab = schedule.float64("alpha_bar")[sch.timesteps.long()]
        sch.sigmas = torch.cat([((1 - ab) / ab).sqrt(), torch.zeros(1, dtype=torch.float64)])
    draws = ImageNoise("cpu", SEED, 0, SHAPE[0])  # fastddpm's per-image noise, in its order
    noise = draws.randn(SHAPE)
    x = noise.double() * (sch.sigmas[0] ** 2 + 1) ** 0.5 if name == "heun" else noise * sch.init_noise_sigma
    for i, t in enumerate(sch.timesteps):
        out = smooth_model(sch.scale_model_input(x, t), torch.full((SHAPE[0],), float(t), dtype=x.dtype))
        kw = {}
        if name == "dpmpp-2m-sde":  # fastddpm's draws, in its order: one per step after the initial noise, none on
            last = i == len(sch.timesteps) - 1  # the last step (which diffusers scales by sigma = 0)
            kw["variance_noise"] = torch.zeros(SHAPE) if last else draws.randn(SHAPE)
        x = sch.step(out, t, x, **kw).prev_sample
    return x.float()


CASES = [(name, steps, spacing) for name in ("dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun", "ddim")
         for steps, spacing in ((5, "trailing"), (20, "trailing"), (10, "karras"))
         if (name, spacing) != ("ddim", "karras")]  # diffusers' DDIM steps by T // K: no custom timesteps


@pytest.mark.parametrize("schedule_kind,prediction", [("linear", "epsilon"), ("cosine", "v"), ("cosine", "epsilon"),
                                                      ("linear", "v")])
@pytest.mark.parametrize("name,steps,spacing", CASES)
def test_samplers_equal_diffusers_schedulers(diffusers, name, steps, spacing, schedule_kind, prediction):
    schedule = make_schedule(schedule_kind, 1000)
    ours = sample(smooth_model, schedule, SHAPE, sampler=name, steps=steps, spacing=spacing, prediction=prediction,
                  seed=SEED, clip=False)
    ts = sampler_timesteps(schedule, name, steps, spacing)
    if schedule_kind == "cosine" and name != "ddim":  # they start below the cosine schedule's last, clipped betas
        assert ts[0] == 995
    ref = reference(diffusers, name, schedule, prediction, ts)
    # relative to the samples' scale: unclipped x0 predictions at high noise reach |x| ~ 10
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 5e-5


def test_karras_timesteps_are_diffusers_karras_sigmas_rounded_to_trained_timesteps(diffusers):
    schedule = make_schedule("linear", 1000)
    for steps in (5, 10, 20):
        sch = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000, use_karras_sigmas=True,
                                                    trained_betas=schedule.float64("betas").numpy())
        sch.set_timesteps(steps)
        assert karras_timesteps(schedule, steps) == sch.timesteps.tolist()
    ts = karras_timesteps(schedule, 100)  # dense at low noise: levels that round to one timestep are kept once
    assert ts == sorted(set(ts), reverse=True) and 90 < len(ts) < 100 and ts[0] == 999 and ts[-1] == 0


def test_logsnr_timesteps_are_diffusers_lu_lambdas(diffusers):
    """Evenly spaced in lambda (DPM-Solver's spacing for low-resolution images), as diffusers' use_lu_lambdas."""
    for kind in ("linear", "cosine"):
        schedule = make_schedule(kind, 1000)
        for steps in (5, 10, 20):
            sch = diffusers.DPMSolverMultistepScheduler(num_train_timesteps=1000, use_lu_lambdas=True,
                                                        trained_betas=schedule.float64("betas").numpy())
            sch.set_timesteps(steps)
            if kind == "linear":  # diffusers starts at T-1 (its lambda_min_clipped is off by default)
                assert logsnr_timesteps(schedule, steps) == sch.timesteps.tolist()
            lam = 0.5 * torch.log(schedule.float64("alpha_bar") / (1 - schedule.float64("alpha_bar")))
            ours = sampler_timesteps(schedule, "dpmpp-2m", steps, spacing="logsnr")
            gaps = torch.diff(lam[ours])  # even in lambda up to rounding to trained timesteps
            assert (gaps > 0).all() and gaps.max() / gaps.min() < 1.5


@pytest.mark.parametrize("name", SAMPLERS)
def test_network_calls_are_what_each_sampler_makes(name):
    schedule = make_schedule("linear", 50)
    calls = []

    def counting(x, t):
        calls.append(int(t[0]))
        return smooth_model(x, t)

    sample(counting, schedule, SHAPE, sampler=name, steps=6, seed=1)
    assert len(calls) == network_calls(name, 6, 50) == {"ddpm": 50, "heun": 11}.get(name, 6)
    # ddpm, ddim and euler start at the noisiest trained timestep; the solvers at the noisiest with lambda >=
    # LAMBDA_MIN: at T = 50 the linear betas, scaled by 1000 / T, end at lambda -5.88, and that is timestep 45
    assert calls[0] == (49 if name in ("ddpm", "ddim", "euler") else 45) == sampler_timesteps(schedule, name, 6)[0]


def gaussian_data_eps(schedule, s_data: float):
    """The exact epsilon-prediction for data drawn from N(0, s_data^2): x0_hat = alpha s^2 x_t / (alpha^2 s^2 +
    sigma^2) (the posterior mean), eps = (x_t - alpha x0_hat) / sigma."""
    ab = schedule.float64("alpha_bar")

    def eps(x, t):
        a, sig = ab[t].sqrt().float().view(-1, 1, 1, 1), (1 - ab[t]).sqrt().float().view(-1, 1, 1, 1)
        x0 = a * s_data**2 * x / (a**2 * s_data**2 + sig**2)
        return (x - a * x0) / sig
    return eps


@pytest.mark.parametrize("schedule_kind", ["linear", "cosine"])
def test_solvers_are_second_order_on_a_problem_with_a_known_answer(schedule_kind):
    """Gaussian data N(0, s^2): the exact denoiser is x0_hat = alpha s^2 x_t / (alpha^2 s^2 + sigma^2), and the
    probability-flow ODE maps x_T to x_0 = s x_T / sqrt(alpha_T^2 s^2 + sigma_T^2) exactly. DDIM's error halves
    when the steps double (first order); the other solvers' falls ~4x or more (second order) and is far smaller.
    (On the cosine schedule Heun diverges if it starts at T-1, sigma~ = 20,000: ode_solvers.LAMBDA_MIN.)"""
    s_data = 0.5
    schedule = make_schedule(schedule_kind, 1000)
    ab = schedule.float64("alpha_bar")
    exact_eps = gaussian_data_eps(schedule, s_data)

    noise = ImageNoise("cpu", SEED, 0, SHAPE[0]).randn(SHAPE)  # sample's initial noise

    def error(name: str, steps: int) -> float:
        t0 = sampler_timesteps(schedule, name, steps, "trailing")[0]  # the exact answer from where it starts
        target = s_data * noise / math.sqrt(float(ab[t0]) * s_data**2 + 1 - float(ab[t0]))
        x = sample(exact_eps, schedule, SHAPE, sampler=name, steps=steps, seed=SEED, clip=False, spacing="trailing")
        return (x - target).abs().max().item()

    err = {(n, k): error(n, k) for n in ("ddim", "dpmpp-2m", "unipc", "heun") for k in (20, 40)}
    assert 1.6 < err["ddim", 20] / err["ddim", 40] < 2.6, err
    for n in ("dpmpp-2m", "unipc", "heun"):
        if schedule_kind == "linear":  # on cosine the lower-order final step (x0_hat from t ~ T/K) sets the error
            assert err[n, 20] / err[n, 40] > 3.0, (n, err)  # at 20-40 steps, first order in 1/K but 20x below DDIM
        assert err[n, 40] < err["ddim", 40] / 3, (n, err)
        assert err[n, 20] < err["ddim", 20] / 2.5, (n, err)


@pytest.mark.parametrize("schedule_kind", ["linear", "cosine"])
def test_the_sde_solver_draws_the_data_distribution_where_it_is_known(schedule_kind):
    """Gaussian data N(0, s^2) with its exact denoiser: the reverse SDE's samples are N(0, s^2) too. SDE-DPM-Solver++
    draws them with the right spread, converging with the steps (measured: 2-4% off at 20 steps, 0-2% at 100, on
    20,000 draws), and far closer at 20 steps than DDIM with eta = 1, the stochastic sampler fastddpm had (12-22%
    too narrow). It injects fresh noise at every step, so a seed fixes its samples and another seed changes them."""
    s_data = 0.5
    schedule = make_schedule(schedule_kind, 1000)
    exact_eps = gaussian_data_eps(schedule, s_data)
    shape = (20_000, 1, 1, 1)

    def draw(steps: int, sampler: str = "dpmpp-2m-sde", seed: int = SEED, **kw) -> torch.Tensor:
        return sample(exact_eps, schedule, shape, sampler=sampler, steps=steps, seed=seed, clip=False, **kw)

    def spread_error(x: torch.Tensor) -> float:
        return abs(x.std().item() / s_data - 1)

    x100 = draw(100)
    assert spread_error(x100) < 0.025 and abs(x100.mean().item()) < 0.02
    assert spread_error(draw(3)) > 0.2  # far off at 3 steps: the check can fail
    assert spread_error(draw(20)) < spread_error(draw(20, "ddim", eta=1.0)) / 3
    x = draw(20)
    torch.testing.assert_close(draw(20), x, rtol=0, atol=0)  # a function of the seed
    assert (draw(20, seed=SEED + 1) - x).abs().mean() > 0.1
    assert (draw(20, "dpmpp-2m") - x).abs().mean() > 0.1  # the same initial noise, not the ODE's deterministic map


def test_unknown_sampler_or_spacing_is_refused_naming_the_choices():
    schedule = make_schedule("linear", 50)
    with pytest.raises(ValueError, match="dpmpp-2m, dpmpp-2m-sde, unipc, heun"):
        sample(smooth_model, schedule, SHAPE, sampler="dpm++")
    with pytest.raises(ValueError, match="trailing, karras, logsnr"):
        sample(smooth_model, schedule, SHAPE, sampler="unipc", spacing="quadratic")
    with pytest.raises(ValueError, match="between 1 and"):
        sample(smooth_model, schedule, SHAPE, sampler="heun", steps=51)
    assert np.all(np.diff(karras_timesteps(schedule, 8)) < 0)


def test_an_images_noise_is_its_own_whatever_the_batch():
    """Image k's draws come from (seed, k) alone: images 2-3 of a batch of 4 draw what a batch of the two drawn as
    images 2-3 draws, across the blocks of DRAWS_PER_CALL; images and seeds differ from each other."""
    shape = (1, 3, 5)
    whole, part = ImageNoise("cpu", SEED, 0, 4), ImageNoise("cpu", SEED, 2, 2)
    draws = 2 * ImageNoise.DRAWS_PER_CALL + 3
    a = torch.stack([whole.randn((4, *shape)) for _ in range(draws)])
    b = torch.stack([part.randn((2, *shape)) for _ in range(draws)])
    assert torch.equal(a[:, 2:], b)
    flat = a.transpose(0, 1).reshape(4, -1)
    assert all(not torch.equal(flat[i], flat[j]) for i in range(4) for j in range(i))
    assert not torch.equal(ImageNoise("cpu", SEED + 1, 0, 4).randn((4, *shape)), a[0])
    assert 0.9 < float(a.std()) < 1.1 and abs(float(a.mean())) < 0.1
    with pytest.raises(ValueError, match="noise for a batch of 3 from 4 image generators"):
        whole.randn((3, *shape))
    with pytest.raises(ValueError, match="one ImageNoise draws for one image shape"):
        whole.randn((4, 1, 5, 3))


@pytest.mark.parametrize("objective", ["ddpm", "edm", "flow"])
def test_every_sampler_draws_an_image_the_same_in_any_batch(objective):
    """A batch of 4 equals batches of 1 and 3 drawn as images 0 and 1-3, for every sampler of the objective, the
    stochastic ones included (the network stand-in treats each image on its own); 12 steps, so that the stochastic
    ones draw past ImageNoise's first block of draws."""
    from fastddpm.diffusion.continuous import EDM, Flow

    schedule = {"ddpm": lambda: make_schedule("linear", 100), "edm": EDM, "flow": Flow}[objective]()
    names = SAMPLERS if objective == "ddpm" else CONTINUOUS_SAMPLERS
    shape = (4, 1, 4, 4)
    for name in names:
        kw = dict(sampler=name, steps=12, seed=SEED, eta=1.0 if name == "ddim" else 0.0)
        whole = sample(smooth_model, schedule, shape, **kw)
        parts = torch.cat([sample(smooth_model, schedule, (1, 1, 4, 4), **kw),
                           sample(smooth_model, schedule, (3, 1, 4, 4), first_image=1, **kw)])
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5, msg=name)
        other = sample(smooth_model, schedule, shape, **{**kw, "seed": SEED + 1})
        assert not torch.allclose(other, whole), name
    with pytest.raises(ValueError, match="first_image=-1 must be >= 0"):
        sample(smooth_model, schedule, shape, sampler=names[0], steps=2, first_image=-1)


def tiny_run(tmp_path, source):
    """2 steps of the tiny preset without attention (at 28x28, over 784 positions, most of a sampler step's time):
    what the tests below follow is the samplers' steps and records, not the model."""
    run = tmp_path / "run"
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(source), "train.progress": False,
                                               "train.max_steps": 2, "train.num_sample_images": 2,
                                               "train.sample_steps": 2, "model.attention": False})
    train(cfg, out_dir=run, log=lambda *a, **k: None)
    return run


def test_sample_and_eval_take_every_sampler_and_say_what_it_costs(tmp_path, fmnist_splits, capsys):
    run = tiny_run(tmp_path, fmnist_splits)
    assert main(["sample", "--checkpoint", str(run), "--sampler", "heun", "--steps", "3", "--num-images", "4",
                 "--no-progress"]) == 0
    assert (run / "samples" / "heun3_n4_seed0_step2.npz").is_file()  # heun's own spacing (karras): no tag
    assert main(["sample", "--checkpoint", str(run), "--sampler", "unipc", "--steps", "3", "--spacing", "karras",
                 "--num-images", "4", "--no-progress"]) == 0
    images = np.load(run / "samples" / "unipc3-karras_n4_seed0_step2.npz")["images"]
    assert images.shape == (4, 1, 28, 28) and images.dtype == np.uint8
    assert main(["sample", "--checkpoint", str(run), "--sampler", "dpmpp-2m", "--eta", "1"]) == 2
    assert "--eta is DDIM's" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--sampler", "heun", "--steps", "3", "--num-samples", "20",
                 "--no-progress"]) == 0
    assert "karras spacing = 5 network calls each" in capsys.readouterr().out
    s = json.loads((run / "eval" / "eval_heun3_n20_seed0_step2.json").read_text())["sampling"]
    assert s["nfe"] == 5 and s["spacing"] == "karras" and s["sampler"] == "heun"


def test_bench_samplers_writes_the_table_and_resumes(tmp_path, fmnist_splits, capsys):
    run = tiny_run(tmp_path, fmnist_splits)
    out = tmp_path / "bench"
    args = ["bench", "samplers", str(run), "--quick", "--samplers", "ddim,heun", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "samplers.json").read_text())
    points = [(r["sampler"], r["steps"], r["seed"], r["nfe"]) for r in result["rows"]]
    assert points == [("ddim", 2, 0, 2), ("ddim", 4, 0, 4), ("heun", 2, 0, 3), ("heun", 4, 0, 7), ("ddim", 4, 1, 4)]
    assert result["settings"]["spread_points"] == ["ddim-4"]  # --quick's default, recorded as drawn (not null)
    assert all(r["status"] == "ok" and r["fid"] > 0 and 0 <= r["recall"] <= 1 for r in result["rows"])
    ddim4 = next(e for e in result["summary"] if (e["sampler"], e["steps"]) == ("ddim", 4))
    assert ddim4["seeds"] == 2 and ddim4["fid_min"] <= ddim4["fid"] <= ddim4["fid_max"]
    assert ddim4["fid_min"] < ddim4["fid_max"]  # other noise, other samples
    md = (out / "samplers.md").read_text()
    assert "| ddim | 4 | 4 |" in md and "| 2 (" in md and "Measured by:" in md
    assert "Guidance W" not in md  # unconditional: a call is one U-Net evaluation
    from fastddpm.bench.samplers import report_markdown

    assert "Guidance W = 2: each network call evaluates the U-Net on the class and on the null class" in \
        report_markdown({**result, "guidance": 2.0})
    assert (out / "samplers.csv").read_text().splitlines()[0].startswith("sampler,steps,nfe,seed,status,fid")
    assert (out / "samplers.png").stat().st_size > 0
    capsys.readouterr()
    assert main(args) == 0  # the same command again: every point is reused, none drawn again
    log = capsys.readouterr().out
    assert log.count("reused from") == 5 and "FID" in log
    again = json.loads((out / "samplers.json").read_text())
    assert [r["fid"] for r in again["rows"]] == [r["fid"] for r in result["rows"]]
    copy = tmp_path / "elsewhere" / "ema.safetensors"  # the same weights read from another file: the same table
    copy.parent.mkdir()
    copy.write_bytes((run / "ema.safetensors").read_bytes())
    assert main(["bench", "samplers", str(copy), *args[3:]]) == 0
    assert capsys.readouterr().out.count("reused from") == 5
    # another part of the table into the same folder: its point is added, the earlier ones stay
    assert main(["bench", "samplers", str(run), "--quick", "--samplers", "unipc", "--steps", "2", "--spread-points",
                 "none", "--out", str(out)]) == 0
    merged = json.loads((out / "samplers.json").read_text())
    assert sorted((r["sampler"], r["steps"], r["seed"]) for r in merged["rows"]) == sorted(
        [("unipc", 2, 0)] + [(r["sampler"], r["steps"], r["seed"]) for r in result["rows"]])
    assert "carried 5 point(s)" in capsys.readouterr().out
    assert main(["bench", "samplers", str(run), "--samplers", "dpm++"]) == 2
    assert "unknown sampler 'dpm++'" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun", "ddim"])
def test_cuda_graph_replayed_sampling_equals_eager(name):
    """On a GPU the sampler's network runs compiled with each step a CUDA graph replay; the solvers keep no network
    output across calls, so a replay overwriting it changes nothing: the same images as eager, to fp32 tolerance.
    And the loop itself never waits for the GPU: no host sync between the first step and the result."""
    from fastddpm.models import UNet

    torch.manual_seed(0)
    model = UNet(resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28)).model).cuda().eval()
    schedule = make_schedule("linear", 1000).to("cuda")  # moved once, as eval does, not inside the checked loop
    kw = dict(sampler=name, steps=6, seed=3, device="cuda")
    # Full fp32, so that the comparison is about the replay: under TF32 (cuDNN's default for convolutions) eager and
    # Inductor pick different kernels, and their 1e-3 differences grow over the steps (seen: 0.06 on an H100).
    switches = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        graphed, eager = _graphed_and_eager(model, schedule, kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = switches
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["dpmpp-2m-sde", "ddpm"])
def test_cuda_images_are_the_same_in_any_batch(name):
    """On a GPU too, image k's noise is its own: a batch of 8 equals batches of 3 and 5 drawn as images 0-2 and
    3-7 (fp32 without TF32, so that only the batch shape differs between the two)."""
    from fastddpm.models import UNet

    torch.manual_seed(0)
    model = UNet(resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28)).model).cuda().eval()
    schedule = make_schedule("linear", 100).to("cuda")
    kw = dict(sampler=name, steps=12, seed=3, device="cuda")
    switches = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            whole = sample(model, schedule, (8, 1, 28, 28), **kw)
            parts = torch.cat([sample(model, schedule, (3, 1, 28, 28), **kw),
                               sample(model, schedule, (5, 1, 28, 28), first_image=3, **kw)])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = switches
    torch.testing.assert_close(parts, whole, rtol=1e-3, atol=1e-3)


def _graphed_and_eager(model, schedule, kw):
    from fastddpm.sampling import compile_for_sampling

    with torch.inference_mode():
        sample(model, schedule, (8, 1, 28, 28), **kw)  # warm-up: cuDNN's algorithm search may sync
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = sample(model, schedule, (8, 1, 28, 28), **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graphed = sample(compile_for_sampling(model, torch.device("cuda")), schedule, (8, 1, 28, 28), **kw)
    return graphed, eager


def test_sampler_flags_are_checked_against_the_model_with_the_reason_and_the_fix():
    """The ODE solvers start at the noisiest timestep with half log-SNR >= -5.1 (t = 995 on the cosine schedule): more
    steps than that are refused as the flag, not left to fail in the solver; --eta on DDPM's own sampler is refused
    as what it is (ancestral, stochastic), not called deterministic."""
    from fastddpm.config import ConfigError
    from fastddpm.sampling import resolve_sampler_args

    cosine = apply_overrides(get_preset("tiny"), {"diffusion.schedule": "cosine"})
    assert resolve_sampler_args(cosine, "unipc", 996) == ("unipc", 996)
    with pytest.raises(ConfigError, match=r"--steps 997: --sampler unipc takes at most 996 steps on this cosine "
                                          r"schedule: it starts at timestep 995.*ddim and euler walk all 1000"):
        resolve_sampler_args(cosine, "unipc", 997)
    assert resolve_sampler_args(cosine, "ddim", 1000) == ("ddim", 1000)
    linear = get_preset("tiny")
    assert resolve_sampler_args(linear, "dpmpp-2m", 1000) == ("dpmpp-2m", 1000)  # its lambda at T-1 is -5.06
    with pytest.raises(ConfigError, match=r"--eta is DDIM's: --sampler ddpm is ancestral, stochastic by construction"):
        resolve_sampler_args(linear, "ddpm", None, eta=0.5)
