"""Shared data for the fastddpm.eval tests (imported by tests/test_eval_*.py): a real Fashion-MNIST slice with
a train and a test split, written once per test session at a fixed path, so every test module that uses it
shares one prepared cache, one trained feature network and one set of reference statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

N_TRAIN, N_TEST = 2000, 500


@pytest.fixture(scope="session")
def fmnist_splits(tmp_path_factory) -> Path:
    """x_train/y_train (2,000 real Fashion-MNIST training images) and x_test/y_test (500 test images)."""
    from conftest import read_fmnist

    path = tmp_path_factory.getbasetemp() / "eval-data" / "fmnist-splits.npz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        x_train, y_train = read_fmnist(N_TRAIN, "train")
        x_test, y_test = read_fmnist(N_TEST, "test")
        np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path
