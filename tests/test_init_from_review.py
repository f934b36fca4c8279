"""`train --init-from` a diffusers folder: what the run records and says when the folder's model is not the preset's
(an unconditional UNet2DModel under the class-conditional cpu-demo-cond, the CPU's default preset)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_DDPM
from fastddpm.cli import main
from fastddpm.config import API, CLI, ConfigError, DiffusionConfig, ModelConfig, RunConfig, resolve_config
from fastddpm.diffusers_io import write_folder
from fastddpm.models import build_unet
from fastddpm.trainer.resume_checks import unconditional_init_note


def _folder(path, **model):
    """A diffusers DDPMPipeline folder of a tiny random ddpm U-Net for 32x32 RGB images, as export writes it."""
    over = {k.split(".", 1)[1]: v for k, v in TINY_DDPM.items()}
    over.update(image_channels=3, image_size=32, **model)
    cfg = RunConfig(model=ModelConfig(**over), diffusion=DiffusionConfig())
    torch.manual_seed(0)
    write_folder(build_unet(cfg.model).eval(), cfg, path)
    return path


def test_an_unconditional_folder_under_a_conditional_preset_trains_and_records_an_unconditional_model(
        tmp_path, rgb_npz, capsys):
    """The folder sets the architecture, class embedding included, so the run trains an unconditional model: it
    had recorded the cpu-demo-cond preset's label dropout (0.1) and said nothing, so its log and config.json read
    as a conditional run's. Its config now records no label dropout, and a note says what it trains and how to
    train a class-conditional model instead."""
    plain = _folder(tmp_path / "plain")
    cfg = resolve_config("cpu-demo-cond", layers=[("command line", {"train.init_from": str(plain)})])
    assert (cfg.preset, cfg.model.conditional, cfg.train.cond_drop_prob) == ("cpu-demo-cond", False, 0.0)
    note = unconditional_init_note(cfg)
    assert len(note) == 1 and note[0].startswith(f"note: --init-from {plain} holds an unconditional UNet2DModel")
    assert "not the cpu-demo-cond preset's class-conditional one" in note[0]
    assert "leave --init-from out" in note[0] and f"init_from={str(plain)!r} holds" in unconditional_init_note(
        cfg, API)[0]
    # a label dropout given explicitly to such a run is refused (it would be ignored), as without --init-from
    with pytest.raises(ConfigError, match=r"train.cond_drop_prob='0.2' \(command line\) is a conditional model's"):
        resolve_config("cpu-demo-cond", layers=[("command line", {"train.init_from": str(plain),
                                                                  "train.cond_drop_prob": "0.2"})])
    # a conditional folder keeps the preset's label dropout, and says nothing
    cond = _folder(tmp_path / "cond", conditional=True, num_classes=2, class_names=("a", "b"))
    cfg = resolve_config("cpu-demo-cond", layers=[("command line", {"train.init_from": str(cond)})])
    assert (cfg.model.conditional, cfg.train.cond_drop_prob) == (True, 0.1) and unconditional_init_note(cfg) == []
    # an unconditional preset says nothing either: it trains what it names
    cfg = resolve_config("cpu-demo", layers=[("command line", {"train.init_from": str(plain)})])
    assert not cfg.model.conditional and unconditional_init_note(cfg, CLI) == []

    run = tmp_path / "run"
    assert main(["train", "--data", str(rgb_npz), "--out", str(run), "--preset", "cpu-demo-cond", "--init-from",
                 str(plain), "--max-steps", "1", "--batch-size", "8", "--num-sample-images", "4", "--sample-steps",
                 "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"note: --init-from {plain} holds an unconditional UNet2DModel" in out
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["conditional"] is False and saved["train"]["cond_drop_prob"] == 0.0
