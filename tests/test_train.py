"""The trainer end to end on real Fashion-MNIST slices: it learns, it resumes exactly, it writes what it says."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.device import cuda_native_bf16, resolve_precision
from fastddpm.rundir.checkpoint import list_checkpoints, load_checkpoint, load_latest
from fastddpm.rundir.files import CheckpointError, load_safetensors
from fastddpm.rundir.metrics import read_metrics
from fastddpm.rundir.state_dicts import clean_state_dict
from fastddpm.trainer.loop import train

from conftest import ONE_BLOCK_SEED, flags


def tiny_cfg(source, **train_overrides):
    over = {"data.source": str(source), "train.progress": False}
    over.update({f"train.{k}": v for k, v in train_overrides.items()})
    return apply_overrides(get_preset("tiny"), over)


def quiet(*args, **kwargs):
    pass


# a cheap final grid: for tests about a run's counts, files and resumes, not its samples
QUICK = dict(sample_steps=2, num_sample_images=4)


def plain_cfg(source, **train_overrides):
    """tiny_cfg with QUICK's grid and without attention (at 28x28, over 784 positions, most of a CPU step's and a
    sampler step's time): for the tests of a run's bookkeeping, whose model is incidental."""
    return apply_overrides(tiny_cfg(source, **{**QUICK, **train_overrides}), {"model.attention": False})


def test_tiny_model_overfits_a_handful_of_real_images(tmp_path, fmnist_npz):
    """8 real Fashion-MNIST images at batch 8: the mean loss of the last 25 steps is at most a third of the first 25.
    Without attention, which at 28x28 is 70% of this U-Net's CPU step (37 s against 11 s for the 300 steps) and
    is tested on its own (tests/test_sdpa_shapes.py, the golden losses, every other tiny run): the ratio of the
    two means was 4.6 with it and 4.8 without."""
    from conftest import read_fmnist

    images, labels = read_fmnist(8)
    src = tmp_path / "eight.npz"
    np.savez(src, images=images, labels=labels)
    cfg = tiny_cfg(src, batch_size=8, max_steps=300, lr=3e-3, log_every=1, checkpoint_every=None,
                   sample_steps=5, num_sample_images=4)
    cfg = apply_overrides(cfg, {"model.attention": False})
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 300
    first, last = np.mean(losses[:25]), np.mean(losses[-25:])
    assert last <= first / 3, (first, last)


def _params(path):
    state = load_checkpoint(path)
    return state["model"], state["ema"], state["optimizer"]


@pytest.mark.parametrize("family", ["seed", "ddpm"])
def test_exact_resume_in_a_new_process(tmp_path, fmnist_npz, family):
    """N + N steps (the second N in a fresh process) equal 2N steps: losses, weights, EMA, optimizer state. The
    ddpm family runs with dropout: its random draws come back with the checkpoint's RNG state too.

    This process first calls torch.set_num_threads with its own count, as a notebook, another test or the doctor's
    self-test may have: that switches MKL's dynamic threading off, which a fresh process has on, and used to change
    the CPU GEMMs' summation order between the two (the 8th digit of the 8th loss)."""
    torch.set_num_threads(torch.get_num_threads())
    n = 6
    # QUICK's final grid: each run draws it after the checkpoints and losses compared here are written
    cfg = tiny_cfg(fmnist_npz, max_steps=2 * n, log_every=1, checkpoint_every=n, **QUICK)
    if family == "ddpm":
        from conftest import TINY_DDPM_28

        cfg = apply_overrides(cfg, {**TINY_DDPM_28, "model.dropout": 0.1})
    full = tmp_path / "full"
    train(cfg, out_dir=full, log=quiet)

    half = tmp_path / "half"
    train(apply_overrides(cfg, {"train.max_steps": n}), out_dir=half, log=quiet)
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    r = subprocess.run([sys.executable, "-m", "fastddpm", "train", "--out", str(half), "--resume", "latest",
                        "--max-steps", str(2 * n)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr

    la = [m["loss"] for m in read_metrics(full / "metrics.jsonl")]
    lb = [m["loss"] for m in read_metrics(half / "metrics.jsonl")]
    assert len(la) == len(lb) == 2 * n
    assert la == lb
    ma, ea, oa = _params(list_checkpoints(full / "checkpoints")[-1])
    mb, eb, ob = _params(list_checkpoints(half / "checkpoints")[-1])
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
        assert torch.equal(ea[k], eb[k]), k
    for i, sa in oa["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key], ob["state"][i][key])


def test_a_resume_on_another_cpu_thread_count_says_it_is_not_bit_exact(tmp_path, fmnist_npz):
    """The checkpoint records the CPU thread count; a resume with another count says so. A library call to train()
    leaves the caller's own thread count as it found it."""
    threads = torch.get_num_threads()
    run = tmp_path / "run"
    train(plain_cfg(fmnist_npz, max_steps=2, checkpoint_every=2, cpu_threads=threads + 1), out_dir=run, log=quiet)
    assert torch.get_num_threads() == threads
    assert load_checkpoint(list_checkpoints(run / "checkpoints")[-1])["cpu_threads"] == threads + 1
    assert json.loads((run / "run.json").read_text())["cpu_threads"] == threads + 1
    lines = []
    train(plain_cfg(fmnist_npz, max_steps=3, cpu_threads=threads), out_dir=run, resume="latest", log=lines.append)
    assert torch.get_num_threads() == threads
    note = [x for x in lines if "CPU thread" in x]
    assert note and f"written with {threads + 1} CPU thread(s), this run has {threads}" in note[0], lines
    assert f"--cpu-threads {threads + 1}" in note[0]
    lines.clear()  # the same count: no note
    train(plain_cfg(fmnist_npz, max_steps=4), out_dir=run, resume="latest", log=lines.append)
    assert not [x for x in lines if "written with" in x], lines


def test_every_log_line_reaches_the_callers_log_while_the_progress_bar_is_drawn(tmp_path, fmnist_npz, capsys):
    """With the bar on, the lines of set-up, of the loop (a grid written mid-run) and of the end all go to the
    `log` a caller passes; none is printed past it."""
    lines = []
    cfg = tiny_cfg(fmnist_npz, max_steps=4, progress=True, sample_every_images=32, num_sample_images=4,
                   sample_steps=2, checkpoint_every=None)
    train(cfg, out_dir=tmp_path / "run", log=lines.append)
    assert lines[0].startswith("model: U-Net") and lines[-1].startswith("done: step 4")
    assert any(line.startswith("step 2: wrote") for line in lines)
    assert "step 2: wrote" not in capsys.readouterr().out


def test_cli_end_to_end_writes_everything(tmp_path, fmnist_npz, capsys):
    run = tmp_path / "run"
    # the grids in 2 sampler steps, not the preset's 10: what is checked of them is their files and size. The
    # U-Net has one block of each kind and no attention (at 28x28, over 784 positions, it took most of the time of
    # the 1,000-step DDPM sampling below): what is checked is what the commands write, not what the model draws.
    code = main(["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", "--max-steps", "12",
                 "--checkpoint-every", "5", "--keep-checkpoints", "2", "--sample-every-images", "96",
                 "--sample-steps", "2", "--no-progress", *flags(ONE_BLOCK_SEED), "--no-attention"])
    assert code == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["image_channels"] == 1 and cfg["model"]["image_size"] == 28
    info = json.loads((run / "run.json").read_text())
    assert info["device"] == "cpu" and info["precision"] == "fp32" and info["parameters"] > 0
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [5, 10, 12]
    assert {"step", "images_seen", "loss", "images_per_s", "lr", "wall_s"} <= metrics[0].keys()
    assert metrics[-1]["images_seen"] == 12 * 16
    # keep-last-2 of the checkpoints at steps 5, 10, 12
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt_000000010.pt", "ckpt_000000012.pt"]
    assert (run / "checkpoints" / "ckpt_000000012.sha256").is_file()
    from PIL import Image

    grids = sorted((run / "samples").glob("*.png"))
    assert {g.name for g in grids} == {"grid_000000096.png", "final.png"}  # the last one is final.png
    with Image.open(run / "samples" / "final.png") as im:
        assert im.mode == "L" and im.size[0] > 28 * 4
    # the loss curve, redrawn with each grid: after the final one it holds all three logged steps
    with Image.open(run / "loss.png") as im:
        assert im.size[0] >= 600
    from fastddpm import charts

    assert charts.loss_curve(metrics[:1], run / "one.png", title="t") is None  # one point draws no curve

    # safetensors export round-trips bit-exactly against the checkpoint's EMA weights
    tensors, meta = load_safetensors(run / "ema.safetensors")
    ema = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])["ema"]
    assert tensors.keys() == ema.keys() and all(torch.equal(tensors[k], ema[k]) for k in ema)
    assert json.loads(meta["step"]) == 12

    # sampling from the run directory, the checkpoint, and the safetensors file
    # (DDPM runs all 1,000 steps and takes no --steps: 2 images, one batch, keep it the cheap one)
    for ckpt, sampler, steps, n in ((run, "ddim", 5, 6), (run / "ema.safetensors", "ddim", 3, 6),
                                    (list_checkpoints(run / "checkpoints")[-1], "ddpm", None, 2)):
        out = tmp_path / f"s_{sampler}_{steps}"
        assert main(["sample", "--checkpoint", str(ckpt), "--num-images", str(n), "--sampler", sampler,
                     *(["--steps", str(steps)] if steps else []), "--out", str(out), "--no-progress",
                     "--batch-size", "4"]) == 0
        npz = next(out.glob("*.npz"))
        images = np.load(npz)["images"]
        assert images.shape == (n, 1, 28, 28) and images.dtype == np.uint8
        assert next(out.glob("*.png")).is_file()
    assert "ddpm1000_n2_seed0_step12.npz" in [p.name for p in (tmp_path / "s_ddpm_None").iterdir()]


def test_sample_cli_is_deterministic_for_a_seed(tmp_path, fmnist_npz):
    run = tmp_path / "run"
    train(plain_cfg(fmnist_npz, max_steps=3), out_dir=run, log=quiet)
    outs = []
    for i, seed in enumerate((5, 5, 6)):
        out = tmp_path / f"o{i}"
        main(["sample", "--checkpoint", str(run), "--num-images", "4", "--steps", "4", "--seed", str(seed),
              "--out", str(out), "--no-progress"])
        outs.append(np.load(next(out.glob("*.npz")))["images"])
    assert np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])


def test_corrupted_newest_checkpoint_falls_back(tmp_path, fmnist_npz):
    run = tmp_path / "run"
    train(plain_cfg(fmnist_npz, max_steps=4, checkpoint_every=2), out_dir=run, log=quiet)
    ckpts = list_checkpoints(run / "checkpoints")
    data = bytearray(ckpts[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpts[-1].write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="ckpt_000000004.pt is corrupted"):
        path, state = load_latest(run / "checkpoints")
    assert path == ckpts[-2] and state["step"] == 2
    with pytest.raises(CheckpointError, match="ckpt_000000004.pt"):
        load_checkpoint(ckpts[-1])
    ckpts[-2].write_bytes(ckpts[-2].read_bytes()[:1000])  # truncated
    with pytest.raises(CheckpointError, match="ckpt_000000002.pt"):
        load_checkpoint(ckpts[-2])


def test_a_resume_from_an_older_checkpoint_branches_and_a_new_run_never_mixes_with_an_old_one(tmp_path, fmnist_npz):
    """Resuming at step 2 of a run that reached step 6 moves steps 4 and 6 aside (kept), so the new branch's step 4
    does not overwrite the old one's and `--resume latest` continues the new branch. A new run (no --resume) in a
    folder that holds checkpoints is refused before it writes anything."""
    run = tmp_path / "run"
    train(plain_cfg(fmnist_npz, max_steps=6, checkpoint_every=2), out_dir=run, log=quiet)
    old = {p.name: p.read_bytes() for p in list_checkpoints(run / "checkpoints")}
    lines = []
    train(plain_cfg(fmnist_npz, max_steps=4, checkpoint_every=2, lr=3e-3), out_dir=run,
          resume=run / "checkpoints" / "ckpt_000000002.pt", log=lines.append)
    (aside,) = (run / "checkpoints").glob("abandoned-after-000000002-*")
    assert [x for x in lines if "new branch at step 2" in x and "steps 4, 6" in x and str(aside) in x], lines
    assert {p.name: p.read_bytes() for p in aside.glob("*.pt")} == {k: v for k, v in old.items()
                                                                      if k != "ckpt_000000002.pt"}
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt_000000002.pt", "ckpt_000000004.pt"]
    assert load_checkpoint(run / "checkpoints" / "ckpt_000000004.pt")["config"]["train"]["lr"] == 3e-3
    lines.clear()
    train(plain_cfg(fmnist_npz, max_steps=5, checkpoint_every=2, lr=3e-3), out_dir=run, resume="latest",
          log=lines.append)
    assert [x for x in lines if "resumed from" in x and "ckpt_000000004.pt at step 4" in x], lines
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 5  # one history: the old branch's steps 5, 6 moved aside
    assert {r["step"] for r in read_metrics(run / "metrics.abandoned.jsonl")} == {5, 6}

    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(ConfigError, match=r"already holds a run's checkpoints \(steps 2 to 5.*--resume latest"):
        train(plain_cfg(fmnist_npz, max_steps=2), out_dir=run, log=quiet)
    other = tmp_path / "other"
    train(plain_cfg(fmnist_npz, max_steps=2, checkpoint_every=2), out_dir=other, log=quiet)
    with pytest.raises(ConfigError, match=r"is another run's checkpoint, and .* already holds"):
        train(plain_cfg(fmnist_npz, max_steps=4), out_dir=run, resume=other / "checkpoints" / "ckpt_000000002.pt",
              log=quiet)
    assert sorted(p.name for p in run.rglob("*")) == before


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    _Evil.marker = tmp_path / "pwned"
    path = tmp_path / "ckpt_000000001.pt"
    torch.save({"format": 1, "model": _Evil()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_checkpoint(path)
    assert not _Evil.marker.exists()


def test_resume_with_changed_architecture_names_the_field(tmp_path, fmnist_npz):
    run = tmp_path / "run"
    cfg = plain_cfg(fmnist_npz, max_steps=2)
    train(cfg, out_dir=run, log=quiet)
    changed = apply_overrides(cfg, {"model.time_emb_dim": 64, "train.max_steps": 4})
    with pytest.raises(ConfigError, match="model.time_emb_dim was 32 in the checkpoint but is 64 now; drop"):
        train(changed, out_dir=run, resume="latest", log=quiet)


def test_a_resume_given_the_preset_is_told_a_difference_is_the_presets(tmp_path, fmnist_npz, capsys):
    """A flow run resumed with its --preset read "objective was 'flow' ... but is 'ddpm' now; drop the change", a
    change never typed: the preset's value."""
    run = tmp_path / "run"
    args = ["train", "--data", str(fmnist_npz), "--out", str(run), "--no-progress", "--num-sample-images", "4",
            "--sample-steps", "2"]
    assert main([*args, "--preset", "tiny", "--objective", "flow", "--max-steps", "1"]) == 0
    capsys.readouterr()
    assert main([*args, "--preset", "tiny", "--resume", "latest", "--max-steps", "2"]) == 2
    assert ("diffusion.objective was 'flow' in the checkpoint but is 'ddpm' now ('ddpm' is the tiny preset's value: "
            "where --preset is given, a resume starts from the preset's values") in capsys.readouterr().err
    assert main([*args, "--resume", "latest", "--max-steps", "2"]) == 0  # without --preset: the run's own config


def test_an_fsdp_run_resumed_in_one_process_is_told_to_use_torchrun_not_to_drop_a_flag_never_given(
        tmp_path, fmnist_npz, capsys):
    run = tmp_path / "run"
    args = ["train", "--data", str(fmnist_npz), "--out", str(run), "--no-progress", "--num-sample-images", "4",
            "--sample-steps", "2", "--preset", "tiny", "--max-steps", "1"]
    assert main([*args, "--parallel", "fsdp"]) == 2  # a new run: the flag given is the fix
    assert "or drop --parallel fsdp for a single-process run" in capsys.readouterr().err
    cfg = plain_cfg(fmnist_npz, max_steps=1)
    train(cfg, out_dir=run, log=quiet)
    # a resume takes the run's own settings (its checkpoint's config), parallel=fsdp among them for an FSDP run
    with pytest.raises(ConfigError, match=r"resumes with train.parallel=fsdp \(its config.json, or --parallel\)") as e:
        train(apply_overrides(cfg, {"train.parallel": "fsdp", "train.max_steps": 2}), out_dir=run, resume="latest",
              log=quiet)
    assert "torchrun" in str(e.value) and "drop --parallel" not in str(e.value)


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_logger_that_cannot_open_is_refused_before_the_runs_set_up(tmp_path, fmnist_npz, capsys, monkeypatch,
                                                                     logger):
    """Rank 0 opens the loggers after the data, the model and the compile (and under torchrun the other ranks then
    ended in a gloo traceback): a missing package, or a file where the logger's folder goes, is refused on every
    rank before any of that, and the file is left as it was."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    installed = {"tensorboard": True, "wandb": True}

    def find_spec(name, *args):  # the two loggers' packages as `installed` says, any other module as it is
        if name in installed:
            return object() if installed[name] else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    run = tmp_path / "run"
    args = ["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", "--max-steps", "1",
            "--no-progress", "--log-to", logger]
    installed[logger] = False
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--log-to {logger} needs the {logger} package: pip install {logger}" in err and "Traceback" not in err
    assert not run.exists()  # before the run folder, the data and the model
    installed[logger] = True
    run.mkdir()
    (run / logger).write_text("notes\n")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--log-to {logger} writes into the folder {run / logger}, which is a file here: move or delete" in err
    assert (run / logger).read_text() == "notes\n" and sorted(p.name for p in run.iterdir()) == [logger]


def test_state_dict_keys_are_clean():
    sd = {"_orig_mod.conv_in.weight": 1, "module.conv_out.bias": 2, "module._orig_mod.t_proj.0.weight": 3}
    assert list(clean_state_dict(sd)) == ["conv_in.weight", "conv_out.bias", "t_proj.0.weight"]


def test_a_module_wrapped_by_torch_compile_has_clean_keys_and_loads_both_ways(tmp_path, fmnist_npz):
    """torch.compile(model) prefixes every key with `_orig_mod.`: a user's compiled U-Net and fastddpm's plain one
    exchange weights in both directions, and the compiled module runs with the loaded weights."""
    from fastddpm.models import UNet
    from fastddpm.rundir.state_dicts import CheckpointError, load_model_state, unwrap_model
    from fastddpm.sampling import load_for_sampling

    run = tmp_path / "run"
    train(tiny_cfg(fmnist_npz, max_steps=2, **QUICK), out_dir=run, log=quiet)  # the weights are what is read
    trained = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])
    cfg = get_preset("tiny").model
    cfg.image_channels, cfg.image_size = 1, 28

    compiled = torch.compile(UNet(cfg), backend="eager")  # the eager backend: dynamo's wrapping, no codegen
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert unwrap_model(compiled) is compiled._orig_mod
    # plain checkpoint -> compiled module
    load_model_state(compiled, trained["model"])
    for k, v in clean_state_dict(compiled.state_dict()).items():
        assert torch.equal(v, trained["model"][k]), k
    x, t = torch.randn(2, 1, 28, 28), torch.tensor([10, 500])
    plain = UNet(cfg)
    plain.load_state_dict(trained["model"])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t), plain(x, t))
    # compiled module's own state dict (prefixed) -> a plain module, and -> the sampler's loader via a checkpoint
    other = UNet(cfg)
    load_model_state(other, compiled.state_dict())
    assert all(torch.equal(v, trained["model"][k]) for k, v in other.state_dict().items())
    assert list(clean_state_dict(compiled.state_dict())) == list(plain.state_dict())
    trained["model"] = compiled.state_dict()
    torch.save(trained, tmp_path / "prefixed.pt")
    sampler_model, _ = load_for_sampling(tmp_path / "prefixed.pt", device="cpu", weights="model")
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in sampler_model.state_dict().items())
    # weights of another architecture: the error names the keys, not a bare RuntimeError
    bigger = get_preset("tiny").model
    bigger.image_channels, bigger.image_size, bigger.num_down_layers = 1, 28, 2
    with pytest.raises(CheckpointError, match=r"does not fit this UNet: missing \d+ key\(s\)"):
        load_model_state(torch.compile(UNet(bigger), backend="eager"), trained["model"])


def test_sigterm_checkpoints_and_exits_143_then_resumes(tmp_path, fmnist_npz):
    from conftest import interrupt_training

    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    returncode, out, err = interrupt_training(fmnist_npz, run, signal.SIGTERM, after_log_lines=3)
    assert returncode == 143, err
    ckpts = list_checkpoints(run / "checkpoints")
    assert len(ckpts) == 1
    saved = load_checkpoint(ckpts[0])
    step = saved["step"]
    assert step >= 3 and read_metrics(metrics)[-1]["step"] == step
    assert "resume with --resume latest" in out + err
    # the checkpoint carries the training time up to its step (written after that step's log line)
    assert saved["train_s"] >= read_metrics(metrics)[-1]["wall_s"] > 0
    # the continuation picks up exactly there, its clock too: wall_s is the run's, not the new process's
    assert main(["train", "--out", str(run), "--resume", "latest", "--max-steps", str(step + 2),
                 "--num-sample-images", "4", "--sample-steps", "2", "--no-progress"]) == 0  # a small final grid
    assert [m["step"] for m in read_metrics(metrics)][-2:] == [step + 1, step + 2]
    assert read_metrics(metrics)[-2]["wall_s"] > saved["train_s"]



def test_a_run_length_in_images_or_epochs_holds_across_a_resume_at_another_batch(tmp_path, fmnist_npz):
    """--max-images and --max-epochs count images: a run resumed at a larger global batch trains the images still
    missing, at the new batch, from the checkpoint's step. 64 images at batch 16 (4 steps), then to 256 at batch
    32: 6 more steps (not 256 / 32 = 8 steps counted from step 0, which stopped at 192 images). One epoch of the
    256 images at batch 32 is 8 steps of 256 images. --max-steps keeps counting steps."""
    for length in ({"max_images": 256}, {"max_epochs": 1}):
        run = tmp_path / next(iter(length))
        train(plain_cfg(fmnist_npz, max_steps=None, max_images=64, checkpoint_every=None), out_dir=run, log=quiet)
        lines = []
        result = train(plain_cfg(fmnist_npz, max_steps=None, batch_size=32, checkpoint_every=None, **length),
                       out_dir=run, resume="latest", log=lines.append)
        assert (result.step, result.images_seen) == (10, 256), length
        assert [x for x in lines if x.startswith("training to step 10 (256 images)")], lines
        assert json.loads((run / "run.json").read_text())["total_steps"] == 10
    result = train(plain_cfg(fmnist_npz, max_steps=12, batch_size=32, checkpoint_every=None), out_dir=run,
                   resume="latest", log=quiet)
    assert (result.step, result.images_seen) == (12, 320)


def test_the_epoch_in_metrics_counts_the_passes_the_loop_makes(tmp_path, fmnist_npz):
    """256 images at batch 100: a pass is 2 steps of 200 images (the ragged 56 are dropped), so --max-epochs 2
    trains 4 steps and its last record says epoch 2, not 400 / 256."""
    run = tmp_path / "run"
    result = train(plain_cfg(fmnist_npz, max_steps=None, max_epochs=2, batch_size=100, log_every=1,
                             checkpoint_every=None), out_dir=run, log=quiet)
    assert result.step == 4
    assert [r["epoch"] for r in read_metrics(run / "metrics.jsonl")] == [0.5, 1.0, 1.5, 2.0]


def test_a_resume_takes_the_adamw_settings_of_its_flags_not_the_checkpoints(tmp_path, fmnist_npz):
    """Optimizer.load_state_dict restores the saved betas and weight decay: a resume with --weight-decay or
    --adam-betas puts the flags' values back, and says which changed."""
    run = tmp_path / "run"
    train(plain_cfg(fmnist_npz, max_steps=2, checkpoint_every=2), out_dir=run, log=quiet)
    lines = []
    train(plain_cfg(fmnist_npz, max_steps=3, weight_decay=0.1, adam_betas=(0.5, 0.9)), out_dir=run,
          resume="latest", log=lines.append)
    groups = load_checkpoint(list_checkpoints(run / "checkpoints")[-1])["optimizer"]["param_groups"]
    assert all(g["weight_decay"] == 0.1 and tuple(g["betas"]) == (0.5, 0.9) for g in groups), groups
    note = [x for x in lines if "AdamW settings replace the checkpoint's" in x]
    assert note and "betas (0.9, 0.999) -> (0.5, 0.9)" in note[0] and "weight_decay 0.0 -> 0.1" in note[0], lines
    lines.clear()  # the same settings: no note
    train(plain_cfg(fmnist_npz, max_steps=4, weight_decay=0.1, adam_betas=(0.5, 0.9)), out_dir=run,
          resume="latest", log=lines.append)
    assert not [x for x in lines if "AdamW settings" in x], lines


def test_grid_and_eval_steps_a_sampler_cannot_take_are_refused_before_the_run_starts(tmp_path, fmnist_npz):
    """The grids and --eval-every first sample hours into a run: steps given that their sampler cannot take on the
    run's schedule are refused at the start, naming the flag and the largest count; the default count is capped to
    it, as `sample` and `eval` cap theirs. At that count the run's grid works."""
    from fastddpm.diffusion import schedule_from_config
    from fastddpm.diffusion.samplers import max_steps

    short = apply_overrides(tiny_cfg(fmnist_npz, sample_steps=None, num_sample_images=4),
                            {"diffusion.schedule": "cosine", "diffusion.num_timesteps": 16})
    limit = max_steps(schedule_from_config(short.diffusion), "dpmpp-2m-sde")
    assert short.grid_sampling() == ("dpmpp-2m-sde", 20) and limit < 20
    with pytest.raises(ConfigError, match=rf"--sample-steps 20: the grids' sampler dpmpp-2m-sde "
                                          rf"takes at most {limit} steps on this 16-timestep cosine schedule.*give "
                                          rf"--sample-steps {limit} or fewer, or more --num-timesteps"):
        train(apply_overrides(short, {"train.sample_steps": 20}), out_dir=tmp_path / "short", log=quiet)
    assert not (tmp_path / "short").exists()  # refused before anything was loaded or written
    evaluated = apply_overrides(short, {"train.eval_steps": 20, "train.eval_every_images": 128})
    with pytest.raises(ConfigError, match=rf"--eval-steps 20: the evaluations' sampler .*give "
                                          rf"--eval-steps {limit} or fewer"):
        train(evaluated, out_dir=tmp_path / "evaluated", log=quiet)
    cosine = apply_overrides(tiny_cfg(fmnist_npz), {"diffusion.schedule": "cosine", "train.sampler": "dpmpp-2m",
                                                    "train.sample_steps": 1000})
    solver_limit = max_steps(schedule_from_config(cosine.diffusion), "dpmpp-2m")
    with pytest.raises(ConfigError, match=rf"--sample-steps 1000: the grids' sampler dpmpp-2m takes at most "
                                          rf"{solver_limit} steps .*it starts at timestep {solver_limit - 1}"):
        train(cosine, out_dir=tmp_path / "cosine", log=quiet)
    # the defaults on that short schedule: capped to the limit, said in the log and recorded in run.json
    from fastddpm.sampling import run_sampling
    from fastddpm.trainer.setup import check_sampling_steps

    check_sampling_steps(apply_overrides(short, {"train.eval_every_images": 128}))  # both defaults: no refusal
    assert run_sampling(short, "evaluations") == ("dpmpp-2m-sde", limit)
    lines = []
    result = train(apply_overrides(short, {"train.max_steps": 1}), out_dir=tmp_path / "at-the-limit",
                   log=lines.append)
    assert result.grid is not None and result.grid.is_file()
    info = json.loads((tmp_path / "at-the-limit" / "run.json").read_text())
    assert info["grid_sampling"] == ["dpmpp-2m-sde", limit]
    assert any(line.startswith(f"grids: dpmpp-2m-sde {limit} steps") for line in map(str, lines)), lines


def test_batch_larger_than_dataset_is_a_clear_error(tmp_path, fmnist_npz, capsys):
    code = main(["train", "--data", str(fmnist_npz), "--out", str(tmp_path / "r"), "--preset", "tiny",
                 "--batch-size", "1000", "--no-progress"])
    assert code == 2
    assert "fewer than batch_size=1000" in capsys.readouterr().err


@pytest.mark.parametrize("gpu, capability, auto", [("Tesla T4", (7, 5), "fp16"),
                                                    ("Tesla V100-SXM2-16GB", (7, 0), "fp16"),
                                                    ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16"),
                                                    ("NVIDIA H100 80GB HBM3", (9, 0), "bf16")])
def test_precision_follows_native_bf16_not_emulation(monkeypatch, gpu, capability, auto):
    """torch.cuda.is_bf16_supported() says True on a T4 because it counts emulation; the seed's T4 must train in
    fp16 + GradScaler, and --precision bf16 is refused there with the reason and the fix."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what torch answers on a T4
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: gpu)
    cuda = torch.device("cuda", 0)
    p = resolve_precision("auto", cuda)
    assert p.name == auto and p.use_grad_scaler == (auto == "fp16")
    assert f"sm{capability[0]}{capability[1]}" in p.reason and gpu in p.reason
    if auto == "fp16":
        with pytest.raises(ConfigError, match=r"sm7\d: bf16 would be emulated.*--precision fp16"):
            resolve_precision("bf16", cuda)
    else:
        assert resolve_precision("bf16", cuda).autocast_dtype == torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_training_and_sampling(tmp_path, fmnist_npz):
    cfg = apply_overrides(tiny_cfg(fmnist_npz, max_steps=20), {"train.device": "cuda", "train.precision": "auto"})
    result = train(cfg, out_dir=tmp_path / "run", log=quiet)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["device"].startswith("cuda")
    assert info["precision"] == ("bf16" if cuda_native_bf16(torch.device("cuda"))[0] else "fp16")
    assert result.last_loss is not None and np.isfinite(result.last_loss)
    assert (tmp_path / "run" / "samples" / "final.png").is_file()


def test_a_new_run_sets_aside_the_logs_of_an_earlier_run_that_left_no_checkpoint(tmp_path, fmnist_npz):
    """A run whose checkpoints were deleted (or that stopped before its first) leaves metrics.jsonl behind: a new
    run in that folder moves those records aside, so the log holds one history (as TensorBoard's purge)."""
    import shutil

    run = tmp_path / "run"
    train(plain_cfg(fmnist_npz, max_steps=3), out_dir=run, log=quiet)
    old_steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    shutil.rmtree(run / "checkpoints")
    lines = []
    train(plain_cfg(fmnist_npz, max_steps=2), out_dir=run, log=lines.append)
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 2
    assert [r["step"] for r in read_metrics(run / "metrics.abandoned.jsonl")] == old_steps
    assert [x for x in lines if f"{len(old_steps)} record(s) of an earlier run" in x], lines


def test_a_signal_stop_between_logging_steps_writes_the_losses_since_the_last_line(tmp_path, fmnist_npz):
    """Stopped by SIGTERM at step 7 with a line every 5 steps: steps 6 and 7's losses get a line at step 7 (the
    checkpoint's step), so the resumed run's first line covers only the steps after it and no loss is dropped."""
    import os

    from fastddpm.trainer.loop import TrainingInterrupted
    from fastddpm.trainer.setup import TrainHooks

    def sigterm_at_7(step):
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)

    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted):
        train(plain_cfg(fmnist_npz, max_steps=12, log_every=5, checkpoint_every=None), out_dir=run, log=quiet,
              hooks=TrainHooks(after_step=sigterm_at_7))
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [5, 7]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt_000000007.pt"]
    train(plain_cfg(fmnist_npz, max_steps=12, log_every=5, checkpoint_every=None), out_dir=run, resume="latest",
          log=quiet)
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [5, 7, 10, 12]


def test_a_finished_run_run_again_says_it_trained_no_step_not_loss_none(tmp_path, fmnist_npz):
    run = tmp_path / "run"
    lines = []
    train(plain_cfg(fmnist_npz, max_steps=2), out_dir=run, log=lines.append)
    assert re.search(r"done: step 2, 32 images, loss \d+\.\d{4}; grid", lines[-1]), lines[-1]
    lines.clear()
    assert train(plain_cfg(fmnist_npz, max_steps=2), out_dir=run, resume="latest", log=lines.append).step == 2
    assert "no step trained here (the run had already reached its length" in lines[-1] and "None" not in lines[-1]


def test_a_step_count_the_preset_set_is_called_the_presets_in_the_refusal(fmnist_npz):
    """`--preset tiny --num-timesteps 8`: tiny's grid count (10) is past what the sampler takes on 8 timesteps; the
    refusal must not read as if the user passed --sample-steps."""
    from fastddpm.trainer.setup import check_sampling_steps

    cfg = apply_overrides(get_preset("tiny"), {"diffusion.schedule": "cosine", "diffusion.num_timesteps": 8,
                                               "data.source": str(fmnist_npz)})
    assert cfg.train.sample_steps == 10
    with pytest.raises(ConfigError, match=r"--sample-steps 10 \(preset tiny's default, if the flag was not given\): "
                                          r"the grids' sampler"):
        check_sampling_steps(cfg)
    other = apply_overrides(cfg, {"train.sample_steps": 9})  # not the preset's count: the flag's own
    with pytest.raises(ConfigError, match=r"--sample-steps 9: the grids' sampler"):
        check_sampling_steps(other)


def test_ema_every_k_folds_the_runs_last_steps_into_the_final_ema_and_resumes_exactly(tmp_path, fmnist_npz):
    """--ema-every 3 over 6 steps (0..5) updated the EMA at steps 0 and 3 only: the final EMA missed steps 4 and 5.
    The last step folds in the steps since the previous update (decay**2 here); a run stopped at step 2 and resumed
    ends with the same EMA bit for bit; a run that ended at step 4 (decay**1) and is resumed longer folds in only
    the step after it, not step 4 again."""
    from fastddpm.trainer.ema import EMA
    from fastddpm.trainer.setup import TrainHooks

    cfg = tiny_cfg(fmnist_npz, max_steps=6, ema_every=3, checkpoint_every=4, num_sample_images=1, sample_steps=1)
    beta = EMA(torch.nn.Linear(1, 1), cfg.train.ema_decay, warmup=cfg.train.ema_warmup).beta

    def folded(ema, model, weight):  # EMA.update's ops: ema + (theta - ema) * (1 - beta**n), a float32 weight
        w = torch.tensor(weight, dtype=torch.float32)
        return {k: ema[k] + (model[k] - ema[k]) * w for k in ema}

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    train(cfg, out_dir=tmp_path / "full", log=quiet)
    at_4, end = (load_checkpoint(p) for p in list_checkpoints(tmp_path / "full" / "checkpoints"))
    assert end["step"] == 6 and at_4["step"] == 4
    assert same(end["ema"], folded(at_4["ema"], end["model"], 1 - beta(5) ** 2))

    stopped = tmp_path / "stopped"
    train(cfg, out_dir=stopped, log=quiet, hooks=TrainHooks(after_step=lambda step: step == 2))
    train(cfg, out_dir=stopped, resume="latest", log=quiet)
    _, resumed = load_latest(stopped / "checkpoints")
    assert same(resumed["ema"], end["ema"]) and same(resumed["model"], end["model"])

    longer = tmp_path / "longer"
    train(apply_overrides(cfg, {"train.max_steps": 5}), out_dir=longer, log=quiet)
    _, ended = load_latest(longer / "checkpoints")
    assert ended["ema_off_grid"] == 4 and same(ended["ema"], folded(at_4["ema"], ended["model"], 1 - beta(4)))
    train(cfg, out_dir=longer, resume="latest", log=quiet)
    _, longer_end = load_latest(longer / "checkpoints")
    assert same(longer_end["ema"], folded(ended["ema"], longer_end["model"], 1 - beta(5)))
