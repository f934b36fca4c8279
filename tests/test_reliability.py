"""Faults the trainer must survive without losing anything (see RELIABILITY.md in the shared docs)."""

import copy
import os
import pytest
import torch

from fastddpm.cli import main
from fastddpm.config import get_preset
from fastddpm.device import resolve_precision
from fastddpm.diffusion import make_schedule
from fastddpm.models import UNet
from fastddpm.trainer import batches as batches_mod
from fastddpm.trainer.batches import Batch, ResidentBatches
from fastddpm.trainer.ema import EMA
from fastddpm.trainer.step import TrainStep, make_optimizer

CPU = torch.device("cpu")


def _poisoned(batch: Batch) -> Batch:
    noise = batch.noise.clone()
    noise[0, 0, 0, 0] = float("nan")
    return Batch(x0=batch.x0, t=batch.t, noise=noise, indices=batch.indices)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-cpu-path", "fused-device-path"])
def test_non_finite_loss_skips_the_update_and_keeps_the_last_finite_weights(fused):
    from conftest import read_fmnist

    images = read_fmnist(64)[0]
    cfg = get_preset("tiny").model
    cfg.image_channels, cfg.image_size = 1, 28
    cfg.attention = False  # at 28x28 most of a CPU step; what is followed is the optimizer's and the EMA's update
    torch.manual_seed(0)
    model = UNet(cfg)
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=fused,
                         capturable=False)
    assert bool(opt.param_groups[0].get("fused")) == fused
    ema = EMA(model, 0.99)
    step = TrainStep(model=model, optimizer=opt, scaler=None, ema=ema, schedule=make_schedule("linear", 1000),
                     prediction="epsilon", precision=resolve_precision("fp32", CPU), grad_clip=1.0, device=CPU)
    source = ResidentBatches(images, batch_size=16, num_timesteps=1000, seed=0, device=CPU)
    for s in range(3):
        step([source.get(s)], lr=1e-3, step=s)
    assert step.first_bad_step() is None
    params = copy.deepcopy(model.state_dict())
    ema_params = copy.deepcopy(ema.state_dict())
    opt_steps = [st["step"].clone() for st in opt.state.values()]

    loss = step([_poisoned(source.get(3))], lr=1e-3, step=3)
    assert not torch.isfinite(loss)
    step([source.get(4)], lr=1e-3, step=4)  # finite again, but the run is already marked: still skipped
    assert step.first_bad_step() == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    for k, v in ema.state_dict().items():
        assert torch.equal(v, ema_params[k]), k
    assert all(torch.equal(st["step"], s0) for st, s0 in zip(opt.state.values(), opt_steps))


def test_run_with_a_nan_stops_naming_the_step(tmp_path, fmnist_npz, monkeypatch, capsys):
    real_get = ResidentBatches.get

    def get(self, m):
        batch = real_get(self, m)
        return _poisoned(batch) if m == 5 else batch

    monkeypatch.setattr(batches_mod.ResidentBatches, "get", get)
    run = tmp_path / "run"
    code = main(["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", "--max-steps", "20",
                 "--log-every", "10", "--checkpoint-every", "4", "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert "NaN/Inf at step 6" in err and "keep their values from step 5" in err and "ckpt_000000004.pt" in err
    # stopped at once on the CPU: before its first logging step, with the step-4 checkpoint intact
    assert not (run / "metrics.jsonl").exists()
    from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint

    (ckpt,) = list_checkpoints(run / "checkpoints")
    state = load_checkpoint(ckpt)
    assert state["step"] == 4 and all(torch.isfinite(v).all() for v in state["model"].values())


def _state(step):
    return {"model": {"w": torch.full((4,), float(step))}, "step": step}


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Disk full (ENOSPC) in the middle of writing checkpoint 2: checkpoint 1 stays byte-identical and loadable,
    and nothing partial is left at a final path or as a temp file."""
    import errno
    import os

    from fastddpm.rundir import checkpoint as ckpt_mod

    d = tmp_path / "checkpoints"
    first = ckpt_mod.save_checkpoint(d, 1, _state(1), keep=3)
    before = first.read_bytes()
    real_fsync = os.fsync
    calls = []

    def full_disk(fd):
        calls.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ckpt_mod.save_checkpoint(d, 2, _state(2), keep=3)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert calls, "the injected fault never fired"
    assert first.read_bytes() == before
    assert ckpt_mod.load_checkpoint(first)["step"] == 1
    assert sorted(p.name for p in d.iterdir()) == ["ckpt_000000001.pt", "ckpt_000000001.sha256"]
    path, state = ckpt_mod.load_latest(d)
    assert path == first and state["step"] == 1


def test_retention_survives_a_failed_delete(tmp_path, monkeypatch):
    from pathlib import Path

    from fastddpm.rundir import checkpoint as ckpt_mod

    d = tmp_path / "checkpoints"
    for s in (1, 2):
        ckpt_mod.save_checkpoint(d, s, _state(s), keep=2)
    real_unlink = Path.unlink

    def stuck(self, missing_ok=False):
        if self.name.startswith("ckpt_000000001"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", stuck)
    with pytest.warns(UserWarning, match="could not delete old checkpoint .*ckpt_000000001"):
        ckpt_mod.save_checkpoint(d, 3, _state(3), keep=2)
    names = [p.name for p in ckpt_mod.list_checkpoints(d)]
    assert "ckpt_000000003.pt" in names and "ckpt_000000002.pt" in names  # the newest k are always kept
    assert ckpt_mod.load_latest(d)[1]["step"] == 3


def test_sigint_checkpoints_and_exits_130(tmp_path, fmnist_npz):
    import signal

    from conftest import interrupt_training
    from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint

    run = tmp_path / "run"
    returncode, _, err = interrupt_training(fmnist_npz, run, signal.SIGINT, after_log_lines=2)
    assert returncode == 130, err
    # said when the signal comes (the set-up before a first step can take minutes), once
    assert err.count("SIGINT: the run stops after its current step, with a checkpoint (Ctrl-C again to stop at "
                     "once, without one)") == 1, err
    (ckpt,) = list_checkpoints(run / "checkpoints")
    assert load_checkpoint(ckpt)["step"] >= 2


def test_a_signal_while_the_feature_network_trains_stops_the_run_there(tmp_path, fmnist_npz):
    """--eval-every trains the dataset's feature network before the first step (about a minute on all of
    Fashion-MNIST's 60,000 images): a Ctrl-C then stops the run there, not after the network and a first step."""
    import signal
    import subprocess
    import sys

    run, cache = tmp_path / "run", tmp_path / "cache"  # an empty cache: the network is trained here
    env = {**os.environ, "FASTDDPM_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fastddpm", "train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny",
           "--max-steps", "1000", "--eval-every", "512", "--eval-samples", "16", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    said = []
    try:
        for line in proc.stdout:  # until the network begins to train
            said.append(line)
            if line.startswith("feature network: none cached"):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a run that went on is not left behind (no-op once it has exited)
    said.append(out)
    assert proc.returncode == 130, "".join(said) + err
    assert ("stopped by signal while setting up --eval-every (its feature network, the real images' statistics), "
            "before the first step: nothing was trained or saved") in out, out
    assert "Traceback" not in err and "the run stops after its current step" not in err, err
    # stopped inside the network's training: no network cached, no step taken, and the run folder this run
    # created is gone again, as it was
    assert not list(cache.rglob("*.safetensors")) and not run.exists()


def test_sigkill_during_a_save_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """A process killed (SIGKILL) while writing checkpoint 2: on restart checkpoint 1 loads, and the
    incomplete file is reported by name and removed."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    from fastddpm.rundir.checkpoint import list_checkpoints, load_latest

    d = tmp_path / "checkpoints"
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        from pathlib import Path
        from fastddpm.rundir import checkpoint as c, files
        d = Path({str(d)!r})
        c.save_checkpoint(d, 1, {{"model": {{"w": torch.ones(4)}}, "step": 1}}, keep=3)
        real_write = os.write
        def slow_write(fd, data):  # half the bytes, then hang until killed
            real_write(fd, data[: len(data) // 2])
            print("writing", flush=True)
            time.sleep(60)
        import builtins
        real_open = builtins.open
        class Slow:
            def __init__(self, f): self.f = f
            def write(self, data): return slow_write(self.f.fileno(), data)
            def __getattr__(self, k): return getattr(self.f, k)
            def __enter__(self): return self
            def __exit__(self, *a): self.f.close()
        def patched_open(path, mode="r", *a, **k):
            f = real_open(path, mode, *a, **k)
            return Slow(f) if "ckpt_000000002.pt.tmp" in str(path) else f
        files.open = patched_open  # the module that writes checkpoint bytes
        c.save_checkpoint(d, 2, {{"model": {{"w": torch.zeros(4)}}, "step": 2}}, keep=3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    line = ""
    while time.time() < deadline and "writing" not in line:
        line = proc.stdout.readline()
        if proc.poll() is not None:
            break
    assert "writing" in line, proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    leftovers = list(d.glob(".ckpt_000000002.pt.tmp.*"))
    assert leftovers, "the kill should have left a partial temp file"
    assert [p.name for p in list_checkpoints(d)] == ["ckpt_000000001.pt"]
    path, state = load_latest(d)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(4))
    # a reader leaves temp files alone (one could be a save in flight in a run still training)...
    assert list(d.glob(".ckpt_*.tmp.*")) == leftovers
    # ...and the writer's next save removes the killed one's
    from fastddpm.rundir.checkpoint import save_checkpoint

    with pytest.warns(UserWarning, match=r"removing .*ckpt_000000002\.pt\.tmp.*interrupted save"):
        save_checkpoint(d, 3, {"model": {"w": torch.zeros(4)}, "step": 3}, keep=3)
    assert not list(d.glob(".ckpt_*.tmp.*")) and load_latest(d)[1]["step"] == 3


def _recording(monkeypatch):
    """Record what every batch draw consumed: (m, indices, t, noise) - whichever loader made it."""
    from fastddpm.trainer.batches import StreamingBatches

    seen = []
    for cls in (ResidentBatches, StreamingBatches):
        real = cls.get

        def get(self, m, _real=real):
            b = _real(self, m)
            seen.append((m, b.indices.cpu().clone(), b.t.clone(), b.noise.clone()))
            return b

        monkeypatch.setattr(cls, "get", get)
    return seen


def _same_draws(a, b):
    assert [m for m, *_ in a] == [m for m, *_ in b]
    for (_, ia, ta, na), (_, ib, tb, nb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(ta, tb) and torch.equal(na, nb)


def _no_replay_cfg(src, resume_at):
    from fastddpm.config import apply_overrides

    # without attention, at 28x28 most of a CPU step: what is compared is the batches drawn, not what is learnt
    return apply_overrides(get_preset("tiny"), {"data.source": str(src), "train.progress": False,
                                                "train.max_steps": 20, "train.checkpoint_every": resume_at,
                                                "train.num_sample_images": 1, "train.sample_steps": 1,
                                                "model.attention": False})


@pytest.fixture(scope="session")
def uninterrupted_draws(fmnist_npz, tmp_path_factory):
    """The batch draws of the 20-step run that is never stopped, recorded once for every resume point below (it
    was run again for each). It writes no checkpoint before its end, so a checkpoint that consumed a draw would
    fail the comparison too."""
    from fastddpm.trainer.loop import train

    with pytest.MonkeyPatch.context() as mp:
        seen = _recording(mp)
        train(_no_replay_cfg(fmnist_npz, None), out_dir=tmp_path_factory.mktemp("no-replay") / "full",
              log=lambda *a: None)
    assert [m for m, *_ in seen] == list(range(20))
    return seen


@pytest.mark.parametrize("resume_at", [1, 7, 16], ids=["after-step-1", "mid-epoch", "epoch-boundary"])
def test_no_replay_no_skip_across_a_resume(tmp_path, fmnist_npz, monkeypatch, resume_at, uninterrupted_draws):
    """256 images at batch 16 = 16 steps per epoch; 20 steps cross the boundary."""
    from fastddpm.config import apply_overrides
    from fastddpm.trainer.loop import train

    cfg = _no_replay_cfg(fmnist_npz, resume_at)
    seen = _recording(monkeypatch)
    train(apply_overrides(cfg, {"train.max_steps": resume_at}), out_dir=tmp_path / "split", log=lambda *a: None)
    train(cfg, out_dir=tmp_path / "split", resume="latest", log=lambda *a: None)
    _same_draws(uninterrupted_draws, seen)
    assert [m for m, *_ in seen] == list(range(20))


def test_resume_does_not_depend_on_the_loader(tmp_path, fmnist_npz, monkeypatch):
    """Save with the streaming loader (memory-mapped cache), resume with the resident one: the same batches
    and bit-identical weights as a run that never changed loaders."""
    from fastddpm.config import apply_overrides
    from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint
    from fastddpm.trainer.loop import train

    base = {"data.source": str(fmnist_npz), "train.progress": False, "train.max_steps": 10,
            "train.checkpoint_every": 5, "train.num_sample_images": 1, "train.sample_steps": 1,
            "model.attention": False}  # at 28x28 most of a CPU step, and the same weights need no attention
    resident = apply_overrides(get_preset("tiny"), {**base, "train.data_placement": "device"})
    streaming = apply_overrides(get_preset("tiny"), {**base, "train.data_placement": "stream",
                                                     "train.max_steps": 5})
    seen = _recording(monkeypatch)
    train(resident, out_dir=tmp_path / "a", log=lambda *a: None)
    full = list(seen)
    seen.clear()
    train(streaming, out_dir=tmp_path / "b", log=lambda *a: None)
    train(resident, out_dir=tmp_path / "b", resume="latest", log=lambda *a: None)
    _same_draws(full, seen)
    a = load_checkpoint(list_checkpoints(tmp_path / "a" / "checkpoints")[-1])
    b = load_checkpoint(list_checkpoints(tmp_path / "b" / "checkpoints")[-1])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])


# ------------------------------------------------------------------ promise 10: out of memory in training
def _oom_above(monkeypatch, limit: int):
    """Simulated device memory: a step whose micro-batches hold more than `limit` images runs out of memory."""
    real = TrainStep.__call__
    calls = {"oom": 0}

    def call(self, batches, **kw):
        if batches[0].x0.shape[0] > limit:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(self, batches, **kw)

    monkeypatch.setattr(TrainStep, "__call__", call)
    return calls


def _tiny_args(src, out, *extra):
    # without attention (at 28x28 most of a CPU step) and with a final grid of 4 images in 2 sampler steps (the
    # preset's: 16 in 10): what is followed is the micro-batches of the training step
    return ["train", "--preset", "tiny", "--data", str(src), "--out", str(out), "--device", "cpu", "--no-progress",
            "--batch-size", "16", "--checkpoint-every", "2", "--no-attention", "--num-sample-images", "4",
            "--sample-steps", "2", *extra]


def test_oom_in_training_halves_the_micro_batch_and_keeps_the_global_batch(tmp_path, fmnist_npz, monkeypatch,
                                                                           capsys):
    import json

    from fastddpm.rundir.checkpoint import load_latest

    assert main(_tiny_args(fmnist_npz, tmp_path / "plain", "--max-steps", "4")) == 0
    calls = _oom_above(monkeypatch, 8)  # 16 fails, 8 fits: one back-off
    assert main(_tiny_args(fmnist_npz, tmp_path / "oom", "--max-steps", "4")) == 0
    out = capsys.readouterr().out
    assert calls["oom"] == 1 and "out of memory at step 1 with micro-batches of 16" in out
    assert "2 micro-batches of 8" in out
    _, plain = load_latest(tmp_path / "plain" / "checkpoints")
    _, oom = load_latest(tmp_path / "oom" / "checkpoints")
    assert oom["micro_split"] == 2 and oom["images_seen"] == plain["images_seen"] == 64
    for k, v in plain["model"].items():  # the same images, timesteps and noise: the same training
        torch.testing.assert_close(oom["model"][k], v, rtol=1e-4, atol=5e-5, msg=k)
    assert json.loads((tmp_path / "oom" / "run.json").read_text())["micro_split"] == 2
    # a resumed run keeps the split (it does not run out of memory again at the old size)
    assert main(_tiny_args(fmnist_npz, tmp_path / "oom", "--max-steps", "6", "--resume", "latest")) == 0
    assert calls["oom"] == 1
    _, resumed = load_latest(tmp_path / "oom" / "checkpoints")
    assert resumed["step"] == 6 and resumed["micro_split"] == 2


def test_oom_at_the_minimum_stops_with_a_clear_message(tmp_path, fmnist_npz, monkeypatch, capsys):
    _oom_above(monkeypatch, 0)  # nothing fits
    code = main(_tiny_args(fmnist_npz, tmp_path / "x", "--max-steps", "2", "--batch-size", "4"))
    assert code == 2
    err = capsys.readouterr().err
    assert "even with micro-batches of 1 image" in err and "--grad-checkpointing" in err


# -- promise 9: fp16 loss scaling across a resume -----------------------------------------------------------------
# torch's CPU autocast has fp16 kernels and GradScaler("cpu") exists, so the trainer's fp16 path runs here.

class _Overflowing:
    """The trainer's batches, with the images of the given steps scaled by 1e6: past fp16's 65,504, so the first
    half-precision convolution overflows and every gradient is non-finite (a real fp16 overflow, forced)."""

    def __init__(self, inner, steps):
        self.inner, self.steps = inner, steps

    def get(self, m: int) -> Batch:
        b = self.inner.get(m)
        return Batch(x0=b.x0 * 1e6, t=b.t, noise=b.noise, indices=b.indices) if self.steps(m) else b

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _fp16_cfg(src, **train):
    from fastddpm.config import apply_overrides

    # batch 4 and no attention (at 28x28 most of the tiny U-Net's CPU step): fp16 matmuls are emulated on most
    # CPUs (slow), and the loss-scaling logic is the same at any batch and for any model; for the same reason a
    # run's final grid is 4 images in 2 sampler steps (the preset's: 16 in 10), which no test here looks at
    over = {"data.source": str(src), "train.progress": False, "train.device": "cpu", "train.precision": "fp16",
            "train.log_every": 1, "train.batch_size": 4, "model.attention": False, "train.num_sample_images": 4,
            "train.sample_steps": 2, **{f"train.{k}": v for k, v in train.items()}}
    return apply_overrides(get_preset("tiny"), over)


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_survives_a_resume(tmp_path, fmnist_npz):
    import math
    import os
    import subprocess
    import sys

    from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint
    from fastddpm.rundir.metrics import read_metrics
    from fastddpm.trainer.loop import TrainHooks, train

    overflow_third_step = TrainHooks(wrap_batches=lambda b: _Overflowing(b, lambda m: m == 2))
    full = tmp_path / "full"
    train(_fp16_cfg(fmnist_npz, max_steps=8, checkpoint_every=1, keep_checkpoints=100), out_dir=full,
          log=lambda *a, **k: None, hooks=overflow_third_step)
    ckpts = {int(p.stem.split("_")[1]): load_checkpoint(p) for p in list_checkpoints(full / "checkpoints")}
    assert sorted(ckpts) == list(range(1, 9))
    metrics = read_metrics(full / "metrics.jsonl")
    # Step 3 overflowed: its loss is not finite, the update was skipped (weights as after step 2), the scale
    # halved and the growth tracker restarted; the steps around it trained normally.
    assert [math.isfinite(m["loss"]) for m in metrics] == [True, True, False] + [True] * 5
    assert [m["loss_scale"] for m in metrics] == [2.0 ** 16] * 2 + [2.0 ** 15] * 6
    assert all(torch.equal(v, ckpts[2]["model"][k]) for k, v in ckpts[3]["model"].items())
    assert not all(torch.equal(v, ckpts[3]["model"][k]) for k, v in ckpts[4]["model"].items())
    assert [ckpts[s]["scaler"]["_growth_tracker"] for s in (2, 3, 4, 8)] == [2, 0, 1, 5]

    # The same run stopped after step 4 and resumed in a new process: the scale and growth tracker carry over,
    # so steps 5-8 and the final state equal the uninterrupted run (a reset tracker would end at 4, not 5).
    half = tmp_path / "half"
    train(_fp16_cfg(fmnist_npz, max_steps=4, checkpoint_every=4), out_dir=half, log=lambda *a, **k: None,
          hooks=overflow_third_step)
    r = subprocess.run([sys.executable, "-m", "fastddpm", "train", "--out", str(half), "--resume", "latest",
                        "--max-steps", "8"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONHASHSEED": "123"})
    assert r.returncode == 0, r.stderr
    resumed = read_metrics(half / "metrics.jsonl")
    assert [(m["loss"], m["loss_scale"]) for m in resumed[4:]] == [(m["loss"], m["loss_scale"]) for m in metrics[4:]]
    end = load_checkpoint(list_checkpoints(half / "checkpoints")[-1])
    assert end["step"] == 8 and end["scaler"] == ckpts[8]["scaler"]
    for k, v in ckpts[8]["model"].items():
        assert torch.equal(end["model"][k], v), k
        assert torch.equal(end["ema"][k], ckpts[8]["ema"][k]), k


def test_fp16_scale_collapse_stops_the_run_naming_the_step(tmp_path, fmnist_npz):
    """Non-finite gradients at every scale (a diverged run) would otherwise be skipped silently forever: the scale
    halves each step from 2**16 and the run stops when it falls below 1, after the 17th skipped step."""
    from fastddpm.trainer.loop import TrainHooks, train

    always_from_step_3 = TrainHooks(wrap_batches=lambda b: _Overflowing(b, lambda m: m >= 2))
    with pytest.raises(FloatingPointError, match=r"fp16 loss scale fell to 0\.5 by step 19") as e:
        train(_fp16_cfg(fmnist_npz, max_steps=40, log_every=10, checkpoint_every=10), out_dir=tmp_path / "run",
              log=lambda *a, **k: None, hooks=always_from_step_3)
    assert "ckpt_000000010.pt" in str(e.value) and "--precision bf16" in str(e.value)
