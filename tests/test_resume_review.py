"""Resuming a run with changed settings: what the run's files record afterwards."""

import hashlib

from fastddpm.config import apply_overrides, get_preset
from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint
from fastddpm.trainer.loop import train


def _cfg(source, **train):
    """tiny without attention, a 4-image grid of 2 steps: the model is incidental to a run's bookkeeping."""
    over = {"data.source": str(source), "train.progress": False, "model.attention": False,
            "train.sample_steps": 2, "train.num_sample_images": 4}
    return apply_overrides(get_preset("tiny"), {**over, **{f"train.{k}": v for k, v in train.items()}})


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_resume_that_trains_no_step_keeps_the_checkpoint_and_its_settings(tmp_path, fmnist_npz):
    """`--resume latest --lr 0.02 --batch-size 4` on a run already at its length trains no step: the checkpoint
    stays byte-identical, still recording the lr and batch that trained its weights (it was saved again with the
    resuming command's, so the next resume's note named a change from a value that never trained), and its
    ema.safetensors is unchanged."""
    run = tmp_path / "run"
    train(_cfg(fmnist_npz, max_steps=2, lr=1e-3, batch_size=8), out_dir=run, log=lambda *a, **k: None)
    ckpt = list_checkpoints(run / "checkpoints")[-1]
    before, ema_before = _digest(ckpt), _digest(run / "ema.safetensors")
    lines = []
    result = train(_cfg(fmnist_npz, max_steps=2, lr=2e-2, batch_size=4), out_dir=run, resume="latest",
                   log=lines.append)
    assert result.step == 2 and result.last_loss is None and result.checkpoint == ckpt
    assert "no step trained here" in lines[-1]
    assert _digest(ckpt) == before and _digest(run / "ema.safetensors") == ema_before
    saved = load_checkpoint(ckpt)
    assert saved["config"]["train"]["lr"] == 1e-3 and saved["global_batch"] == 8


def test_a_resume_from_python_names_keywords_not_flags(tmp_path, fmnist_npz):
    """fastddpm.train(..., resume="latest") with a length that ends before the checkpoint, or on other data: the
    refusal names fastddpm.train's keywords (max_steps=1, data=...), not the command line's flags, which the
    Python caller never typed."""
    import numpy as np
    import pytest

    import fastddpm
    from fastddpm.config import ConfigError

    run = tmp_path / "run"
    train(_cfg(fmnist_npz, max_steps=2, batch_size=8), out_dir=run, log=lambda *a, **k: None)
    keywords = dict(out=run, resume="latest", log=None, progress=False, batch_size=8, max_steps=2,
                    attention=False, sample_steps=2, num_sample_images=4)
    with pytest.raises(ConfigError, match=r"^max_steps=1 ends this run at step 1, .*\(the run was to train to step 2, "
                                          r"max_steps=2\)") as e:
        fastddpm.train("tiny", data=str(fmnist_npz), **{**keywords, "max_steps": 1})
    assert "--" not in str(e.value)
    other = tmp_path / "other.npz"
    np.savez(other, images=np.zeros((16, 28, 28), np.uint8), labels=np.zeros(16, np.int64))
    with pytest.raises(ConfigError, match=rf"Resume on its data \(data='{fmnist_npz}'\), or train on this data in a "
                                          r"new out") as e:
        fastddpm.train("tiny", data=str(other), **keywords)
    assert "--" not in str(e.value)
