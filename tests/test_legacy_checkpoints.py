"""Checkpoints written before the run files moved to fastddpm.rundir (commit 3203729, 2026-11-25) still load:
they resume exactly, sample, evaluate's loader reads them, and a corrupted export fails with a clear error.

The files in tests/golden/legacy/ were written by that commit's `fastddpm train` (tests/golden/make_legacy_runs.py
says how): a conditional tiny U-Net trained 4 steps in fp16 (its loss scaler saved), the checkpoint of step 2 kept
with the uninterrupted run's losses of steps 3 and 4; and a 2-rank FSDP run's sharded checkpoint of step 2.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fastddpm.cli import main
from fastddpm.rundir.files import CheckpointError
from fastddpm.rundir.locate import locate
from fastddpm.rundir.metrics import read_metrics
from fastddpm.sampling import load_for_sampling

LEGACY = Path(__file__).parent / "golden" / "legacy"
SMALL = ["--preset", "tiny", "--down-channels", "8,16,16", "--mid-channels", "16,16", "--time-emb-dim", "16",
         "--out-block-channels", "8", "--num-heads", "2", "--batch-size", "8", "--device", "cpu", "--no-progress",
         "--log-every", "1", "--checkpoint-every", "2", "--num-sample-images", "4", "--sample-steps", "2",
         "--cpu-threads", "1"]


@pytest.fixture
def legacy_run(tmp_path) -> Path:
    run = tmp_path / "pt"
    shutil.copytree(LEGACY / "pt", run)
    return run


def test_a_legacy_checkpoint_resumes_to_the_uninterrupted_runs_losses(legacy_run, fmnist_npz):
    """Resumed from step 2 by today's trainer, steps 3 and 4 give the losses the old code's uninterrupted run
    logged: the model, EMA, optimizer, loss scaler, counters and RNG all came back."""
    old = {r["step"]: r["loss"] for r in read_metrics(legacy_run / "metrics.jsonl")}
    (legacy_run / "metrics.jsonl").write_text("")  # the resumed run's own lines only
    (legacy_run / "ema.safetensors").unlink()  # written again by the resumed run's checkpoints
    code = main(["train", *SMALL, "--data", str(fmnist_npz), "--out", str(legacy_run), "--conditional",
                 "--precision", "fp16", "--max-steps", "4", "--resume", "latest"])
    assert code == 0
    new = {r["step"]: r["loss"] for r in read_metrics(legacy_run / "metrics.jsonl") if "loss" in r}
    assert sorted(new) == [3, 4]
    # Bit-equal on the machine that wrote the files; another CPU's kernels may sum in another order (float32
    # rounding, as the golden losses allow). A lost state is far larger: Adam's moments, the scaler's count.
    np.testing.assert_allclose([new[3], new[4]], [old[3], old[4]], rtol=1e-5, atol=0)
    saved = torch.load(legacy_run / "checkpoints" / "ckpt_000000004.pt", weights_only=True)
    assert saved["step"] == 4 and saved["images_seen"] == 32
    # the loss scaler counted on from the checkpoint's 2 finite steps (a fresh one would stand at 2, not 4)
    assert saved["scaler"]["_growth_tracker"] == 4 and saved["scaler"]["scale"] == 65536.0


def test_legacy_files_sample_through_every_path(legacy_run, tmp_path):
    """The .pt checkpoint, the run directory, ema.safetensors and the sharded .dcp all locate and load."""
    ckpt = locate(legacy_run / "checkpoints" / "ckpt_000000002.pt")
    assert (ckpt.kind, ckpt.step, ckpt.images_seen) == ("pt", 2, 16)
    assert ckpt.config.model.conditional and ckpt.run_dir.path == legacy_run
    model, cfg = load_for_sampling(ckpt)
    assert cfg.model.num_classes == 10
    ema = locate(legacy_run / "ema.safetensors")
    assert (ema.kind, ema.step, ema.images_seen) == ("safetensors", 4, 32)
    assert locate(legacy_run).path == ckpt.path  # a run directory: its newest checkpoint
    code = main(["sample", "--checkpoint", str(legacy_run / "ema.safetensors"), "--num-images", "4", "--steps", "2",
                 "--class", "3", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "s")])
    assert code == 0 and len(list((tmp_path / "s").glob("*.png"))) == 1

    dcp = locate(LEGACY / "dcp" / "ckpt_000000002.dcp")
    assert (dcp.kind, dcp.step) == ("dcp", 2)
    model, cfg = load_for_sampling(dcp, weights="model")
    assert not cfg.model.conditional
    with torch.no_grad():
        out = model(torch.zeros(2, 1, 28, 28), torch.tensor([10, 500]))
    assert out.shape == (2, 1, 28, 28) and torch.isfinite(out).all()


def test_a_corrupted_export_is_a_clear_error_that_names_it(legacy_run, capsys):
    """A truncated ema.safetensors ends `fastddpm sample` with exit code 2 and a message naming the file and
    what to pass instead, not safetensors' own traceback."""
    export = legacy_run / "ema.safetensors"
    export.write_bytes(export.read_bytes()[:5])
    code = main(["sample", "--checkpoint", str(export), "--num-images", "2", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(export) in err and "not a readable safetensors file" in err and "ckpt_*.pt" in err
    assert "Traceback" not in err
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        locate(export)
    # a .pt checkpoint beside it still serves the run directory
    assert locate(legacy_run).kind == "pt"


def test_the_legacy_export_metadata_is_what_loaders_read():
    """ema.safetensors carries the config and counters as JSON strings: the contract other tools rely on."""
    from safetensors import safe_open

    with safe_open(str(LEGACY / "pt" / "ema.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "fastddpm-ema-1"
    assert json.loads(meta["step"]) == 4 and json.loads(meta["config"])["model"]["conditional"] is True
