"""--log-to tensorboard: the event files, read back with TensorBoard's own EventAccumulator, hold the values of
metrics.jsonl (train and eval), the sample grids and the config; a resumed run continues the same curves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval_fixtures import fmnist_splits  # noqa: F401 (a fixture: a real train/test slice)
from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.train.metrics import read_metrics

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="tensorboard is a test extra (pip install tensorboard)")


def accumulate(run_dir):
    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_what_metrics_jsonl_holds(tmp_path, fmnist_splits):
    run = tmp_path / "run"
    args = ["train", "--data", str(fmnist_splits), "--out", str(run), "--preset", "tiny", "--max-steps", "8",
            "--log-every", "2", "--sample-every-images", "64", "--no-progress", "--log-to", "jsonl,tensorboard",
            "--eval-every", "128", "--eval-samples", "20", "--eval-steps", "2"]
    assert main(args) == 0
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if r.get("event") != "eval"]
    evals = [r for r in records if r.get("event") == "eval"]
    acc = accumulate(run)
    tags = acc.Tags()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in train]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in train], rtol=1e-6)  # float32 in the file
    np.testing.assert_allclose([e.value for e in acc.Scalars("train/images_per_s")],
                               [r["images_per_s"] for r in train], rtol=1e-6)
    assert "train/lr" in tags["scalars"] and "train/wall_s" in tags["scalars"]
    assert evals and [e.step for e in acc.Scalars("eval/fid")] == [r["step"] for r in evals]
    np.testing.assert_allclose([e.value for e in acc.Scalars("eval/fid")], [r["fid"] for r in evals], rtol=1e-6)
    assert "eval/precision" in tags["scalars"] and "eval/recall" in tags["scalars"]
    grids = acc.Images("samples")  # the grid drawn every 64 images (steps 4) and the final one (step 8)
    assert [g.step for g in grids] == [4, 8] and all(g.width > 28 for g in grids)
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n"))["model"] == json.loads((run / "config.json").read_text())["model"]

    # resumed: the same folder, the curve continues from the checkpoint's step
    assert main([*args[:args.index("--max-steps")], "--max-steps", "10", *args[args.index("--max-steps") + 2:],
                 "--resume", "latest"]) == 0
    steps = [e.step for e in accumulate(run).Scalars("train/loss")]
    assert steps[:4] == [2, 4, 6, 8] and steps[-1] == 10


def test_log_to_names_its_choices():
    with pytest.raises(ConfigError, match="wandbb is not one of jsonl, tensorboard"):
        apply_overrides(get_preset("tiny"), {"train.log_to": "jsonl,wandbb"})
    assert apply_overrides(get_preset("tiny"), {"train.log_to": "tensorboard"}).train.log_to == ("jsonl", "tensorboard")
