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
