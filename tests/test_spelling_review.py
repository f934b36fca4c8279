"""Refusals of a run whose architecture differs (a resume's, --init-from's) name the fix as the caller gives it: the
command's flags to `fastddpm train`, fastddpm.train's arguments to the Python API (it takes the preset as its first
argument and refuses a preset= keyword)."""

from __future__ import annotations

import pytest
import torch

import fastddpm
from conftest import TINY_DDPM
from fastddpm.cli import main
from fastddpm.config import ConfigError, DiffusionConfig, ModelConfig, RunConfig
from fastddpm.diffusers_io import write_folder
from fastddpm.models import build_unet

SMALL = dict(num_sample_images=4, sample_steps=2, batch_size=8, progress=False, log=None)
SMALL_FLAGS = ["--num-sample-images", "4", "--sample-steps", "2", "--batch-size", "8", "--no-progress"]


def test_a_resume_whose_architecture_or_seed_differs_names_the_preset_as_the_caller_gives_it(tmp_path, rgb_npz,
                                                                                               capsys):
    """fastddpm.train(PRESET, resume='latest') was told `--preset`, `--beta-start`, flags it has no way to give."""
    run = tmp_path / "run"
    fastddpm.train("tiny", out=run, data=str(rgb_npz), max_steps=1, seed=5, beta_end=0.01, attention=False, **SMALL)

    def api(**over):
        with pytest.raises(ConfigError) as e:
            fastddpm.train("tiny", out=run, data=str(rgb_npz), resume="latest", max_steps=2, **SMALL, **over)
        assert "--" not in str(e.value).replace(str(tmp_path), "")
        return str(e.value)

    def cli(*flags):
        assert main(["train", "--preset", "tiny", "--out", str(run), "--data", str(rgb_npz), "--resume", "latest",
                     "--max-steps", "2", *SMALL_FLAGS, *flags]) == 2
        return capsys.readouterr().err

    assert ("Pass seed=5 (or resume without seed and without the preset 'tiny': a preset given on resume replaces "
            "the run's whole config, its seed included)") in api()
    assert "Pass --seed 5 (or resume without --seed and without --preset tiny: a preset" in cli()
    assert "resume with beta_start=0.0001, beta_end=0.01, or start a new run directory" in api(seed=5)
    assert "resume with --beta-start 0.0001 --beta-end 0.01, or start" in cli("--seed", "5")
    said = api(seed=5, beta_end=0.01)
    assert "model.attention was False in the checkpoint but is True now (True is the tiny preset's value" in said
    assert ("where a preset is given (fastddpm.train's first argument, or a config file's `preset`), a resume starts "
            "from the preset's values, not the run's; without one, fastddpm.train(out=..., resume='latest') goes on "
            "with the run's own)") in said
    assert ("where --preset is given, a resume starts from the preset's values, not the run's; without --preset it "
            "goes on with the run's own)") in cli("--seed", "5", "--beta-end", "0.01")


def test_an_init_from_folder_of_another_width_names_init_from_as_the_caller_gives_it(tmp_path, rgb_npz, capsys):
    over = {k.split(".", 1)[1]: v for k, v in TINY_DDPM.items()}
    over.update(image_channels=3, image_size=32)
    cfg = RunConfig(model=ModelConfig(**over), diffusion=DiffusionConfig())
    torch.manual_seed(0)
    folder = tmp_path / "folder"
    write_folder(build_unet(cfg.model).eval(), cfg, folder)
    with pytest.raises(ConfigError) as e:
        fastddpm.train("tiny", out=tmp_path / "a", data=str(rgb_npz), init_from=str(folder), base_channels=32,
                       max_steps=1, **SMALL)
    assert str(e.value).startswith(f"init_from={str(folder / 'unet' / 'config.json')!r}: block_out_channels is "
                                   "[16, 32] there and [32, 64] in this run's model")
    assert str(e.value).endswith("(leave the model options out of fastddpm.train: they are read from the folder, or "
                                 "set them to match)")
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "b"), "--data", str(rgb_npz), "--init-from",
                 str(folder), "--base-channels", "32", "--max-steps", "1", *SMALL_FLAGS]) == 2
    err = capsys.readouterr().err
    assert f"--init-from {folder / 'unet' / 'config.json'}: block_out_channels is [16, 32] there" in err
    assert "(leave the model options out of the command line: they are read from the folder" in err


def test_init_from_under_another_family_names_both_as_the_caller_gives_them(tmp_path, rgb_npz, capsys):
    """fastddpm.train(init_from=..., family='seed') was told `--init-from` and `drop --family seed`."""
    over = {k.split(".", 1)[1]: v for k, v in TINY_DDPM.items()}
    over.update(image_channels=3, image_size=32)
    cfg = RunConfig(model=ModelConfig(**over), diffusion=DiffusionConfig())
    folder = tmp_path / "folder"
    write_folder(build_unet(cfg.model).eval(), cfg, folder)
    with pytest.raises(ConfigError) as e:
        fastddpm.train("tiny", out=tmp_path / "a", data=str(rgb_npz), init_from=str(folder), family="seed",
                       max_steps=1, **SMALL)
    assert str(e.value).startswith(f"init_from={str(folder)!r}: a diffusers UNet2DModel is fastddpm's ddpm family")
    assert str(e.value).endswith("drop family='seed' (the folder sets the architecture)")
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "b"), "--data", str(rgb_npz), "--init-from",
                 str(folder), "--family", "seed", "--max-steps", "1", *SMALL_FLAGS]) == 2
    assert f"--init-from {folder}: a diffusers UNet2DModel" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_inception_file_given_by_set_is_named_as_set_as_typed(tmp_path, rgb_npz, capsys):
    """`train --set train.eval_inception=BAD` was told `--eval-inception BAD: no such file ... (--eval-inception auto
    instead ...)`, a flag never typed; the flag itself, or one over the --set, is still named as the flag."""
    missing = tmp_path / "no-such.pth"
    argv = ["train", "--preset", "tiny", "--data", str(rgb_npz), "--max-steps", "1", "--eval-every", "16",
            *SMALL_FLAGS]
    for key in ("train.eval_inception", "eval_inception"):
        assert main([*argv, "--out", str(tmp_path / "a"), "--set", f"{key}={missing}"]) == 2
        err = capsys.readouterr().err
        assert f"error: --set {key}={missing}: no such file" in err
        assert f"(--set {key}=auto instead finds or downloads" in err and "--eval-inception" not in err
    assert main([*argv, "--out", str(tmp_path / "a"), "--set", f"eval_inception={tmp_path / 'other.pth'}",
                 "--eval-inception", str(missing)]) == 2  # the flag wins over --set, and is named
    err = capsys.readouterr().err
    assert f"error: --eval-inception {missing}: no such file" in err and "--set" not in err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("given, says", [
    ({"objective": "ddpm", "flow_shift": 3.0}, "add objective='flow' to train a flow-matching model with it"),
    ({"objective": "ddpm", "schedule": "cosine", "beta_end": 0.01}, "add schedule='linear' to train with it"),
    ({"dropout": 0.1}, "train a ddpm-family U-Net with it (family='ddpm', or the preset 'ddpm-cifar10' / "
                       "'ddpm-rgb64' as fastddpm.train's first argument), or leave it out"),
    ({"cond_drop_prob": 0.2}, "add conditional=True (on labelled data) to train a class-conditional model"),
    ({"class_names": ("a", "b")}, "add conditional=True (on labelled data) to train a class-conditional model "
                                  "with them, or leave class_names out"),
], ids=["objective", "schedule", "family", "cond-drop-prob", "class-names"])
def test_a_setting_the_run_would_ignore_names_the_fix_as_fastddpm_train_takes_it(tmp_path, given, says):
    """A keyword fastddpm.train's run would not read (another objective's, family's, a conditional model's) was
    refused naming the fix as the command's flag (--objective flow, --preset ddpm-cifar10, --conditional)."""
    with pytest.raises(ConfigError) as e:
        fastddpm.train("tiny", out=tmp_path / "run", log=None, **given)
    assert says in str(e.value) and "--" not in str(e.value) and not (tmp_path / "run").exists()
