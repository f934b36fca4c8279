"""Golden losses: the first 20 losses of a tiny fixed-seed CPU run equal a stored file.

A change that alters the numerics (the model, the diffusion math, the data order, the optimizer) must
regenerate the file on purpose, in its own commit that says why:
    FASTDDPM_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

import json
import os
from pathlib import Path

import numpy as np

from fastddpm.config import apply_overrides, get_preset
from fastddpm.rundir.metrics import read_metrics
from fastddpm.trainer.loop import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"


def test_first_20_losses_match_the_golden_file(tmp_path):
    from conftest import read_fmnist

    images, labels = read_fmnist(256)
    src = tmp_path / "fmnist256.npz"
    np.savez(src, images=images, labels=labels)
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(src), "train.progress": False,
                                               "train.max_steps": 20, "train.log_every": 1,
                                               "train.checkpoint_every": None, "train.num_sample_images": 1,
                                               "train.sample_steps": 1})
    train(cfg, out_dir=tmp_path / "run", log=lambda *a: None)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 20
    if os.environ.get("FASTDDPM_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"preset": "tiny", "data": "first 256 Fashion-MNIST train images",
                                      "device": "cpu", "losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    # Equal up to float32 summation order across CPU kernels (1e-5 relative); any real change is far larger.
    np.testing.assert_allclose(losses, golden, rtol=1e-5, atol=0)
