"""A `--config` file's `train: {device: ...}` that this machine cannot run on is refused naming the file and the key:
the run resolves its device only when it starts, where no file is known, and had named neither."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fastddpm
from fastddpm.cli import main
from fastddpm.config import ConfigError, device_setting, resolve_config


def test_a_device_this_machine_lacks_in_a_config_file_is_refused_naming_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, on any machine
    data = tmp_path / "d.npz"
    np.savez(data, images=np.zeros((8, 1, 8, 8), np.uint8))
    gpu, cuda = tmp_path / "gpu.yaml", tmp_path / "cuda.json"
    gpu.write_text("train:\n  device: gpu\n")
    cuda.write_text(json.dumps({"train": {"device": "cuda"}}))
    argv = ["train", "--preset", "tiny", "--data", str(data), "--max-steps", "1", "--no-progress"]
    assert main([*argv, "--config", str(gpu), "--out", str(tmp_path / "a")]) == 2
    assert f"error: config file {gpu}: train.device='gpu' is not a device: use auto, cpu, cuda or cuda:N" in \
        capsys.readouterr().err
    assert main([*argv, "--config", str(cuda), "--out", str(tmp_path / "a")]) == 2
    assert f"error: config file {cuda}: train.device='cuda', but CUDA is not available here: use cpu or auto" in \
        capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match=rf"^config file {gpu}: train.device='gpu' is not a device"):
        fastddpm.train(str(gpu), out=tmp_path / "b", data=str(data), log=None)
    # a flag, --set or keyword over the file's device is what the run uses: named as the field, not by the file
    assert device_setting(resolve_config("tiny", file=gpu, layers=[("command line", {"train.device": "cpu"})]),
                          gpu) == "train.device"
    assert device_setting(resolve_config("tiny", file=gpu), gpu) == f"config file {gpu}: train.device"
    assert device_setting(resolve_config("tiny"), None) == "train.device"


def test_doctor_train_names_the_config_file_of_a_device_this_machine_lacks(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = tmp_path / "d.npz"
    np.savez(data, images=np.zeros((8, 1, 8, 8), np.uint8))
    cuda = tmp_path / "cuda.yaml"
    cuda.write_text("train:\n  device: cuda\n")
    assert main(["doctor", "train", "--preset", "tiny", "--data", str(data), "--config", str(cuda),
                 "--report-dir", str(tmp_path / "rep")]) == 2
    assert f"config file {cuda}: train.device='cuda', but CUDA is not available here: use cpu or auto" in \
        capsys.readouterr().err
    assert not (tmp_path / "rep").exists()
