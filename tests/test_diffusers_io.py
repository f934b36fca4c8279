"""`fastddpm export --format diffusers`: the ddpm family's U-Net as diffusers' UNet2DModel computes the same function,
DDPMPipeline loads the folder and samples, and what diffusers cannot express is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TINY_DDPM, flags
from fastddpm.cli import main
from fastddpm.config import ConfigError, DiffusionConfig, ModelConfig, RunConfig
from fastddpm.diffusers_io import check_exportable, from_diffusers_state_dict, to_diffusers_state_dict, write_folder
from fastddpm.models import build_unet

diffusers = pytest.importorskip("diffusers")


def _run_config(**model) -> RunConfig:
    over = {k.split(".", 1)[1]: v for k, v in TINY_DDPM.items()}
    over.update(image_channels=3, image_size=32)
    over.update(model)
    return RunConfig(model=ModelConfig(**over), diffusion=DiffusionConfig())


def _randomised(cfg: RunConfig, seed: int = 0):
    """A DDPMUNet with every weight random: the zero-initialised output layers would hide a wrong mapping."""
    torch.manual_seed(seed)
    model = build_unet(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _compare(model, cfg, folder) -> float:
    unet = diffusers.UNet2DModel.from_pretrained(str(folder / "unet")).eval()
    g = torch.Generator().manual_seed(1)
    m = cfg.model
    x = torch.randn(3, m.image_channels, m.image_size, m.image_size, generator=g)
    t = torch.tensor([0, 517, cfg.diffusion.num_timesteps - 1])
    y = torch.tensor([0, m.num_classes - 1, m.num_classes]) if m.conditional else None
    with torch.no_grad():
        want = model(x, t, y) if m.conditional else model(x, t)
        got = unet(x, t, class_labels=y).sample
    assert want.abs().max() > 0.1  # the comparison is not between two zeros
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("model_over", [
    {},  # TINY_DDPM: scale_shift_norm, two heads, attention at 16x16 and in the middle
    {"scale_shift_norm": False, "num_heads": 1, "attention_resolutions": (32, 16), "channel_mult": (1, 2, 2)},
    {"conditional": True, "num_classes": 3, "class_names": ("a", "b", "c")},
], ids=["scale-shift-2-heads", "default-1-head-3-levels", "conditional"])
def test_a_random_ddpm_unet_and_its_diffusers_export_compute_the_same_function(tmp_path, model_over):
    cfg = _run_config(**model_over)
    model = _randomised(cfg)
    write_folder(model, cfg, tmp_path)
    assert _compare(model, cfg, tmp_path) < 1e-5
    config = json.loads((tmp_path / "unet" / "config.json").read_text())
    if cfg.model.conditional:  # fastddpm's null class for guidance is the last id
        assert config["num_class_embeds"] == cfg.model.num_classes + 1
    else:
        assert config["num_class_embeds"] is None


def test_the_diffusers_names_map_back_to_the_same_fastddpm_weights():
    cfg = _run_config(conditional=True, num_classes=2, class_names=("a", "b"))
    model = _randomised(cfg)
    back = from_diffusers_state_dict(build_unet(cfg.model), to_diffusers_state_dict(model))
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    wider = build_unet(_run_config(base_channels=32, conditional=True, num_classes=2, class_names=("a", "b")).model)
    with pytest.raises(ConfigError, match=r"time_embedding.linear_1.weight has shape \(64, 16\)"):
        from_diffusers_state_dict(wider, to_diffusers_state_dict(model))
    with pytest.raises(ConfigError, match="class_embedding.weight has no place"):
        from_diffusers_state_dict(build_unet(_run_config().model), to_diffusers_state_dict(model))


@pytest.fixture(scope="module")
def rgb_npz(tmp_path_factory):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (16, 3, 32, 32), dtype=np.uint8)
    path = tmp_path_factory.mktemp("rgb") / "rgb32.npz"
    np.savez(path, images=images, labels=rng.integers(0, 2, 16))
    return path


def _train(run, npz, *extra) -> None:
    assert main(["train", "--data", str(npz), "--out", str(run), "--preset", "tiny", *flags(TINY_DDPM), *extra,
                 "--max-steps", "2", "--no-progress"]) == 0


def _fastddpm_model(run):
    from fastddpm.sampling import load_for_sampling
    return load_for_sampling(run, device="cpu")


def test_export_diffusers_from_the_cli_loads_in_ddpm_pipeline_and_samples(tmp_path, rgb_npz):
    run, out = tmp_path / "run", tmp_path / "diffusers"
    _train(run, rgb_npz, "--prediction", "v", "--schedule", "cosine")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    assert json.loads((out / "export.json").read_text())["max_abs_diff"] <= 1e-4
    model, cfg = _fastddpm_model(run)
    unet = diffusers.UNet2DModel.from_pretrained(str(out / "unet")).eval()
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([3, 999])
    with torch.no_grad():
        assert torch.allclose(unet(x, t).sample, model(x, t), atol=1e-5)
    sched = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == "v_prediction" and sched["beta_schedule"] == "squaredcos_cap_v2"
    pipe = diffusers.DDPMPipeline.from_pretrained(str(out))
    s = pipe.scheduler
    assert torch.allclose(s.betas.double(), cfg_betas(cfg), atol=1e-6)
    images = pipe(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert images.shape == (2, 32, 32, 3) and np.isfinite(images).all()
    card = (out / "README.md").read_text()
    assert "DDPMPipeline.from_pretrained" in card


def cfg_betas(cfg):
    from fastddpm.diffusion import schedule_from_config
    return schedule_from_config(cfg.diffusion).betas.double()


def test_a_conditional_export_keeps_its_classes_and_says_the_pipeline_does_no_guidance(tmp_path, rgb_npz):
    run, out = tmp_path / "run", tmp_path / "diffusers"
    _train(run, rgb_npz, "--conditional")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    model, cfg = _fastddpm_model(run)
    unet = diffusers.UNet2DModel.from_pretrained(str(out / "unet")).eval()
    assert unet.config.num_class_embeds == cfg.model.num_classes + 1 == 3
    x, t, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 10, 999]), torch.tensor([0, 1, 2])
    with torch.no_grad():
        assert torch.allclose(unet(x, t, class_labels=y).sample, model(x, t, y), atol=1e-5)
    card = (out / "README.md").read_text()
    assert "no guidance" in card and "null class" in card
    pipe = diffusers.DDPMPipeline.from_pretrained(str(out))  # the card's loop, 3 steps
    pipe.scheduler.set_timesteps(3)
    x = torch.randn(2, 3, 32, 32)
    for step in pipe.scheduler.timesteps:
        with torch.no_grad():
            x = pipe.scheduler.step(pipe.unet(x, step, class_labels=torch.tensor([0, 1])).sample, step, x).prev_sample
    assert x.shape == (2, 3, 32, 32) and torch.isfinite(x).all()


def test_what_diffusers_cannot_express_is_refused_by_name(tmp_path, rgb_npz, capsys):
    run = tmp_path / "seed"
    assert main(["train", "--data", str(rgb_npz), "--out", str(run), "--preset", "tiny", "--max-steps", "1",
                 "--no-progress"]) == 0
    assert main(["export", str(run), "--format", "diffusers", "--out", str(tmp_path / "x")]) == 2
    assert "model.family=seed" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    for over, name in (({"resblock_updown": True}, "model.resblock_updown"),
                       ({"attention_resolutions": (32, 16)}, "model.num_heads=2")):
        with pytest.raises(ConfigError, match=name):
            check_exportable(_run_config(**over))
    for objective in ("edm", "flow"):
        cfg = RunConfig(model=_run_config().model, diffusion=DiffusionConfig(objective=objective))
        with pytest.raises(ConfigError, match=f"diffusion.objective={objective}.*DDPMPipeline / DDPMScheduler"):
            check_exportable(cfg)


def test_init_from_a_diffusers_folder_starts_a_run_from_its_weights(tmp_path, rgb_npz, capsys):
    """A UNet2DModel saved by diffusers itself (from an export, with its weights changed in diffusers) starts a new
    fastddpm run: the run's step-0 weights are diffusers' weights; a model of another width is refused by naming
    the config switch that differs."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers is a test extra: pip install -e '.[test]'")
    run, out = tmp_path / "run", tmp_path / "export"
    _train(run, rgb_npz)
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    unet = diffusers.UNet2DModel.from_pretrained(str(out / "unet"))
    with torch.no_grad():
        for p in unet.parameters():  # other weights than the run's, written by diffusers
            p.add_(0.01 * torch.randn_like(p))
    unet.save_pretrained(str(tmp_path / "theirs"))
    new = tmp_path / "new"
    _train(new, rgb_npz, "--init-from", str(tmp_path / "theirs"), "--lr", "1e-12")
    assert "init: weights of the diffusers UNet2DModel" in capsys.readouterr().out
    from fastddpm.diffusers_io import to_diffusers_state_dict

    started = to_diffusers_state_dict(_fastddpm_model(new)[0])  # the EMA weights: warm-up makes them the model
    theirs = unet.state_dict()
    assert started.keys() == theirs.keys()
    assert all(torch.allclose(started[k], theirs[k], atol=1e-6) for k in theirs)  # two steps at lr 1e-12
    capsys.readouterr()
    assert main(["train", "--data", str(rgb_npz), "--out", str(tmp_path / "wide"), "--preset", "tiny",
                 *flags({**TINY_DDPM, "model.base_channels": 32}), "--max-steps", "1", "--no-progress",
                 "--init-from", str(tmp_path / "theirs")]) == 2
    assert "block_out_channels is [16, 32] there and [32, 64] in this run's model" in capsys.readouterr().err
