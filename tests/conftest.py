"""Shared fixtures: a private dataset cache per test session, and real Fashion-MNIST slices."""

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

# Debian's dataset-fashion-mnist; FASTDDPM_FMNIST_DIR points elsewhere (e.g. a copy carried to a GPU machine).
FMNIST_DIR = Path(os.environ.get("FASTDDPM_FMNIST_DIR", "/usr/share/datasets/fashion-mnist"))


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Never touch the user's ~/.cache/fastddpm from tests."""
    old = os.environ.get("FASTDDPM_CACHE")
    os.environ["FASTDDPM_CACHE"] = str(tmp_path_factory.mktemp("fastddpm-cache"))
    yield
    if old is None:
        os.environ.pop("FASTDDPM_CACHE", None)
    else:
        os.environ["FASTDDPM_CACHE"] = old


def read_fmnist(n: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The first n real Fashion-MNIST images (N, 1, 28, 28) uint8 and labels, straight from the IDX files."""
    prefix = "train" if split == "train" else "t10k"
    images_path = FMNIST_DIR / f"{prefix}-images-idx3-ubyte.gz"
    if not images_path.is_file():
        pytest.skip("Fashion-MNIST files are missing: run `apt-get install dataset-fashion-mnist`")
    with gzip.open(images_path) as f:
        images = np.frombuffer(f.read(16 + n * 784), np.uint8, offset=16).reshape(n, 1, 28, 28)
    with gzip.open(FMNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(8 + n), np.uint8, offset=8).astype(np.int64)
    return images.copy(), labels


@pytest.fixture(scope="session")
def fmnist_npz(tmp_path_factory) -> Path:
    """256 real Fashion-MNIST training images as an .npz source."""
    images, labels = read_fmnist(256)
    path = tmp_path_factory.mktemp("fmnist") / "fmnist256.npz"
    np.savez(path, images=images, labels=labels)
    return path


def interrupt_training(src: Path, run: Path, sig: int, *, after_log_lines: int):
    """Start `fastddpm train` (tiny, endless) in a new process, send `sig` once it has logged
    `after_log_lines` steps, and return (returncode, stdout, stderr)."""
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "fastddpm", "train", "--data", str(src), "--out", str(run), "--preset",
           "tiny", "--max-steps", "100000", "--log-every", "1", "--checkpoint-every", "100000", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < after_log_lines):
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err
