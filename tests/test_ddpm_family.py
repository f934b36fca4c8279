"""The DDPM / improved-diffusion U-Net family end to end on 32x32 RGB images: a tiny-width model of
the family trains from the command line, resumes, samples and exports, as the seed's U-Net does. (Its fast-path
equivalences and exact resume run in test_fast_path.py and test_train.py, beside the seed's.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TINY_DDPM, flags
from fastddpm.cli import main
from fastddpm.rundir.metrics import read_metrics


@pytest.fixture(scope="module")
def rgb_npz(tmp_path_factory):
    """64 RGB 32x32 images: smooth colour gradients with a random tint per image (not noise, so a loss can fall)."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    tint = rng.uniform(0, 1, (64, 3, 1, 1))
    images = (255 * np.clip(tint * (0.5 + 0.5 * np.stack([xx, yy, 1 - xx])[None]), 0, 1)).astype(np.uint8)
    path = tmp_path_factory.mktemp("rgb") / "rgb32.npz"
    np.savez(path, images=images, labels=rng.integers(0, 4, 64))
    return path


def test_a_tiny_ddpm_family_model_trains_resumes_samples_and_exports_on_rgb(tmp_path, rgb_npz):
    run = tmp_path / "run"
    # a final grid of 4 images in 2 steps, not the preset's 16 in 10: `sample` below is what draws images checked
    args = ["train", "--data", str(rgb_npz), "--out", str(run), "--preset", "tiny", *flags(TINY_DDPM),
            "--resblock-updown", "--dropout", "0.1", "--hflip", "--log-every", "1", "--num-sample-images", "4",
            "--sample-steps", "2", "--no-progress"]
    assert main([*args, "--max-steps", "3"]) == 0
    assert main([*args, "--max-steps", "5", "--resume", "latest"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["family"] == "ddpm" and cfg["model"]["image_channels"] == 3 and cfg["model"]["image_size"] == 32
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert main(["sample", "--checkpoint", str(run), "--num-images", "4", "--steps", "2", "--no-progress",
                 "--out", str(tmp_path / "s")]) == 0
    images = np.load(next((tmp_path / "s").glob("*.npz")))["images"]
    assert images.shape == (4, 3, 32, 32) and images.dtype == np.uint8
    assert main(["export", str(run), "--format", "torch-export", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "export.json").read_text())["max_abs_diff"] <= 1e-3


def test_an_attention_resolution_that_is_no_level_is_refused_naming_the_levels():
    """ddpm-cifar10 at --resize 24 (levels 24, 12, 6, 3) built without its 16x16 attention and said nothing: an
    attention_resolutions entry must be the side of one of the U-Net's levels, checked once the data gives the image
    size, and the message names the levels and a fix that builds."""
    from fastddpm.config import ConfigError, apply_overrides, get_preset, resolve_model_shape
    from fastddpm.models import build_unet
    from fastddpm.models.ddpm_unet import Attention

    narrow = apply_overrides(get_preset("ddpm-cifar10"), {"model.base_channels": 32})  # the preset, 16x less compute
    with pytest.raises(ConfigError, match=r"model.attention_resolutions=\(16,\): this U-Net has no level of 16 pixels "
                                          r"per side.*levels of channel_mult=\(1, 2, 2, 2\) are 24, 12, 6, 3 pixels; "
                                          r"name those, e.g. --set model.attention_resolutions=12"):
        resolve_model_shape(narrow, (10, 3, 24, 24))
    fixed = resolve_model_shape(apply_overrides(narrow, {"model.attention_resolutions": "12"}), (10, 3, 24, 24))
    net = build_unet(fixed.model)
    assert sum(isinstance(m, Attention) for m in net.modules()) == 2 + 3 + 1  # 2 down, 3 up at 12x12, the middle
    # one entry of two that is no level is refused as well: that attention would be left out alone
    with pytest.raises(ConfigError, match=r"no level of 12 pixels per side.*32, 16, 8, 4 pixels"):
        resolve_model_shape(apply_overrides(narrow, {"model.attention_resolutions": (16, 12)}), (10, 3, 32, 32))
    assert resolve_model_shape(narrow, (10, 3, 32, 32)).model.attention_resolutions == (16,)  # the preset's data
    # a run saved before the check (its config holds the size) still loads, samples and resumes with its model
    import dataclasses

    saved = dataclasses.replace(narrow.model, image_channels=3, image_size=24)
    assert sum(isinstance(m, Attention) for m in build_unet(saved).modules()) == 1  # the middle block's only
    assert resolve_model_shape(narrow, (10, 3, 24, 24), new_model=False).model.image_size == 24


def test_a_new_run_started_with_resume_latest_is_checked_like_any_new_run(tmp_path, rgb_npz, capsys):
    """`--resume latest` with no checkpoint yet (how torchrun jobs start) trains a new model: its attention levels
    are checked as a plain new run's are."""
    args = ["train", "--data", str(rgb_npz), "--out", str(tmp_path / "run"), "--preset", "tiny",
            *flags({**TINY_DDPM, "model.attention_resolutions": (12,)}), "--max-steps", "1", "--no-progress"]
    for extra in ([], ["--resume", "latest"]):
        assert main([*args, *extra]) == 2
        assert "no level of 12 pixels per side" in capsys.readouterr().err
    assert not list((tmp_path / "run").glob("checkpoints/*.pt"))


def test_num_heads_need_divide_only_the_channels_that_have_attention(tmp_path):
    """Only attention layers split their channels into heads: base 32, mult 1,3 with attention at the 96-channel
    level (and the middle) takes 3 heads, though the first level's 32 channels do not divide by 3. A level with
    attention, or the middle, that does not divide is refused naming its channels. A diffusers folder that maps to
    such a head count starts a run."""
    import torch

    from fastddpm.config import ConfigError, ModelConfig, resolve_config
    from fastddpm.models import build_unet

    def model(**over):
        return ModelConfig(**{"family": "ddpm", "base_channels": 32, "channel_mult": (1, 3), "num_res_blocks": 1,
                              "attention_resolutions": (8,), "num_heads": 3, "image_channels": 3, "image_size": 16,
                              **over})

    net = build_unet(model())
    with torch.no_grad():
        assert net(torch.randn(2, 3, 16, 16), torch.tensor([1, 900])).shape == (2, 3, 16, 16)
    with pytest.raises(ConfigError, match=r"model.num_heads=3: the attention at 16x16 has 32 channels \(base_channels "
                                          r"x channel_mult\[0\]\), which do not split into 3 heads"):
        model(attention_resolutions=(16, 8)).validate_shape()
    with pytest.raises(ConfigError, match=r"model.num_heads=3: the middle block's attention has 64 channels"):
        model(channel_mult=(3, 2))
    with pytest.raises(ConfigError, match=r"divisible by model.norm_groups=8"):  # every level has a GroupNorm
        model(channel_mult=(1, 3), base_channels=36, num_heads=1)

    folder = tmp_path / "unet"
    folder.mkdir()
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"")  # resolving reads the config.json only
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "UNet2DModel", "sample_size": 16, "in_channels": 3, "out_channels": 3,
        "block_out_channels": [32, 96], "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
        "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1, "attention_head_dim": 32,
        "norm_num_groups": 8, "flip_sin_to_cos": False}))
    m = resolve_config("tiny", layers=[("command line", {"train.init_from": str(folder)})]).model
    assert (m.family, m.num_heads, m.channel_mult, m.attention_resolutions) == ("ddpm", 3, (1, 3), (8,))
