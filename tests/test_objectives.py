"""EDM and flow matching (--objective edm / flow) beside DDPM: the samplers against references given the same
network (EDM's own Heun, their Algorithm 2 without churn; diffusers' FlowMatchEulerDiscreteScheduler with its
shift), the preconditioning pinned by hand, and the objectives trained, resumed exactly, sampled and exported on
real Fashion-MNIST images; bad combinations refused with the ones that work."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from eval_fixtures import fmnist_splits  # noqa: F401 - a session fixture (a real train/test slice)
from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, default_spacing, get_preset
from fastddpm.diffusion import sample
from fastddpm.diffusion.continuous import EDM, NOISE_INPUT_SCALE, Flow, continuous_loss
from fastddpm.rng import ImageNoise
from fastddpm.trainer.loop import train


def toy_net(x_BCHW: torch.Tensor, c_noise_B: torch.Tensor) -> torch.Tensor:
    """A fixed smooth function of the image and the noise input, standing in for a trained U-Net."""
    return torch.tanh(0.7 * x_BCHW + 0.3 * x_BCHW.roll(1, dims=-1)) * (1 + 1e-4 * c_noise_B[:, None, None, None])


def test_edm_preconditioning_by_hand():
    """Karras et al. 2022, Table 1, at sigma = 0.5 = sigma_data: c_skip = 1/2, c_out = 0.5 / sqrt(2),
    c_in = 1 / sqrt(0.5), c_noise = ln(0.5) / 4 (times the embedding's scale); the loss is
    || F - (x0 - c_skip x) / c_out ||^2, their loss weight 1 / c_out^2 folded in."""
    edm = EDM()
    sigma = torch.tensor([0.5])
    x = torch.full((1, 1, 2, 2), 2.0)
    x_in, c_noise = edm.net_input(x, sigma)
    assert x_in.flatten().tolist() == pytest.approx([2.0 / math.sqrt(0.5)] * 4)
    assert c_noise.item() == pytest.approx(math.log(0.5) / 4 * NOISE_INPUT_SCALE)
    out = torch.full_like(x, 1.0)
    assert edm.x0(out, x, sigma).flatten().tolist() == pytest.approx([0.5 * 2.0 + 0.5 / math.sqrt(2)] * 4)
    x0, noise = torch.zeros_like(x), torch.ones_like(x)
    assert edm.target(x0, noise, x, sigma).flatten().tolist() == pytest.approx([(0 - 1.0) / (0.5 / math.sqrt(2))] * 4)
    # training draws: ln sigma = P_mean + P_std z; flow's t = sigmoid(z) (logit-normal)
    z = torch.tensor([0.0, 1.0])
    assert edm.level(z).tolist() == pytest.approx([math.exp(-1.2), math.exp(0.0)])
    assert Flow().level(z).tolist() == pytest.approx([0.5, 1 / (1 + math.exp(-1))])


def test_flow_loss_is_the_velocity_regression():
    """x_t = (1 - t) x0 + t eps, target eps - x0: a network that returns eps - x0 exactly has zero loss."""
    torch.manual_seed(0)
    x0, eps = torch.randn(4, 1, 4, 4), torch.randn(4, 1, 4, 4)
    flow = Flow()

    def oracle(x_t, c_noise_B):
        t = (c_noise_B / NOISE_INPUT_SCALE)[:, None, None, None]
        assert torch.allclose(x_t, (1 - t) * x0 + t * eps, atol=1e-6)
        return eps - x0

    assert continuous_loss(oracle, flow, x0, torch.randn(4), eps).item() == pytest.approx(0.0, abs=1e-10)


def edm_algorithm_2(net, shape, *, steps, seed, sigma_min=0.002, sigma_max=80.0, rho=7.0, sigma_data=0.5):
    """EDM's deterministic sampler (Karras et al. 2022, Algorithm 2 with S_churn = 0, as their generate.py):
    Heun steps between the levels of eq. 5, Euler on the last, written from the paper."""
    i = torch.arange(steps, dtype=torch.float64)
    t_steps = (sigma_max ** (1 / rho) + i / (steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    t_steps = torch.cat([t_steps, torch.zeros(1, dtype=torch.float64)])

    def denoise(x, sigma):
        c_skip = sigma_data ** 2 / (sigma ** 2 + sigma_data ** 2)
        c_out = sigma * sigma_data / math.sqrt(sigma ** 2 + sigma_data ** 2)
        c_in = 1 / math.sqrt(sigma ** 2 + sigma_data ** 2)
        c_noise = torch.full((x.shape[0],), math.log(sigma) / 4 * NOISE_INPUT_SCALE)
        return c_skip * x + c_out * net((c_in * x).float(), c_noise).double()

    x_next = ImageNoise("cpu", seed, 0, shape[0]).randn(shape).double() * float(t_steps[0])  # fastddpm's noise
    for k in range(steps):
        t_cur, t_next = float(t_steps[k]), float(t_steps[k + 1])
        x_cur = x_next
        d_cur = (x_cur - denoise(x_cur, t_cur)) / t_cur
        x_next = x_cur + (t_next - t_cur) * d_cur
        if k < steps - 1:
            d_prime = (x_next - denoise(x_next, t_next)) / t_next
            x_next = x_cur + (t_next - t_cur) * (0.5 * d_cur + 0.5 * d_prime)
    return x_next


@pytest.mark.parametrize("steps", [2, 5, 18])
def test_edm_heun_is_edms_own_sampler(steps):
    ours = sample(toy_net, EDM(), (2, 1, 6, 6), sampler="heun", steps=steps, seed=3, clip=False)
    ref = edm_algorithm_2(toy_net, (2, 1, 6, 6), steps=steps, seed=3)
    # float32 against the reference's float64: equal to 2e-5 of the images' scale (sigma_max = 80 at the start)
    assert (ours.double() - ref).abs().max() <= 2e-5 * ref.abs().max(), (ours.double() - ref).abs().max()


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_euler_is_diffusers_flow_match_euler(shift):
    diffusers = pytest.importorskip("diffusers", reason="diffusers is a test extra: pip install -e '.[test]'")
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(10)
    x = ImageNoise("cpu", 5, 0, 2).randn((2, 1, 6, 6))  # t = 1: pure noise, sigma 1; fastddpm's noise for seed 5
    for t in sched.timesteps:
        v = toy_net(x, torch.full((2,), float(t)))
        x = sched.step(v, t, x).prev_sample
    ours = sample(toy_net, Flow(shift=shift), (2, 1, 6, 6), sampler="euler", steps=10, seed=5, clip=False)
    assert torch.allclose(ours, x, atol=1e-5), (ours - x).abs().max()


@pytest.mark.parametrize("sampler, scheduler", [("euler", "EDMEulerScheduler"),
                                                ("dpmpp-2m", "EDMDPMSolverMultistepScheduler")])
@pytest.mark.parametrize("steps", [4, 12])
def test_edm_samplers_are_diffusers_edm_schedulers(sampler, scheduler, steps):
    """diffusers' EDM schedulers (Karras levels, Table 1's preconditioning, c_noise = ln(sigma) / 4 as their
    timesteps) driven by the same network from the same sigma_max * noise."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers is a test extra: pip install -e '.[test]'")
    sched = getattr(diffusers, scheduler)()
    sched.set_timesteps(steps)
    x = ImageNoise("cpu", 7, 0, 2).randn((2, 1, 6, 6)) * 80.0  # fastddpm's noise for seed 7
    for t in sched.timesteps:
        x_in = sched.scale_model_input(x, t)
        out = toy_net(x_in, torch.full((2,), float(t) * NOISE_INPUT_SCALE))
        x = sched.step(out, t, x).prev_sample
    ours = sample(toy_net, EDM(), (2, 1, 6, 6), sampler=sampler, steps=steps, seed=7, clip=False)
    assert (ours - x).abs().max() <= 2e-5 * x.abs().max(), (ours - x).abs().max()


def test_every_continuous_sampler_lands_on_the_data_of_a_perfect_denoiser():
    """Data that is one fixed image: the exact denoiser returns it at every level, and every sampler must end on
    it (each solver's last step lands on x0_hat) for both objectives, guidance included through the model."""
    target = torch.linspace(-0.8, 0.8, 36).reshape(1, 1, 6, 6)
    for process in (EDM(), Flow()):
        def perfect(x_in, c_noise_B, process=process):
            level = (c_noise_B / (NOISE_INPUT_SCALE / 4)).exp() if process.name == "edm" else c_noise_B / 1000
            # invert the preconditioning: the network output whose x0_hat is the target
            lvl = level[:, None, None, None]
            if process.name == "edm":
                x = x_in * (lvl ** 2 + 0.25).sqrt()
                c_skip, c_out = 0.25 / (lvl ** 2 + 0.25), lvl * 0.5 / (lvl ** 2 + 0.25).sqrt()
                return (target - c_skip * x) / c_out
            return (x_in - target) / lvl

        for sampler in ("euler", "ddim", "dpmpp-2m", "dpmpp-2m-sde", "unipc", "heun"):
            out = sample(perfect, process, (2, 1, 6, 6), sampler=sampler, steps=6, seed=0, clip=False)
            assert torch.allclose(out, target.expand(2, -1, -1, -1), atol=1e-4), (process.name, sampler)


@pytest.mark.parametrize("guidance", [0.0, 1.0, 2.0])
def test_guidance_extrapolates_the_denoised_image_on_both_objectives(guidance):
    """A conditional network whose x0_hat is the class's image, and the null class's is 0: the output is affine in
    x0_hat at a fixed x (EDM's F and flow's v both), so guided sampling must land on W times the class's image."""
    images = torch.stack([torch.full((1, 4, 4), 0.2), torch.linspace(-0.4, 0.4, 16).reshape(1, 4, 4)])
    labels = torch.tensor([0, 1, 1])
    for process in (EDM(), Flow()):
        def net(x_in, c_noise_B, y_B, process=process):
            lvl = ((c_noise_B / (NOISE_INPUT_SCALE / 4)).exp() if process.name == "edm"
                   else c_noise_B / NOISE_INPUT_SCALE)[:, None, None, None]
            target = torch.where((y_B < 2)[:, None, None, None], images[y_B.clamp(max=1)], torch.zeros(1))
            if process.name == "edm":
                x = x_in * (lvl ** 2 + 0.25).sqrt()
                return (target - 0.25 / (lvl ** 2 + 0.25) * x) / (lvl * 0.5 / (lvl ** 2 + 0.25).sqrt())
            return (x_in - target) / lvl

        for sampler in ("euler", "dpmpp-2m-sde", "heun"):
            out = sample(net, process, (3, 1, 4, 4), sampler=sampler, steps=5, seed=0, clip=False, labels=labels,
                         guidance=guidance, num_classes=2)
            assert torch.allclose(out, guidance * images[labels], atol=1e-4), (process.name, sampler)


def test_the_sampling_levels_are_pinned():
    """EDM's eq. 5 at 3 levels is sigma_max, the rho-th power of the mean of the ends' rho-th roots, sigma_min;
    flow's evenly spaced t between 1 and the shifted 1/1000, shifted (diffusers' FlowMatchEulerDiscreteScheduler)."""
    mid = ((80 ** (1 / 7) + 0.002 ** (1 / 7)) / 2) ** 7
    assert EDM().sampling_levels(3, "karras", finite_lambda=True) == pytest.approx([80.0, mid, 0.002])
    assert mid == pytest.approx(2.5152, abs=1e-4)
    assert EDM().sampling_levels(3, "logsnr", finite_lambda=True) == pytest.approx([80.0, 0.4, 0.002])
    shift3 = lambda t: 3 * t / (1 + 2 * t)  # noqa: E731
    lo = shift3(0.001)
    assert Flow(shift=3).sampling_levels(3, "trailing", finite_lambda=False) == pytest.approx(
        [1.0, shift3((1 + lo) / 2), shift3(lo)])
    assert Flow().sampling_levels(2, "trailing", finite_lambda=False) == pytest.approx([1.0, 0.001])
    # the lambda-based solvers start where log(alpha / sigma) = -5.1: t = 1 / (1 + e^-5.1) = 0.99394
    assert Flow().sampling_levels(2, "trailing", finite_lambda=True)[0] == pytest.approx(0.993940, abs=1e-6)
    for shift in (0.5, 3.0):  # and so does a shifted flow's first level, in every spacing
        for spacing in ("trailing", "karras", "logsnr"):
            t0 = Flow(shift=shift).sampling_levels(4, spacing, finite_lambda=True)[0]
            assert math.log((1 - t0) / t0) == pytest.approx(-5.1, abs=1e-9)
    for process, spacing in ((Flow(), "trailing"), (Flow(), "karras"), (EDM(), "karras"), (EDM(), "trailing")):
        with pytest.raises(ValueError, match="steps=0 must be >= 1"):
            process.sampling_levels(0, spacing, finite_lambda=False)


@pytest.mark.parametrize("sampler", ["euler", "dpmpp-2m", "unipc", "heun"])
def test_each_objectives_default_spacing_is_the_one_sample_uses_and_records(sampler):
    """The spacing an evaluation records and a file name leaves out is the one sample() walks: EDM's noise levels
    for every sampler of an EDM model, trailing for flow's (Heun: karras on both)."""
    assert default_spacing(sampler, "edm") == "karras"
    assert default_spacing(sampler, "flow") == ("karras" if sampler == "heun" else "trailing")
    for process in (EDM(), Flow()):
        own = default_spacing(sampler, process.name)
        other = "trailing" if own == "karras" else "karras"
        runs = {s: sample(toy_net, process, (2, 1, 4, 4), sampler=sampler, steps=4, seed=1, spacing=s)
                for s in (None, own, other)}
        assert torch.equal(runs[None], runs[own])
        assert not torch.allclose(runs[None], runs[other])


def test_ddpm_sampler_is_refused_on_continuous_objectives_by_name():
    with pytest.raises(ValueError, match="samples with euler, ddim, dpmpp-2m, dpmpp-2m-sde, unipc, heun"):
        sample(toy_net, Flow(), (1, 1, 4, 4), sampler="ddpm")


def test_bad_combinations_are_refused_with_the_fix():
    base = get_preset("tiny")
    with pytest.raises(ConfigError, match="prediction=v is DDPM's choice"):
        apply_overrides(base, {"diffusion.objective": "flow", "diffusion.prediction": "v"})
    with pytest.raises(ConfigError, match="min_snr_gamma is a DDPM loss weighting"):
        apply_overrides(base, {"diffusion.objective": "edm", "train.min_snr_gamma": 5.0})
    with pytest.raises(ConfigError, match="train.sampler=ddpm walks DDPM's discrete timesteps"):
        apply_overrides(base, {"diffusion.objective": "edm", "train.sampler": "ddpm"})


def _cfg(src, objective, **train):
    """The tiny preset without attention (at 28x28, over 784 positions, most of a CPU step's and a sampler step's
    time): what the tests below follow is the objective through training, sampling and export, not the model."""
    over = {"data.source": str(src), "train.progress": False, "diffusion.objective": objective,
            "train.checkpoint_every": None, "model.attention": False}
    over.update({f"train.{k}": v for k, v in train.items()})
    return apply_overrides(get_preset("tiny"), over)


def _weights(run):
    from fastddpm.rundir.files import load_safetensors

    return load_safetensors(run / "ema.safetensors")[0]


@pytest.mark.parametrize("objective", ["edm", "flow"])
def test_objective_trains_resumes_exactly_samples_and_exports(tmp_path, fmnist_npz, objective):
    quiet = lambda *a, **k: None  # noqa: E731
    straight, split = tmp_path / "straight", tmp_path / "split"
    # grids of 4 images (the preset's: 16) in the preset's 10 steps, which run.json's grid_sampling is checked for
    few = dict(log_every=1, num_sample_images=4)
    train(_cfg(fmnist_npz, objective, max_steps=4, **few), out_dir=straight, log=quiet)
    train(_cfg(fmnist_npz, objective, max_steps=2, checkpoint_every=2, **few), out_dir=split, log=quiet)
    train(_cfg(fmnist_npz, objective, max_steps=4, **few), out_dir=split, resume="latest", log=quiet)
    a, b = _weights(straight), _weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [json.loads(line)["loss"] for line in (straight / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 4 and all(np.isfinite(losses))

    import fastddpm

    model = fastddpm.load(straight)
    for sampler in ("euler", "dpmpp-2m-sde", "heun"):
        images = model.sample(3, sampler=sampler, steps=4, seed=1)
        assert images.shape == (3, 1, 28, 28) and images.dtype == np.uint8
    grids = json.loads((straight / "run.json").read_text())["grid_sampling"]  # tiny's grids take 10 steps
    assert grids == (["heun", 10] if objective == "flow" else ["dpmpp-2m-sde", 10])
    # the default, auto: the objective's own sampler (flow: Heun 10 steps; EDM: SDE-DPM-Solver++ 20 steps)
    own, other = (("heun", 10), ("dpmpp-2m-sde", 20)) if objective == "flow" else (("dpmpp-2m-sde", 20), ("heun", 10))
    auto = model.sample(2, seed=1)
    assert np.array_equal(auto, model.sample(2, sampler=own[0], steps=own[1], seed=1))
    assert not np.array_equal(auto, model.sample(2, sampler=other[0], steps=other[1], seed=1))
    with pytest.raises(Exception, match="samples with euler"):
        model.sample(2, sampler="ddpm")
    # a file's name tags a spacing other than the sampler's own on this objective (EDM's own: karras)
    assert main(["sample", "--checkpoint", str(straight), "--sampler", "euler", "--steps", "2", "--num-images", "2",
                 "--spacing", "trailing", "--no-progress"]) == 0
    tag = "-trailing" if objective == "edm" else ""
    assert np.load(straight / "samples" / f"euler2{tag}_n2_seed0_step4.npz")["images"].shape == (2, 1, 28, 28)

    from fastddpm.export import export

    result = export(straight, "safetensors", tmp_path / "export", log=quiet)
    schedule = json.loads((tmp_path / "export" / "schedule.json").read_text())
    assert schedule["objective"] == objective and result["files"][0] == "model.safetensors"


def test_the_command_line_samples_evaluates_benches_and_exports_a_flow_model(tmp_path, fmnist_splits, capsys):
    """fastddpm sample / eval / bench samplers / export on a flow-matching run: the samplers that apply run, DDPM's
    is refused by name with the ones that work, and the ONNX model takes a float noise level."""
    run = tmp_path / "run"
    train(_cfg(fmnist_splits, "flow", max_steps=4, num_sample_images=2, sample_steps=2, sampler="euler",
               eval_every_images=64, eval_samples=16, eval_steps=3),
          out_dir=run, log=lambda *a, **k: None)
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and all(e["fid"] > 0 for e in evals)  # --eval-every: auto = Heun on the flow model, recorded so
    assert all((e["eval_sampler"], e["eval_steps"]) == ("heun", 3) for e in evals)
    assert main(["sample", "--checkpoint", str(run), "--sampler", "euler", "--steps", "3", "--num-images", "4",
                 "--no-progress"]) == 0
    assert np.load(run / "samples" / "euler3_n4_seed0_step4.npz")["images"].shape == (4, 1, 28, 28)
    capsys.readouterr()
    for steps in ([], ["--steps", "3"]):  # with --steps too: not "drop --steps", after which this would follow
        assert main(["sample", "--checkpoint", str(run), "--sampler", "ddpm", "--num-images", "2", *steps]) == 2
        assert "this flow model samples with euler, ddim, dpmpp-2m" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--sampler", "heun", "--steps", "3", "--num-samples", "20",
                 "--no-progress"]) == 0
    s = json.loads((run / "eval" / "eval_heun3_n20_seed0_step4.json").read_text())["sampling"]
    assert s["nfe"] == 5 and s["sampler"] == "heun"
    # no --sampler, no --steps: auto, a flow model's Heun with 10 steps (19 network calls)
    assert main(["sample", "--checkpoint", str(run), "--num-images", "2", "--no-progress"]) == 0
    assert np.load(run / "samples" / "heun10_n2_seed0_step4.npz")["images"].shape == (2, 1, 28, 28)
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "20", "--no-progress"]) == 0
    s = json.loads((run / "eval" / "eval_heun10_n20_seed0_step4.json").read_text())["sampling"]
    assert s["nfe"] == 19 and (s["sampler"], s["steps"]) == ("heun", 10)
    out = tmp_path / "bench"
    assert main(["bench", "samplers", str(run), "--quick", "--samplers", "euler,unipc", "--spread-points", "none",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "samplers.json").read_text())["rows"]
    assert [(r["sampler"], r["steps"]) for r in rows] == [("euler", 2), ("euler", 4), ("unipc", 2), ("unipc", 4)]
    assert all(r["status"] == "ok" and r["fid"] > 0 for r in rows)  # and no DDPM point: flow has no timesteps
    capsys.readouterr()
    assert main(["bench", "samplers", str(run), "--quick", "--samplers", "ddpm,euler", "--out", str(out)]) == 2
    assert "ddpm cannot sample this flow model" in capsys.readouterr().err
    pytest.importorskip("onnxruntime", reason="onnxruntime is a test extra: pip install -e '.[test]'")
    assert main(["export", str(run), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    schedule = json.loads((tmp_path / "onnx" / "schedule.json").read_text())
    assert schedule["objective"] == "flow" and schedule["network_input"] == "v(x_t, 1000 t)"
    # the folder's sampler samples it with numpy alone, at the levels fastddpm's Euler uses
    import subprocess
    import sys

    from fastddpm import sample_onnx as mod

    example = tmp_path / "onnx" / "sample_onnx.py"
    assert mod.continuous_levels(schedule, 5) == pytest.approx(Flow().sampling_levels(5, "trailing",
                                                                                       finite_lambda=False))
    edm_schedule = {"objective": "edm", "sigma_min": 0.002, "sigma_max": 80.0, "rho": 7.0}
    assert mod.continuous_levels(edm_schedule, 5) == pytest.approx(EDM().sampling_levels(5, "karras",
                                                                                         finite_lambda=False))
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, str(example), str(tmp_path / "onnx"), "--num", "4", "--steps",
                        "3", "--out", str(tmp_path / "grid.png")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "EULER 3 steps" in r.stdout, r.stderr
