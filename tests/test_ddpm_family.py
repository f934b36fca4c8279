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
    args = ["train", "--data", str(rgb_npz), "--out", str(run), "--preset", "tiny", *flags(TINY_DDPM),
            "--resblock-updown", "--dropout", "0.1", "--hflip", "--log-every", "1", "--no-progress"]
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
