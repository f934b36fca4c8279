"""Soak: a tiny model trained for hundreds of steps with periodic checkpoints, killed by SIGTERM at random moments
and resumed each time, ends with exactly the parameters of the uninterrupted run.

Behind the `soak` marker (deselected by default, about a minute on 2 cores); CI runs it:
    bash scripts/test.sh -m soak
"""

import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint
from fastddpm.rundir.metrics import read_metrics

STEPS = 300


def _cmd(src, out):
    return [sys.executable, "-m", "fastddpm", "train", "--data", str(src), "--out", str(out), "--preset", "tiny",
            "--max-steps", str(STEPS), "--log-every", "5", "--checkpoint-every", "20", "--keep-checkpoints", "2",
            "--num-sample-images", "1", "--sample-steps", "1", "--no-progress", "--resume", "latest"]


@pytest.mark.soak
def test_random_sigterms_and_resumes_end_where_the_uninterrupted_run_ends(tmp_path, fmnist_npz):
    full = tmp_path / "full"
    r = subprocess.run(_cmd(fmnist_npz, full), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr

    soak = tmp_path / "soak"
    rng = random.Random(20261121)
    interruptions = 0
    for _ in range(100):  # bounded: each round either finishes the run or is interrupted once
        metrics = soak / "metrics.jsonl"
        lines_before = len(read_metrics(metrics)) if metrics.exists() else 0
        proc = subprocess.Popen(_cmd(fmnist_npz, soak), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and (
                not metrics.exists() or len(read_metrics(metrics)) <= lines_before):
            time.sleep(0.05)  # wait until this process is training (a kill during start-up loses nothing)
        time.sleep(rng.uniform(0.2, 2.0))  # then a random moment mid-step
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            interruptions += 1
        _, err = proc.communicate(timeout=120)
        if proc.returncode == -signal.SIGTERM:
            # The signal landed after train() returned, while the interpreter was shutting down: Python's default
            # handler is back by then. Only a run that had already finished may end this way.
            assert read_metrics(metrics)[-1]["step"] == STEPS, err
            break
        assert proc.returncode in (0, 143), err
        if proc.returncode == 0:
            break
    assert interruptions >= 3, "the soak should interrupt the run several times"
    assert read_metrics(soak / "metrics.jsonl")[-1]["step"] == STEPS

    a = load_checkpoint(list_checkpoints(full / "checkpoints")[-1])
    b = load_checkpoint(list_checkpoints(soak / "checkpoints")[-1])
    assert a["step"] == b["step"] == STEPS
    for part in ("model", "ema"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    for i, sa in a["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key], b["optimizer"]["state"][i][key])
