"""A reader that leaves (`fastddpm train ... | head -8`, `fastddpm --help | head -1`): the command ends as `cat`
does, exit 141 with no traceback and nothing more written, and a training run first finishes its step and writes
its checkpoint, as on SIGTERM (fastddpm.pipes)."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from fastddpm.cli import main
from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint
from fastddpm.rundir.metrics import read_metrics

PIPE_BYTES = 4096  # the smallest pipe Linux makes (F_SETPIPE_SZ): what is written past it waits for the reader
TRAIN = ["train", "--preset", "tiny", "--max-steps", "40", "--log-every", "1", "--checkpoint-every", "100000",
         "--compile", "off", "--no-progress"]  # a few seconds; a run that missed the reader's leaving ends at 40


def read_then_leave(args: list[str], other: Path, *, lines: int, stream: str = "stdout") -> tuple[int, str]:
    """Run `fastddpm ARGS` with `stream` a pipe of PIPE_BYTES and the other stream into the file `other`; read
    `lines` lines from the pipe (0: its reader is gone before the command starts), close it, and return the exit
    code and what was read. Python block-buffers a pipe unless PYTHONUNBUFFERED is set: not set here, as a
    user's shell has it."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open(other, "w") as other_file:
        files = {"stdout": write, "stderr": other_file} if stream == "stdout" else {"stdout": other_file,
                                                                                    "stderr": write}
        proc = subprocess.Popen([sys.executable, "-m", "fastddpm", *args], env=env, **files)
    os.close(write)
    got, deadline = b"", time.monotonic() + 120
    try:
        while got.count(b"\n") < lines and time.monotonic() < deadline:
            if select.select([read], [], [], 1.0)[0]:
                chunk = os.read(read, 256)  # a little at a time: the command has more to write when we leave
                if not chunk:
                    break
                got += chunk
    finally:
        os.close(read)
    try:
        return proc.wait(timeout=120), got.decode()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"fastddpm {' '.join(args)} went on after its reader had left") from None


def assert_quiet(text: str) -> None:
    assert "Traceback" not in text and "Exception ignored" not in text and "BrokenPipeError" not in text, text


def test_a_run_whose_reader_leaves_stops_at_the_step_with_a_checkpoint_and_resumes(tmp_path, fmnist_npz, capsys):
    """`fastddpm train ... | head -2`: the run had gone on with nobody reading (its last lines wait in an 8 KiB
    buffer), then ended in a BrokenPipeError traceback, without a checkpoint. Now it stops at the end of the step
    in which head left, writes its checkpoint, exits 141; `--resume latest` goes on from it; the lines head read
    are the log's first lines, as written."""
    run = tmp_path / "run"
    code, head = read_then_leave([*TRAIN, "--data", str(fmnist_npz), "--out", str(run)], tmp_path / "err",
                                 lines=2)
    err = (tmp_path / "err").read_text()
    assert code == 141, err
    assert_quiet(err)
    assert head.startswith("model: U-Net") and "stopped by" not in err, (head, err)
    (ckpt,) = list_checkpoints(run / "checkpoints")
    step = load_checkpoint(ckpt)["step"]
    assert 1 <= step < 40 and read_metrics(run / "metrics.jsonl")[-1]["step"] == step
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "latest", "--max-steps", str(step + 1), "--no-progress",
                 "--num-sample-images", "4", "--sample-steps", "2"]) == 0  # the checkpoint's config, a small grid
    assert f"resumed from {ckpt} at step {step:,}" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")][-2:] == [step, step + 1]

    # `fastddpm sample ... | head -1` with head gone before the line: its files are written, the exit is quiet
    code, _ = read_then_leave(["sample", "--checkpoint", str(run), "--num-images", "4", "--steps", "2", "--out",
                               str(tmp_path / "samples")], tmp_path / "err", lines=0)
    err = (tmp_path / "err").read_text()
    assert code == 141, err
    assert_quiet(err)
    assert len(list((tmp_path / "samples").glob("*.npz"))) == 1


def test_a_run_whose_stderr_reader_leaves_stops_with_a_checkpoint(tmp_path, fmnist_npz):
    """`fastddpm train ... 2>&1 >run.log | grep -m1 step`: the reader of stderr (the progress lines) left. The
    run stops as for stdout, and says so in the log that is still read."""
    run = tmp_path / "run"
    code, _ = read_then_leave([*TRAIN, "--data", str(fmnist_npz), "--out", str(run)], tmp_path / "out", lines=0,
                              stream="stderr")
    out = (tmp_path / "out").read_text()
    assert code == 141, out
    assert_quiet(out)
    (ckpt,) = list_checkpoints(run / "checkpoints")
    step = load_checkpoint(ckpt)["step"]
    assert 1 <= step < 40
    assert (f"stopped by the closed pipe its output went to at step {step:,}; checkpoint {ckpt}; resume with "
            "--resume latest") in out


def test_help_and_other_output_into_a_closed_pipe_end_quietly_with_141(tmp_path):
    """`fastddpm --help | head -0` and `fastddpm train --print-config | head -0`, head gone before the output: it
    waited in the buffer for the interpreter's flush at exit, which failed ("Exception ignored ... BrokenPipeError",
    exit 120). Now they end with 141 and say nothing."""
    for args in (["--help"], ["train", "--preset", "tiny", "--print-config"]):
        code, _ = read_then_leave(args, tmp_path / "err", lines=0)
        assert code == 141 and (tmp_path / "err").read_text() == "", (args, (tmp_path / "err").read_text())


def test_a_reader_that_leaves_while_the_dataset_is_prepared_stops_the_run_there(tmp_path):
    """The reader of stderr (the preparation's progress lines) gone in the set-up that stops at once on SIGTERM:
    the run stops there, exit 141, nothing trained or saved (the print into the closed pipe had ended it in a
    traceback)."""
    import numpy as np

    data, run = tmp_path / "new.npz", tmp_path / "run"  # a source no other test prepared: its preparation runs
    np.savez(data, images=np.random.default_rng(0).integers(0, 256, (64, 28, 28), dtype=np.uint8))
    train = [a if a != "--no-progress" else "--progress" for a in TRAIN]
    code, _ = read_then_leave([*train, "--data", str(data), "--out", str(run)], tmp_path / "out", lines=0,
                              stream="stderr")
    out = (tmp_path / "out").read_text()
    assert code == 141, out
    assert_quiet(out)
    assert ("stopped by the closed pipe its output went to while preparing the dataset, before the first step: "
            "nothing was trained or saved") in out
    assert not (run / "checkpoints").exists()


def test_doctor_train_into_a_closed_pipe_ends_quietly_with_141(tmp_path, fmnist_npz):
    """`fastddpm doctor train ... | head`: the trainer inside the doctor stops when the reader leaves, and the
    doctor does not catch the trainer's stop: it reached the command line as a TrainingInterrupted traceback. Its
    stop is a BrokenPipeError too (trainer.loop.ReaderLeft), so the command ends as any other does."""
    code, _ = read_then_leave(["doctor", "train", "--preset", "tiny", "--data", str(fmnist_npz), "--compile", "off",
                               "--max-seconds", "10", "--report-dir", str(tmp_path / "doctor")], tmp_path / "err",
                              lines=0)
    err = (tmp_path / "err").read_text()
    assert code == 141, err
    assert_quiet(err)
