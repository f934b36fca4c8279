"""--log-to tensorboard: the event files, read back with TensorBoard's own EventAccumulator, hold the values of
metrics.jsonl (train and eval), the sample grids and the config; a resumed run continues the same curves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval_fixtures import fmnist_splits  # noqa: F401 (a fixture: a real train/test slice)
from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.rundir.metrics import read_metrics

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="tensorboard is a test extra (pip install tensorboard)")


def logged_run(tmp_path, data, log_to: str):
    """A tiny run of 8 steps logging every 2, a grid every 4 steps and an evaluation at step 8, sent to `log_to`.
    Returns (run dir, its CLI arguments, the metrics.jsonl train lines, its eval lines). The grids are 4 images in
    2 sampler steps (the preset's: 16 in 10): what is checked of them is their steps and that each is an image. The
    U-Net has no attention (at 28x28, over 784 positions, most of a CPU step's and a sampler step's time): what is
    checked is what reaches the loggers."""
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--max-steps", "8",
            "--log-every", "2", "--sample-every-images", "64", "--no-progress", "--log-to", log_to,
            "--eval-every", "128", "--eval-samples", "20", "--eval-steps", "2", "--num-sample-images", "4",
            "--sample-steps", "2", "--no-attention"]
    assert main(args) == 0
    records = read_metrics(run / "metrics.jsonl")
    return run, args, [r for r in records if r.get("event") != "eval"], [r for r in records if r.get("event") == "eval"]


def accumulate(run_dir):
    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_what_metrics_jsonl_holds(tmp_path, fmnist_splits):
    run, args, train, evals = logged_run(tmp_path, fmnist_splits, "jsonl,tensorboard")
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


def test_a_resume_from_an_earlier_checkpoint_hides_the_abandoned_steps(tmp_path, fmnist_npz):
    """A run to step 6, resumed from its step-2 checkpoint to step 4: TensorBoard shows one value per step, the new
    branch's (metrics.jsonl's), and the abandoned branch's grid at step 6 is gone."""
    from fastddpm.trainer.loop import train

    run = tmp_path / "run"
    cfg = apply_overrides(get_preset("tiny"), {
        "data.source": str(fmnist_npz), "train.progress": False, "train.log_to": "jsonl,tensorboard",
        "train.log_every": 1, "train.checkpoint_every": 2, "train.max_steps": 6, "train.sample_steps": 2,
        "train.num_sample_images": 4, "model.attention": False})  # attention: most of a CPU step, and incidental
    train(cfg, out_dir=run, log=lambda *a: None)
    train(apply_overrides(cfg, {"train.max_steps": 4}), out_dir=run, resume=run / "checkpoints" / "ckpt_000000002.pt",
          log=lambda *a: None)
    acc = accumulate(run)
    records = read_metrics(run / "metrics.jsonl")
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in records] == [1, 2, 3, 4]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in records], rtol=1e-6)
    assert [g.step for g in acc.Images("samples")] == [4]


def test_log_to_names_its_choices():
    with pytest.raises(ConfigError, match="wandbb is not one of jsonl, tensorboard"):
        apply_overrides(get_preset("tiny"), {"train.log_to": "jsonl,wandbb"})
    assert apply_overrides(get_preset("tiny"), {"train.log_to": "tensorboard"}).train.log_to == ("jsonl", "tensorboard")


def wandb_records(path) -> list:
    """The records of a W&B offline run file (run-<id>.wandb): ':W&B', a 2-byte magic and a version byte, then
    LevelDB-log framing (32 KiB blocks; 7-byte record headers: crc32c, length, type full/first/middle/last) around
    serialized wandb_internal_pb2.Record messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return [wandb_internal_pb2.Record.FromString(b) for b in out]


def wandb_history(run_dir) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} from every offline run file of RUN_DIR/wandb, oldest first."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in wandb_records(path):
            if r.WhichOneof("record_type") != "history":
                continue
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                value = json.loads(item.value_json)
                if isinstance(value, (int, float)):
                    out.setdefault(key, []).append((r.history.step.num, float(value)))
    return out


def test_tensorboard_and_wandb_offline_together_hold_what_metrics_jsonl_holds(tmp_path, fmnist_splits, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an extra (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run, args, train, evals = logged_run(tmp_path, fmnist_splits, "tensorboard,wandb")  # both at once
    tb_loss = [e.value for e in accumulate(run).Scalars("train/loss")]
    np.testing.assert_allclose(tb_loss, [r["loss"] for r in train], rtol=1e-6)
    history = wandb_history(run)
    assert [s for s, _ in history["train/loss"]] == [r["step"] for r in train]
    np.testing.assert_allclose([v for _, v in history["train/loss"]], [r["loss"] for r in train], rtol=1e-12)
    np.testing.assert_allclose([v for _, v in history["eval/fid"]], [r["fid"] for r in evals], rtol=1e-12)
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    kept = wandb_records(files[0])
    assert {"run", "history", "artifact"} <= {r.WhichOneof("record_type") for r in kept}  # + ema.safetensors
    config = {u.key: json.loads(u.value_json) for r in kept if r.WhichOneof("record_type") == "run"
              for u in r.run.config.update}
    assert config["model"] == json.loads((run / "config.json").read_text())["model"]
    run_id = (run / "wandb_run_id").read_text().strip()
    assert files[0].name == f"run-{run_id}.wandb"

    # resumed: the same W&B run id, its history continued from the checkpoint's step
    assert main([*args[:args.index("--max-steps")], "--max-steps", "10", *args[args.index("--max-steps") + 2:],
                 "--resume", "latest"]) == 0
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and {f.name for f in files} == {f"run-{run_id}.wandb"}
    assert [s for s, _ in wandb_history(run)["train/loss"]][-1] == 10


def test_wandb_that_cannot_start_a_run_is_one_error_line_naming_the_ways_on(tmp_path, fmnist_npz, capsys,
                                                                             monkeypatch):
    """No API key (or no network): W&B's own UsageError was a traceback; it is the run's error line, before any
    step, naming `wandb login` and WANDB_MODE=offline."""
    wandb = pytest.importorskip("wandb")

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    code = main(["train", "--data", str(fmnist_npz), "--out", str(tmp_path / "run"), "--preset", "tiny",
                 "--max-steps", "2", "--no-progress", "--log-to", "jsonl,wandb"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--log-to wandb: W&B could not start a run (No API key configured." in err
    assert "wandb login" in err and "WANDB_MODE=offline" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def wandb_runs(run_dir) -> dict[str, list]:
    """{W&B run id: its records, from every offline run file of RUN_DIR/wandb}."""
    runs: dict[str, list] = {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        runs.setdefault(path.stem.removeprefix("run-"), []).extend(wandb_records(path))
    return runs


def run_loss(records) -> list[tuple[int, float]]:
    return [(r.history.step.num, json.loads(item.value_json)) for r in records
            if r.WhichOneof("record_type") == "history" for item in r.history.item
            if (item.key or "/".join(item.nested_key)) == "train/loss"]


def test_a_resume_from_an_earlier_checkpoint_logs_its_branch_to_a_w_and_b_run_of_its_own(tmp_path, fmnist_splits,
                                                                                        monkeypatch):
    """W&B keeps a run's first value of a step: a branch from an earlier checkpoint (here at another learning rate)
    continued the W&B run, whose steps after the branch point kept the abandoned branch's losses. The branch gets
    its own W&B run, holding the history up to the branch point and the branch's own steps, as metrics.jsonl does;
    and a run that starts logging to W&B on a resume gets the steps before it too."""
    pytest.importorskip("wandb", reason="wandb is an extra (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = ["train", "--data", str(fmnist_splits), "--out", str(run), "--preset", "tiny", "--max-steps", "8",
            "--log-every", "2", "--checkpoint-every", "4", "--keep-checkpoints", "5", "--no-progress",
            "--num-sample-images", "4", "--sample-steps", "2", "--no-attention"]
    assert main([*args, "--log-to", "jsonl,wandb"]) == 0
    first_id = (run / "wandb_run_id").read_text().strip()
    first = [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert run_loss(wandb_runs(run)[first_id]) == first
    at_4 = next(p for p in (run / "checkpoints").glob("ckpt_*4.pt"))
    assert main([*args, "--log-to", "jsonl,wandb", "--resume", str(at_4), "--lr", "3e-3"]) == 0
    branch_id = (run / "wandb_run_id").read_text().strip()
    assert branch_id != first_id
    branch = [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [s for s, _ in branch] == [2, 4, 6, 8] and branch[:2] == first[:2] and branch[2:] != first[2:]
    runs = wandb_runs(run)
    assert run_loss(runs[branch_id]) == branch  # its whole history, the branch's own steps
    assert run_loss(runs[first_id]) == first  # the first W&B run as it was: the branch it leaves
    notes = [r.run.notes for r in runs[branch_id] if r.WhichOneof("record_type") == "run"]
    assert f"resumed at step 4 from W&B run {first_id}" in notes[0]

    # W&B added on a resume: the W&B run holds the steps logged before it too
    other = tmp_path / "other"
    plain = [a if a != str(run) else str(other) for a in args]
    assert main([*plain[:plain.index("--max-steps") + 1], "4", *plain[plain.index("--max-steps") + 2:]]) == 0
    assert main([*plain, "--log-to", "jsonl,wandb", "--resume", "latest"]) == 0
    (only,) = wandb_runs(other).values()
    assert run_loss(only) == [(r["step"], r["loss"]) for r in read_metrics(other / "metrics.jsonl") if "loss" in r]
