"""`fastddpm export --format diffusers`: the ddpm family's U-Net as diffusers' UNet2DModel computes the same function,
DDPMPipeline loads the folder and samples, and what diffusers cannot express is refused by name."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_DDPM, flags
from fastddpm.cli import main
from fastddpm.config import ConfigError, DiffusionConfig, ModelConfig, RunConfig
from fastddpm.diffusers_io import (check_exportable, from_diffusers_state_dict, to_diffusers_state_dict, trailing_gaps,
                                   write_folder)
from fastddpm.diffusion import sample, sampler_timesteps, schedule_from_config
from fastddpm.diffusion.ode_solvers import first_timestep, trailing_timesteps
from fastddpm.rng import ImageNoise
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


@pytest.mark.parametrize("schedule,prediction,T", [("linear", "epsilon", 1000), ("cosine", "v", 1000),
                                                   ("linear", "epsilon", 100)])
def test_diffusers_schedulers_built_from_the_export_draw_fastddpms_few_step_images(tmp_path, schedule, prediction, T):
    """The export's scheduler config gives diffusers' DDIM, DPM-Solver++(2M) and UniPC fastddpm's timesteps and its
    clamped x0: from the same noise, the same uint8 images (a config with linspace spacing that clamped only
    DDIM's x0, without re-deriving its noise, drew images up to 204 levels apart at 20 DDIM steps)."""
    cfg = _run_config()
    cfg = dataclasses.replace(cfg, diffusion=dataclasses.replace(cfg.diffusion, schedule=schedule,
                                                                 prediction=prediction, num_timesteps=T))
    model = _randomised(cfg)
    write_folder(model, cfg, tmp_path)
    config = diffusers.DDPMPipeline.from_pretrained(str(tmp_path)).scheduler.config
    ours_schedule = schedule_from_config(cfg.diffusion)
    shape, seed = (2, 3, 32, 32), 3
    for name, cls, steps in (("ddim", diffusers.DDIMScheduler, 20), ("unipc", diffusers.UniPCMultistepScheduler, 10),
                             ("dpmpp-2m", diffusers.DPMSolverMultistepScheduler, 10)):
        theirs = cls.from_config(config)
        theirs.set_timesteps(steps)
        ours_ts = sampler_timesteps(ours_schedule, name, steps)
        if name != "ddim" and first_timestep(ours_schedule) != T - 1:  # the card's "near, not the same": fastddpm's
            # solvers start below the schedule's last timesteps and divide the rest evenly; DPM-Solver starts there
            # too (lambda_min_clipped) at diffusers' stride T / K, UniPC at T - 1
            assert theirs.timesteps[0] == (ours_ts[0] if name == "dpmpp-2m" else T - 1) and ours_ts[0] < T - 1
            continue
        assert theirs.timesteps.tolist() == ours_ts, name
        want = sample(model, ours_schedule, shape, sampler=name, steps=steps, prediction=prediction, seed=seed)
        x = ImageNoise("cpu", seed, 0, shape[0]).randn(shape)
        with torch.no_grad():
            for t in theirs.timesteps:
                out = model(x, t.expand(shape[0]))
                x = theirs.step(out, t, x, **({"use_clipped_model_output": True} if name == "ddim" else {})).prev_sample
        levels = ((want - x).abs().max() * 127.5).item()
        assert want.std() > 0.1 and levels < 1.0, (name, levels)


@pytest.mark.parametrize("schedule,T", [("linear", 1000), ("linear", 100)])
def test_the_cards_python_runs_as_written_and_says_which_schedulers_are_fastddpms(tmp_path, schedule, T):
    from fastddpm.diffusers_io import model_card

    cfg = _run_config()
    cfg = dataclasses.replace(cfg, diffusion=dataclasses.replace(cfg.diffusion, schedule=schedule, num_timesteps=T))
    write_folder(_randomised(cfg), cfg, tmp_path)
    card = model_card(cfg, {"step": 1, "images_seen": 8}, "cmd")
    assert f"for a K that divides {T} (its step reads the level at t - {T} // K)" in card
    assert "num_inference_steps=10" in model_card(dataclasses.replace(  # 20 does not divide 250: DDIM would differ
        cfg, diffusion=dataclasses.replace(cfg.diffusion, num_timesteps=250)), {"step": 1}, "cmd")
    if T == 1000:  # every timestep kept: all three, and the counts where diffusers' stride adds t = -1
        assert "as do `DPMSolverMultistepScheduler` (`dpmpp-2m`) and `UniPCMultistepScheduler`" in card
        assert "at 61, 103, 121, 122," in card
        return  # the code is T = 100's but for its step count (1000 DDPM steps: 15 s)
    # T = 100's scaled linear betas end below lambda = -5.1: the solvers start at 96
    assert "start at timestep 96" in card and "near fastddpm's `dpmpp-2m` and `unipc`, not the same" in card
    blocks = [b.split("\n", 1)[1] for b in card.split("```")[1::2]]
    assert len(blocks) == 2 and all(b.startswith("from diffusers import") for b in blocks)
    namespace: dict = {}
    with torch.no_grad():
        for code in blocks:
            exec(code.replace("path/to/this/folder", str(tmp_path)).replace("batch_size=4", "batch_size=1"), namespace)
    assert isinstance(namespace["pipe"].scheduler, diffusers.DPMSolverMultistepScheduler)
    assert namespace["pipe"].scheduler.timesteps[0] == first_timestep(schedule_from_config(cfg.diffusion))
    assert len(namespace["images"]) == 1 and namespace["images"][0].size == (32, 32)


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


SMALL_GRIDS = ("--num-sample-images", "4", "--sample-steps", "2")  # not the preset's 16 in 10: no grid is read


def _train(run, npz, *extra) -> None:
    assert main(["train", "--data", str(npz), "--out", str(run), "--preset", "tiny", *flags(TINY_DDPM), *extra,
                 *SMALL_GRIDS, "--max-steps", "2", "--no-progress"]) == 0


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
    T = cfg.diffusion.num_timesteps
    gaps = trailing_gaps(T)
    for steps in range(1, 130):  # fewer steps than trained: fastddpm's, from the noisiest step down
        s.set_timesteps(steps)
        got = s.timesteps.tolist()
        if steps in gaps:  # the counts the card names: diffusers' float stride adds t = -1
            assert got[:-1] == trailing_timesteps(T, steps) and got[-1] == -1
        else:
            assert got == trailing_timesteps(T, steps), steps
    assert gaps[:4] == [61, 103, 121, 122]
    images = pipe(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert images.shape == (2, 32, 32, 3) and np.isfinite(images).all()
    card = (out / "README.md").read_text()
    assert "DDPMPipeline.from_pretrained" in card


@pytest.mark.parametrize("conditional", [False, True])
def test_the_cards_sampling_code_walks_the_runs_own_number_of_steps(conditional):
    """DDPMPipeline refuses more inference steps than the scheduler's training steps: a card written for 1000
    failed on a 100-step run."""
    from fastddpm.diffusers_io import model_card

    from fastddpm.config import apply_overrides, get_preset

    cfg = apply_overrides(get_preset("tiny"), {**TINY_DDPM, "diffusion.num_timesteps": 100,
                                               "model.conditional": conditional, "model.image_size": 32,
                                               "model.image_channels": 3})
    if conditional:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=2, class_names=("a", "b")))
    card = model_card(cfg, {"step": 1, "images_seen": 8}, "cmd")
    assert ("scheduler.set_timesteps(100)" if conditional else "num_inference_steps=100") in card
    assert "1000" not in card


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
                 *SMALL_GRIDS, "--no-progress"]) == 0
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
        check_exportable(cfg, "--init-from x")  # a DDPM network's weights may start an EDM or flow run
    with pytest.raises(ConfigError, match=r"^--init-from x: model.family=seed: .*drop --family"):
        check_exportable(RunConfig(), "--init-from x")


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


def test_init_from_keeps_the_folders_dropout_says_another_task_and_is_not_used_on_resume(tmp_path, rgb_npz, capsys):
    """The folder's recorded dropout starts the run (it trained at 0.0 before, silently); weights that learned
    epsilon trained for v are said to be; on a resume --init-from is said to be unused and config.json keeps the
    folder the run began from (it held the new one); a missing path, a file and a refused model say so and leave
    no empty run folder."""
    run, out = tmp_path / "run", tmp_path / "export"
    _train(run, rgb_npz, "--dropout", "0.1")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    new = tmp_path / "new"
    capsys.readouterr()
    _train(new, rgb_npz, "--init-from", str(out), "--prediction", "v")
    said = capsys.readouterr().out
    assert "says these weights learned prediction 'epsilon'; this run trains them for 'v' (as given)" in said
    saved = json.loads((new / "config.json").read_text())
    assert saved["model"]["dropout"] == 0.1 and saved["train"]["init_from"] == str(out)
    from fastddpm.config import resolve_config  # a config dict's own dropout stays its own

    assert resolve_config({"preset": "tiny", "model": {"dropout": 0.3}, "train": {"init_from": str(out)}}
                          ).model.dropout == 0.3
    import shutil

    other = shutil.copytree(out, tmp_path / "other")
    assert main(["train", "--data", str(rgb_npz), "--out", str(new), "--resume", "latest", "--init-from",
                 str(other), "--max-steps", "3", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"--init-from {other} is not used when resuming: the run started from {out}" in said
    assert json.loads((new / "config.json").read_text())["train"]["init_from"] == str(out)
    for init, extra, error in ((tmp_path / "nothere", [], "no such folder"),
                               (out / "unet" / "config.json", [], f"a file, not a folder (.*give {out / 'unet'})"),
                               (out, ["--base-channels", "32"], "block_out_channels is")):
        assert main(["train", "--data", str(rgb_npz), "--out", str(tmp_path / "a" / "b"), "--preset", "tiny",
                     "--init-from", str(init), *extra, "--max-steps", "1", "--no-progress"]) == 2
        assert re.search(error, capsys.readouterr().err)
        assert not (tmp_path / "a").exists()


# google/ddpm-cifar10-32's unet/config.json as the Hub has it (written by diffusers 0.0.4: the keys it leaves out take
# UNet2DModel's defaults), with the channels cut from 128, 256, 256, 256 so that the test stays small
GOOGLE_DDPM_CIFAR10_32 = {
    "_class_name": "UNet2DModel", "_diffusers_version": "0.0.4", "act_fn": "silu", "attention_head_dim": None,
    "block_out_channels": [32, 64, 64, 64], "center_input_sample": False,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
    "downsample_padding": 0, "flip_sin_to_cos": False, "freq_shift": 1, "in_channels": 3, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-06, "norm_num_groups": 32, "out_channels": 3, "sample_size": 32,
    "time_embedding_type": "positional",
    "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
}


@pytest.fixture(scope="session")
def google_style_folder(tmp_path_factory):
    """A UNet2DModel in google/ddpm-cifar10-32's configuration, built and saved by diffusers with random weights
    (every one, so that a wrong mapping shows), its config.json then trimmed to the Hub's keys."""
    folder = tmp_path_factory.mktemp("google-style")
    torch.manual_seed(3)
    unet = diffusers.UNet2DModel(**{k: v for k, v in GOOGLE_DDPM_CIFAR10_32.items() if not k.startswith("_")})
    with torch.no_grad():
        for p in unet.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    unet.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(GOOGLE_DDPM_CIFAR10_32, indent=2))
    return folder, unet.eval()


def test_a_google_ddpm_unet_gives_its_architecture_and_weights_to_a_run(google_style_folder, rgb_npz):
    """Ho et al.'s TensorFlow details (freq_shift 1, GroupNorm eps 1e-6, SAME padding before the stride-2 conv) are
    read from the folder with the widths; the fastddpm model then computes diffusers' function. Without the three
    switches it would not: each is needed."""
    import dataclasses

    from fastddpm.config import resolve_config
    from fastddpm.diffusers_io import load_init

    folder, unet = google_style_folder
    cfg = resolve_config("tiny", layers=[("test", {"train.init_from": str(folder), "data.source": str(rgb_npz)})])
    m = cfg.model
    assert (m.family, m.base_channels, m.channel_mult, m.num_res_blocks, m.attention_resolutions, m.num_heads,
            m.norm_groups) == ("ddpm", 32, (1, 2, 2, 2), 2, (16,), 1, 32)
    assert (m.time_freq_shift, m.norm_eps, m.downsample_padding, m.scale_shift_norm) == (1, 1e-6, "tf-same", False)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, image_channels=3, image_size=32))
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 3, 32, 32, generator=g), torch.tensor([0, 517, 999])
    with torch.no_grad():
        want = unet(x, t).sample

    def max_relative_error(model_cfg) -> float:
        model = build_unet(model_cfg.model).eval()
        if model_cfg is cfg:
            load_init(model, model_cfg, folder)
        else:  # load_init would refuse the differing switch: the weights alone
            model.load_state_dict(from_diffusers_state_dict(model, diffusers_weights(folder)))
        with torch.no_grad():
            return float((model(x, t) - want).abs().max() / want.abs().max())

    assert want.abs().max() > 0.1
    assert max_relative_error(cfg) < 1e-5
    for switch in ({"time_freq_shift": 0}, {"norm_eps": 1e-5}, {"downsample_padding": "symmetric"}):
        other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **switch))
        assert max_relative_error(other) > 1e-4, switch


def test_pre_0_15_attention_names_load_as_diffusers_loads_them(google_style_folder, rgb_npz, tmp_path):
    """Early hub folders (google/ddpm-*) name attention weights query/key/value/proj_attn; diffusers renames them on
    load, and the fastddpm model built from such a folder computes the same function as from today's names."""
    import dataclasses
    import shutil

    from safetensors.torch import save_file

    from fastddpm.config import resolve_config
    from fastddpm.diffusers_io import load_init

    folder, unet = google_style_folder
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    renames = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    old_names = {}
    for key, value in diffusers_weights(folder).items():
        for new, old in renames.items():
            if ".attentions." in key:
                key = key.replace(new, old)
        old_names[key] = value
    assert sum(".query." in k for k in old_names) == 12  # 6 attention layers (2 down, 1 middle, 3 up) x weight, bias
    save_file(old_names, str(legacy / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    cfg = resolve_config("tiny", layers=[("test", {"train.init_from": str(legacy), "data.source": str(rgb_npz)})])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, image_channels=3, image_size=32))
    model = build_unet(cfg.model).eval()
    load_init(model, cfg, legacy)
    x, t = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([5, 900])
    with torch.no_grad():
        want = unet(x, t).sample
        assert float((model(x, t) - want).abs().max() / want.abs().max()) < 1e-5


def diffusers_weights(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def _pipeline_folder(unet_folder: Path, tmp_path: Path, scheduler: dict) -> Path:
    """A DDPMPipeline-style folder: `unet_folder`'s files under unet/, `scheduler` as scheduler/'s config."""
    pipeline = tmp_path / "pipeline"
    (pipeline / "unet").mkdir(parents=True)
    (pipeline / "scheduler").mkdir()
    for f in unet_folder.iterdir():
        (pipeline / "unet" / f.name).write_bytes(f.read_bytes())
    (pipeline / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    return pipeline


def test_init_from_a_google_ddpm_folder_trains_and_exports_back_to_the_same_switches(google_style_folder, rgb_npz,
                                                                                     tmp_path, capsys):
    """`fastddpm train --init-from DIR` with no model options on the command line: a DDPMPipeline folder (unet/ and
    scheduler/) fine-tunes a few steps, and exports back as a UNet2DModel with the folder's switches that computes
    fastddpm's function; an explicit option that contradicts the folder is refused by name."""
    folder, _ = google_style_folder
    # not the defaults (google's is linear epsilon), so that reading it shows
    pipeline = _pipeline_folder(folder, tmp_path, {
        "_class_name": "DDPMScheduler", "beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 1000,
        "prediction_type": "v_prediction", "clip_sample": True, "variance_type": "fixed_small"})
    run, out = tmp_path / "run", tmp_path / "export"
    assert main(["train", "--data", str(rgb_npz), "--out", str(run), "--preset", "tiny", "--init-from",
                 str(pipeline), "--max-steps", "2", "--batch-size", "4", *SMALL_GRIDS, "--no-progress"]) == 0
    assert "init: weights of the diffusers UNet2DModel" in capsys.readouterr().out
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    config = json.loads((out / "unet" / "config.json").read_text())
    assert {k: config[k] for k in ("freq_shift", "norm_eps", "downsample_padding", "block_out_channels")} == \
        {"freq_shift": 1, "norm_eps": 1e-6, "downsample_padding": 0, "block_out_channels": [32, 64, 64, 64]}
    sched = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert (sched["beta_schedule"], sched["prediction_type"]) == ("squaredcos_cap_v2", "v_prediction")
    assert json.loads((out / "export.json").read_text())["max_abs_diff"] <= 1e-4
    import shutil

    shutil.rmtree(pipeline / "unet")  # a resume reads the run's own config and weights, not the folder
    assert main(["train", "--data", str(rgb_npz), "--out", str(run), "--max-steps", "3", "--resume", "latest",
                 "--no-progress"]) == 0
    # the README's command again, with --resume: the same, though it names the preset and the folder
    assert main(["train", "--data", str(rgb_npz), "--out", str(run), "--preset", "tiny", "--init-from",
                 str(pipeline), "--max-steps", "4", "--batch-size", "4", *SMALL_GRIDS, "--resume", "latest",
                 "--no-progress"]) == 0
    (pipeline / "unet").mkdir()
    for f in folder.iterdir():
        (pipeline / "unet" / f.name).write_bytes(f.read_bytes())
    capsys.readouterr()
    assert main(["train", "--data", str(rgb_npz), "--out", str(tmp_path / "eps"), "--preset", "tiny",
                 "--init-from", str(pipeline), "--norm-eps", "1e-5", "--max-steps", "1", "--no-progress"]) == 2
    assert "norm_eps is 1e-06 there and 1e-05 in this run's model" in capsys.readouterr().err


def test_the_folder_is_a_layer_under_what_is_given_explicitly(google_style_folder, tmp_path):
    """The folder's architecture sits above the preset and below a config file and the flags: a RunConfig or a dict
    that carries init_from reads it too, restating the folder's own value is no conflict, and a file's explicit
    value wins (load_init then names the switch that differs)."""
    import yaml

    from fastddpm.config import RunConfig, TrainConfig, resolve_config

    folder, _ = google_style_folder
    given = resolve_config(RunConfig(train=TrainConfig(init_from=str(folder))))
    assert (given.model.family, given.model.norm_eps, given.model.base_channels) == ("ddpm", 1e-6, 32)
    restated = resolve_config("ddpm-cifar10", layers=[("command line", {"train.init_from": str(folder),
                                                                        "model.norm_groups": 32})])
    assert (restated.model.base_channels, restated.model.norm_groups) == (32, 32)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"norm_eps": 1e-5}, "train": {"init_from": str(folder)}}))
    filed = resolve_config("tiny", file=config)
    assert (filed.model.norm_eps, filed.model.time_freq_shift) == (1e-5, 1)
    # a family that cannot take the folder's weights is named as the problem, not a field it happens to break
    from fastddpm.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.family='seed' cannot take its weights: drop --family seed"):
        resolve_config("tiny", layers=[("command line", {"train.init_from": str(folder), "model.family": "seed"})])


def test_init_from_a_cosine_pipeline_holds_no_betas_and_an_old_run_that_holds_them_resumes(google_style_folder,
                                                                                          tmp_path):
    """diffusers writes beta_start and beta_end into a squaredcos_cap_v2 scheduler config too: --init-from copied
    them into the run's config.json, where the cosine schedule reads neither. Now the run holds none; a run saved
    with them still resolves and resumes (a beta is refused with the cosine schedule only when a user gives one)."""
    from fastddpm.config import from_dict, resolve_config

    folder, _ = google_style_folder
    pipeline = _pipeline_folder(folder, tmp_path, {
        "_class_name": "DDPMScheduler", "beta_schedule": "squaredcos_cap_v2", "beta_start": 0.0001,
        "beta_end": 0.02, "num_train_timesteps": 1000})
    given = [("command line", {"train.init_from": str(pipeline)})]
    cfg = resolve_config("tiny", layers=given)
    assert (cfg.diffusion.schedule, cfg.diffusion.beta_start, cfg.diffusion.beta_end) == ("cosine", None, None)
    old = dataclasses.replace(cfg, diffusion=dataclasses.replace(cfg.diffusion, beta_start=1e-4, beta_end=0.02))
    assert from_dict(old.to_dict()).diffusion == old.diffusion  # a checkpoint's config, as an older version wrote it
    assert resolve_config(old, layers=given, resumed=old).diffusion == old.diffusion  # its resume
    with pytest.raises(ConfigError, match=r"diffusion.beta_end='0.02' \(command line\) sets the linear schedule's"):
        resolve_config("tiny", layers=[("command line", {"train.init_from": str(pipeline), "beta_end": "0.02"})])


def test_a_head_width_equal_to_the_channels_is_one_head():
    """attention_head_dim equal to every attention layer's channels means one head, as None does."""
    import dataclasses

    from fastddpm.config.diffusers_unet import UNET2D_DEFAULTS, mismatch, model_fields

    theirs = {**UNET2D_DEFAULTS, **GOOGLE_DDPM_CIFAR10_32, "attention_head_dim": 64}
    fields = {k.split(".", 1)[1]: v for k, v in model_fields(theirs, "x/config.json").items()}
    cfg = _run_config(**fields)
    assert cfg.model.num_heads == 1 and mismatch(theirs, cfg) is None
    two = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_heads=2))
    assert mismatch(theirs, two) == "attention_head_dim is None there and 32 in this run's model"


@pytest.mark.parametrize("change, named", [
    ({"time_embedding_type": "fourier"}, "time_embedding_type='fourier'"),
    ({"resnet_time_scale_shift": "scale_shift"}, "attn_norm_num_groups=None"),
    ({"freq_shift": 2}, "freq_shift=2"),
    ({"downsample_padding": 2}, "downsample_padding=2"),
    ({"time_embedding_dim": 100}, "time_embedding_dim=100"),
    ({"mid_block_type": None}, "mid_block_type=None"),
    ({"up_block_types": ["UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"]}, "must mirror"),
    ({"block_out_channels": [32, 48, 64, 64]}, "multiples of the first"),
    ({"resnet_time_scale_shift": "ada_group"}, "resnet_time_scale_shift='ada_group'"),
    ({"attention_head_dim": 8, "block_out_channels": [32, 32, 64, 64]}, "one number of heads"),
])
def test_a_unet2d_config_fastddpm_cannot_compute_is_refused_by_name(change, named):
    from fastddpm.config.diffusers_unet import UNET2D_DEFAULTS, model_fields

    with pytest.raises(ConfigError, match=named):
        model_fields({**UNET2D_DEFAULTS, **GOOGLE_DDPM_CIFAR10_32, **change}, "x/config.json")


def test_a_scheduler_fastddpm_cannot_train_is_refused_by_name():
    from fastddpm.config.diffusers_unet import scheduler_fields

    assert scheduler_fields({"beta_schedule": "linear", "beta_start": 1e-4, "beta_end": 0.02}, "s.json") == {
        "diffusion.objective": "ddpm", "diffusion.num_timesteps": 1000, "diffusion.schedule": "linear",
        "diffusion.beta_start": 1e-4, "diffusion.beta_end": 0.02, "diffusion.prediction": "epsilon"}
    for bad, named in (({"beta_schedule": "scaled_linear"}, "beta_schedule='scaled_linear'"),
                       ({"prediction_type": "sample"}, "prediction_type='sample'"),
                       ({"trained_betas": [0.1, 0.2]}, "trained_betas"),
                       ({"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr=True")):
        with pytest.raises(ConfigError, match=named):
            scheduler_fields(bad, "s.json")


def test_the_tensorflow_switches_are_validated():
    with pytest.raises(ConfigError, match="time_freq_shift=2 must be 0"):
        ModelConfig(family="ddpm", time_freq_shift=2)
    with pytest.raises(ConfigError, match="downsample_padding='same' is not one of 'symmetric', 'tf-same'"):
        ModelConfig(family="ddpm", downsample_padding="same")
    with pytest.raises(ConfigError, match="norm_eps=0.0"):
        ModelConfig(family="ddpm", norm_eps=0.0)


def test_a_diffusers_export_of_the_raw_weights_is_them_and_its_card_says_so(tmp_path, rgb_npz):
    run, out = tmp_path / "run", tmp_path / "diffusers"
    _train(run, rgb_npz)
    assert main(["export", str(run), "--format", "diffusers", "--out", str(out), "--weights", "model"]) == 0
    from fastddpm.sampling import load_for_sampling

    raw, cfg = load_for_sampling(run, weights="model")
    ema, _ = load_for_sampling(run)
    assert _compare(raw, cfg, out) < 1e-5
    assert _compare(ema, cfg, out) > 1e-3  # diffusers' UNet2DModel is the raw network, not the EMA one
    assert "weights: raw" in (out / "README.md").read_text()


def test_the_conditional_cards_loop_draws_fastddpms_guided_images(tmp_path):
    """fastddpm samples a class at the run's guidance W (2 for new runs); the card's loop for a conditional export
    called the network once per step with the class alone, drawing other (unguided) images. Its loop, run with
    DDIMScheduler from the folder's config (as its "Fewer steps" section says) on the same starting noise, draws
    `fastddpm sample --sampler ddim --class` images at that W."""
    from types import SimpleNamespace

    from fastddpm.diffusers_io import model_card

    cfg = _run_config(conditional=True, num_classes=3, class_names=("a", "b", "c"))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sample_guidance=3.0))
    model = _randomised(cfg)
    write_folder(model, cfg, tmp_path)
    loop = model_card(cfg, {"step": 1, "images_seen": 8}, "cmd").split("```python\n")[2].split("```")[0]
    assert "guidance = 3" in loop

    class FewStepDDIM(diffusers.DDIMScheduler):  # the card's loop with 10 DDIM steps instead of 1000 DDPM ones
        def set_timesteps(self, num_inference_steps, device=None):
            super().set_timesteps(10, device)

        def step(self, model_output, timestep, sample, **kwargs):
            return super().step(model_output, timestep, sample, use_clipped_model_output=True)

    pipe = diffusers.DDPMPipeline.from_pretrained(str(tmp_path))
    scheduler = FewStepDDIM.from_config(pipe.scheduler.config)
    shape, seed = (4, 3, 32, 32), 5
    noise = ImageNoise("cpu", seed, 0, shape[0]).randn(shape)
    ran = {"pipe": SimpleNamespace(unet=pipe.unet, scheduler=scheduler), "noise": noise}
    assert "x = torch.randn(4, 3, 32, 32)" in loop
    exec(loop.replace("x = torch.randn(4, 3, 32, 32)", "x = noise.clone()"), ran)
    got = ran["x"]
    labels = torch.arange(4) % 3
    with torch.no_grad():
        want = sample(model, schedule_from_config(cfg.diffusion), shape, sampler="ddim", steps=10, seed=seed,
                      labels=labels, guidance=3.0, num_classes=3)
        unguided = sample(model, schedule_from_config(cfg.diffusion), shape, sampler="ddim", steps=10, seed=seed,
                          labels=labels, guidance=1.0, num_classes=3)
    assert ((want - unguided).abs().max() * 127.5) > 5  # guidance changes the images here
    assert ((want - got).abs().max() * 127.5).item() < 1.0


def test_init_from_a_fastddpm_run_or_its_files_says_what_it_is_and_how_to_go_on(tmp_path):
    """A fastddpm run folder (its own config.json beside checkpoints/), a checkpoint, ema.safetensors or a
    safetensors/ONNX export given to --init-from: named as what it is, with --resume and `fastddpm export --format
    diffusers`; it was told 'need RUN/config.json', a file that is there."""
    from fastddpm.config.diffusers_unet import read_unet_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "checkpoints" / "ckpt_000000002.pt").write_bytes(b"pt")
    (run / "ema.safetensors").write_bytes(b"st")
    export = run / "export-safetensors"
    export.mkdir()
    for name in ("model.safetensors", "schedule.json", "config.json"):
        (export / name).write_text("{}")
    for given, what in ((run, "a fastddpm run folder"), (run / "checkpoints" / "ckpt_000000002.pt", "a checkpoint"),
                        (run / "ema.safetensors", "a checkpoint"), (export, "a fastddpm export")):
        with pytest.raises(ConfigError, match=rf"^--init-from {re.escape(str(given))}: {what}.*, not a diffusers "
                                              r"folder: .* pass its folder or a checkpoints/ckpt_\*\.pt as --resume; "
                                              r".*`fastddpm export RUN --format diffusers --out DIR`"):
            read_unet_config(given)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no diffusers UNet2DModel there"):
        read_unet_config(empty)
