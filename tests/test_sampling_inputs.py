"""What the samplers are given and what they report: the linear schedule at any T, eta, guidance and class labels
refused by name when out of range, a conditional grid's size, network calls counted on the real grid, and pixels
rounded the same from any float type."""

import math

import pytest
import torch

import fastddpm.sampling as sampling
from fastddpm.config import ConfigError, DiffusionConfig, ModelConfig, RunConfig, TrainConfig
from fastddpm.device import resolve_precision
from fastddpm.diffusion import (SAMPLERS, ddim_sample, linear_betas, make_schedule, network_calls, sample,
                                schedule_from_config, to_uint8)
from fastddpm.diffusion.continuous import EDM, Flow
from fastddpm.rng import ImageNoise
from fastddpm.sampling import check_sampler_args

SHAPE = (2, 1, 4, 4)


def smooth_model(x, t):
    c = (t.to(x.dtype) / 1000.0).reshape(-1, 1, 1, 1)
    return torch.tanh(0.7 * x + c) * (0.5 + c)


# ------------------------------------------------------------------------------------------- linear betas at any T
def test_linear_betas_scale_by_1000_over_t_and_are_unchanged_at_1000():
    """Nichol & Dhariwal 2021: beta_start and beta_end scale by 1000 / T, so every T ends near pure noise."""
    assert torch.equal(make_schedule("linear", 1000).float64("betas"), linear_betas(1000))
    assert torch.equal(linear_betas(1000), torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64))
    ab_1000 = float(make_schedule("linear", 1000).float64("alpha_bar")[-1])
    for T in (100, 250, 50):
        betas = make_schedule("linear", T).float64("betas")
        assert betas[0].item() == pytest.approx(1e-4 * 1000 / T) and betas[-1].item() == pytest.approx(0.02 * 1000 / T)
        ab_T = float(make_schedule("linear", T).float64("alpha_bar")[-1])
        assert ab_T <= 1.01 * ab_1000  # unscaled, T = 100 ended at alpha_bar 0.36
    with pytest.raises(ValueError, match=r"at num_timesteps=20 they are 0.005 and 1 .*use num_timesteps > 20"):
        make_schedule("linear", 20)
    with pytest.raises(ConfigError, match=r"at num_timesteps=16 they are .*use num_timesteps > 20"):
        DiffusionConfig(num_timesteps=16)
    assert DiffusionConfig(num_timesteps=16, schedule="cosine").num_timesteps == 16  # cosine reads no betas
    with pytest.raises(ConfigError, match=r"they are 0.015 and 0.01 \(a beta left unset .*give both --beta-start"):
        DiffusionConfig(num_timesteps=2000, beta_start=0.015)


def test_betas_given_are_used_as_written_so_runs_saved_before_the_scaling_keep_their_schedule():
    """A run's saved config holds its betas (1e-4 and 0.02 before unset meant scaled): at T = 100 they stay
    unscaled, the schedule that run trained; a new run's config leaves them unset."""
    from fastddpm.config import from_dict

    assert RunConfig().to_dict()["diffusion"]["beta_start"] is None
    old = RunConfig().to_dict()
    old["diffusion"].update(num_timesteps=100, beta_start=1e-4, beta_end=0.02)
    betas = schedule_from_config(from_dict(old).diffusion).float64("betas")
    assert torch.equal(betas, linear_betas(100, 1e-4, 0.02))
    assert torch.equal(make_schedule("linear", 100, 1e-4, 0.02).float64("betas"), betas)
    # resuming it: at T = 1000 written-out and unset are one schedule; at T = 100 the flags that keep it are named
    from pathlib import Path

    from fastddpm.config import check_same_architecture

    legacy_1000 = RunConfig(diffusion=DiffusionConfig(beta_start=1e-4, beta_end=0.02))
    check_same_architecture(legacy_1000, RunConfig(), Path("ckpt.pt"))
    with pytest.raises(ConfigError, match=r"ckpt.pt: its linear betas run from 0.0001 to 0.02 and this run's from "
                                          r"0.001 to 0.2 .*--beta-start 0.0001 --beta-end 0.02"):
        check_same_architecture(from_dict(old), RunConfig(diffusion=DiffusionConfig(num_timesteps=100)),
                                Path("ckpt.pt"))


def test_the_diffusers_scheduler_config_holds_the_betas_the_run_trained():
    diffusers = pytest.importorskip("diffusers")
    from fastddpm.diffusers_io import scheduler_config

    for T in (1000, 100):
        cfg = RunConfig(diffusion=DiffusionConfig(num_timesteps=T))
        theirs = diffusers.DDPMScheduler.from_config(scheduler_config(cfg)).betas.double()
        torch.testing.assert_close(theirs, schedule_from_config(cfg.diffusion).float64("betas"), rtol=1e-6, atol=0)
    assert scheduler_config(RunConfig(diffusion=DiffusionConfig()))["beta_end"] == 0.02


# ----------------------------------------------------------------------------------------------- eta and guidance
@pytest.mark.parametrize("eta", [-0.5, 1.5, math.nan, math.inf])
def test_eta_outside_0_1_is_refused_by_the_flags_and_every_sampler(eta):
    with pytest.raises(ConfigError, match=rf"--eta {eta} must be a number in \[0, 1\]"):
        check_sampler_args("ddim", 10, eta, 1000)
    schedule = make_schedule("linear", 100)
    with pytest.raises(ValueError, match=rf"eta={eta} must be a number in \[0, 1\]"):
        sample(smooth_model, schedule, SHAPE, sampler="ddim", steps=5, eta=eta)
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\]"):
        ddim_sample(smooth_model, schedule, SHAPE, steps=5, eta=eta, noise=ImageNoise("cpu", 0, 0, SHAPE[0]),
                    device="cpu")
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\]"):
        sample(lambda x, c: torch.zeros_like(x), EDM(), SHAPE, sampler="ddim", steps=5, eta=eta)


@pytest.mark.parametrize("guidance", [-1.0, math.nan, math.inf])
def test_guidance_must_be_finite_and_non_negative(guidance):
    with pytest.raises(ConfigError, match=rf"--guidance {guidance} must be a finite number >= 0"):
        check_sampler_args("ddim", 10, 0.0, 1000, guidance=guidance)
    with pytest.raises(ValueError, match=rf"guidance={guidance} must be a finite number >= 0"):
        sample(lambda x, t, y: x, make_schedule("linear", 100), SHAPE, sampler="ddim", steps=3,
               labels=torch.tensor([0, 1]), guidance=guidance, num_classes=2)


def test_eta_and_guidance_in_range_are_accepted():
    for eta in (0.0, 0.3, 1.0):
        check_sampler_args("ddim", 10, eta, 1000, guidance=0.0)
        x = sample(smooth_model, make_schedule("linear", 100), SHAPE, sampler="ddim", steps=3, eta=eta)
        assert x.isfinite().all()


# --------------------------------------------------------------------------------------------------- class labels
def embedding_model(num_classes: int):
    """A conditional stand-in that indexes a class embedding (num_classes + 1 rows, the last the null class), as the
    U-Net does: an id past the table is an IndexError."""
    table = torch.linspace(-0.5, 0.5, num_classes + 1)
    return lambda x, t, y: smooth_model(x, t) + table[y].reshape(-1, 1, 1, 1)


@pytest.mark.parametrize("guidance", [0.0, 1.0, 2.0])
def test_labels_out_of_range_or_of_the_wrong_shape_are_refused_at_every_scale(guidance):
    model, schedule = embedding_model(3), make_schedule("linear", 100)
    kw = dict(sampler="ddim", steps=3, guidance=guidance, num_classes=3)
    for bad, what in [(torch.full((2,), 4), "label 4 is out of range: this model has classes 0-2 and 3 for its null"),
                      (torch.tensor([0, -1]), "label -1 is out of range"),
                      (torch.tensor([1]), r"labels of shape \(1,\) for a batch of 2: .* shape \(2,\)"),
                      (torch.tensor([[0, 1]]), r"labels of shape \(1, 2\)"),
                      (torch.tensor([0.0, 1.0]), "labels must be an integer tensor of class ids, got torch.float32"),
                      (torch.tensor([True, False]), "integer tensor")]:
        with pytest.raises(ValueError, match=what):
            sample(model, schedule, SHAPE, labels=bad, **kw)
    for good in (torch.tensor([0, 2]), torch.full((2,), 3), torch.tensor([2, 1], dtype=torch.int32)):  # 3: null
        assert sample(model, schedule, SHAPE, labels=good, **kw).shape == SHAPE


# ---------------------------------------------------------------------------------------- the training grid's size
@pytest.mark.parametrize("num_classes, want", [(1000, 64), (100, 64), (64, 64), (10, 60)])
def test_a_conditional_grid_draws_at_most_num_sample_images(monkeypatch, tmp_path, num_classes, want):
    seen = {}

    def fake_sample(model, schedule, shape, **kw):
        seen.update(shape=shape, labels=kw["labels"])
        return torch.zeros(shape)

    monkeypatch.setattr(sampling, "sample", fake_sample)
    cfg = RunConfig(model=ModelConfig(conditional=True, num_classes=num_classes, image_channels=1, image_size=8,
                                      class_names=tuple(map(str, range(num_classes)))),
                    train=TrainConfig(num_sample_images=64))
    path = sampling.write_grid(None, None, cfg, "cpu", resolve_precision("fp32", torch.device("cpu")),
                               tmp_path / "grid.png")
    labels = seen["labels"]
    assert seen["shape"][0] == len(labels) == want and path.is_file()
    assert labels.min() == 0 and labels.max() < num_classes
    if num_classes >= 64:  # one image each of 64 classes spread over all the ids, in order
        assert (labels.diff() > 0).all() and labels.max() >= num_classes - num_classes // 64 - 1
    else:  # one row per class
        assert torch.equal(labels, torch.arange(num_classes).repeat_interleave(want // num_classes))


# ------------------------------------------------------------------------------------------------- network calls
@pytest.mark.parametrize("sampler", [s for s in SAMPLERS if s != "ddpm"])
@pytest.mark.parametrize("spacing", ["karras", "logsnr", "trailing", None])
def test_network_calls_count_the_grid_sample_walks(sampler, spacing):
    """karras and logsnr round their levels to trained timesteps and keep each once: at 100 steps on the cosine
    schedule dpmpp-2m walks 88 timesteps, and the count recorded as nfe must say so."""
    schedule = make_schedule("cosine", 1000)
    calls = []
    counting = lambda x, t: calls.append(1) or smooth_model(x, t)  # noqa: E731
    sample(counting, schedule, (1, 1, 2, 2), sampler=sampler, steps=100, spacing=spacing, seed=0)
    assert network_calls(sampler, 100, 1000, schedule=schedule, spacing=spacing) == len(calls)
    if sampler == "dpmpp-2m" and spacing == "karras":
        assert len(calls) == 88
    assert network_calls(sampler, 100, 1000) == (199 if sampler == "heun" else 100)  # without a schedule: as before


def test_network_calls_on_a_continuous_process_and_for_ddpm():
    for process in (EDM(), Flow()):
        calls = []
        counting = lambda x, c: calls.append(1) or torch.zeros_like(x)  # noqa: E731
        sample(counting, process, (1, 1, 2, 2), sampler="heun", steps=10, seed=0)
        assert network_calls("heun", 10, 1000, schedule=process) == len(calls) == 19
    assert network_calls("ddpm", 5, 100, schedule=make_schedule("linear", 100), spacing="karras") == 100


# ------------------------------------------------------------------------------------------------------- pixels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_uint8_rounds_low_precision_input_as_float32(dtype):
    x = torch.linspace(-1, 1, 100_001).to(dtype)
    assert torch.equal(to_uint8(x), to_uint8(x.float()))
