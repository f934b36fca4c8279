"""The trainer's edges: --batch-size auto on small datasets and with accumulation, the batch finder and the global
RNG, and the epochs of a run with gradient accumulation."""

import json

import numpy as np
import pytest
import torch

from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.device import resolve_precision
from fastddpm.diffusion import make_schedule
from fastddpm.rundir.metrics import read_metrics
from fastddpm.trainer.batch_finder import find_batch_size, make_trial_fn
from fastddpm.trainer.batches import ResidentBatches, StreamingBatches, step_batches
from fastddpm.trainer.loop import train

CPU = torch.device("cpu")


def _images(n, side=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, 1, side, side), dtype=np.uint8)


def _cfg(src, **train):
    over = {"data.source": str(src), "train.progress": False, "train.sample_steps": 2,
            "train.num_sample_images": 4, "train.checkpoint_every": None}
    over.update({f"train.{k}": v for k, v in train.items()})
    return apply_overrides(get_preset("tiny"), over)


def quiet(*args, **kwargs):
    pass


def test_the_batch_finder_tries_a_limit_below_its_first_batch():
    """A dataset of 20 images cannot fill the first trial's 32: the search tries 20 itself, instead of running no
    trial and blaming out-of-memory."""
    calls = []

    def trial(bs):
        calls.append(bs)
        return 100.0 * bs

    best, trials = find_batch_size(trial, start=32, limit=20, log=quiet)
    assert calls == [20] and best == 20 and [t.batch_size for t in trials] == [20]
    with pytest.raises(ValueError, match="limit=0"):
        find_batch_size(trial, start=32, limit=0, log=quiet)


@pytest.mark.parametrize("n, accum, expect", [(20, 1, 20), (70, 2, 32)])
def test_auto_batch_size_picks_a_batch_the_data_fills(tmp_path, n, accum, expect):
    """--batch-size auto on 20 images trains at batch 20; on 70 images with --accum-steps 2 the largest batch a
    step can fill is 35, so the search stops at 32 (64 x 2 is more than the data)."""
    src = tmp_path / "d.npz"
    np.savez(src, images=_images(n))
    result = train(_cfg(src, batch_size="auto", accum_steps=accum, max_steps=1), out_dir=tmp_path / "run", log=quiet)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert result.step == 1 and info["batch_size"] == expect, info["batch_size_reason"]
    assert info["batch_size_reason"].startswith(f"auto: {min(n // accum, 32)}:")


def test_auto_batch_size_refuses_more_accumulation_than_images(tmp_path):
    src = tmp_path / "d.npz"
    np.savez(src, images=_images(3))
    with pytest.raises(ConfigError, match=r"3 images, fewer than accum_steps=4 x 1 rank\(s\).*lower --accum-steps"):
        train(_cfg(src, batch_size="auto", accum_steps=4, max_steps=1), out_dir=tmp_path / "run", log=quiet)


def test_batch_finder_trials_leave_the_global_rng_as_they_found_it():
    """The run's dropout draws from the global RNG after set-up: the trials (how many run depends on measured
    speed) must not move it."""
    from fastddpm.models import build_unet

    cfg = get_preset("tiny").model
    cfg.image_channels, cfg.image_size = 1, 16
    model = build_unet(cfg)
    trial = make_trial_fn(model, make_schedule("linear", 1000), "epsilon", resolve_precision("fp32", CPU),
                          image_shape=(1, 16, 16), device=CPU, warmup_steps=1, timed_steps=1)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert trial(4) > 0
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("source", [ResidentBatches, StreamingBatches])
def test_with_accumulation_an_epoch_is_whole_steps_of_one_permutation(source):
    """80 images at batch 16 are 5 micro-batches; with --accum-steps 2 an epoch is 2 optimizer steps (4 micro-
    batches, the ragged 16 images dropped), and epoch e's steps hold exactly the first 64 images of permutation e:
    no step mixes two epochs' orders, so an image is seen at most once per epoch."""
    images = _images(80)
    batches = source(images, batch_size=16, num_timesteps=1000, seed=7, device=CPU, accum_steps=2)
    assert batches.steps_per_epoch == 4
    for epoch in range(3):
        seen = torch.cat([b.indices for step in range(2 * epoch, 2 * epoch + 2)
                          for b in step_batches(batches, step, accum_steps=2)])
        assert torch.equal(seen, batches.permutation(epoch)[:64]), epoch


def test_max_epochs_with_accumulation_counts_passes_over_the_data(tmp_path):
    """--max-epochs 2 on 80 images at batch 16 x 2 accumulation: 2 steps per pass, 4 steps, epoch 2.0 at the
    end, and each pass 64 different images (a step never takes the last pass's leftovers)."""
    from fastddpm.trainer.setup import TrainHooks

    src = tmp_path / "d.npz"
    np.savez(src, images=_images(80))
    run = tmp_path / "run"
    drawn = {}

    class Recorded:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get(self, m):
            batch = self.inner.get(m)
            drawn[m] = batch.indices.tolist()
            return batch

    result = train(_cfg(src, batch_size=16, accum_steps=2, max_steps=None, max_epochs=2, log_every=1), out_dir=run,
                   log=quiet, hooks=TrainHooks(wrap_batches=Recorded, final_outputs=False))
    assert result.step == 4 and sorted(drawn) == list(range(8))
    assert [r["epoch"] for r in read_metrics(run / "metrics.jsonl")] == [0.5, 1.0, 1.5, 2.0]
    for epoch in range(2):
        images = [i for m in range(4 * epoch, 4 * epoch + 4) for i in drawn[m]]
        assert len(set(images)) == 64, epoch


def test_a_batch_source_refuses_accumulation_the_data_cannot_fill():
    with pytest.raises(ConfigError, match="batch 8 x accum_steps 3 is more than the dataset's 20 images"):
        ResidentBatches(_images(20), batch_size=8, num_timesteps=1000, seed=0, device=CPU, accum_steps=3)


def test_the_planned_run_length_counts_the_global_batch_where_one_is_given():
    """--compile auto on a CPU decides by the planned images: with --global-batch-size, a step is that many images,
    whatever the per-device batch the preset names."""
    from fastddpm.config import apply_overrides, get_preset
    from fastddpm.trainer.setup import _planned_images

    cfg = apply_overrides(get_preset("tiny"), {"train.max_steps": 100, "train.global_batch_size": 256,
                                               "train.batch_size": 16})
    assert _planned_images(cfg, 60_000, world=2) == 100 * 256
    plain = apply_overrides(get_preset("tiny"), {"train.max_steps": 100, "train.batch_size": 16,
                                                 "train.accum_steps": 2})
    assert _planned_images(plain, 60_000, world=2) == 100 * 16 * 2 * 2


# ------------------------------------------------------------------------------------------ what a resume reads
def _npz(path, n=64, seed=0):
    rng = np.random.default_rng(seed)
    np.savez(path, images=rng.integers(0, 256, size=(n, 1, 16, 16), dtype=np.uint8),
             labels=rng.integers(0, 2, size=n))
    return path


def test_a_relative_data_path_is_kept_absolute_so_a_resume_from_elsewhere_reads_the_same_data(tmp_path,
                                                                                                  monkeypatch):
    """`--data imgs.npz` typed in one folder was kept as typed: a resume started in another folder found no data
    there, or another folder's file of that name (and trained on it)."""
    from fastddpm.cli import main

    (tmp_path / "project").mkdir()
    _npz(tmp_path / "project" / "imgs.npz")
    monkeypatch.chdir(tmp_path / "project")
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--no-progress", "--num-sample-images", "2",
            "--sample-steps", "2"]
    assert main([*args, "--data", "imgs.npz", "--max-steps", "2"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["source"] == str(tmp_path / "project" / "imgs.npz")
    (tmp_path / "elsewhere").mkdir()
    _npz(tmp_path / "elsewhere" / "imgs.npz", seed=1)  # another file of the same name where the resume starts
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--out", str(tmp_path / "run"), "--no-progress", "--resume", "latest",
                 "--max-steps", "3"]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["source"] == config["data"]["source"]


def test_a_resume_on_other_data_or_another_seed_is_refused_and_the_same_data_moved_is_not(tmp_path, capsys):
    """Step k's batch is drawn from the data by (seed, k): a resume on another dataset, or another resize of it,
    or with another seed, would silently be another run (it was accepted without a word). The same images moved
    to another path continue the run, with a note."""
    src = _npz(tmp_path / "a.npz")
    cfg = _cfg(src, max_steps=2, checkpoint_every=2)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    other = _npz(tmp_path / "b.npz", seed=1)
    with pytest.raises(ConfigError, match=r"its run trained on .*a\.npz \(64 images \(1, 16, 16\), classes 0, 1\), "
                                          r"this one's data is .*b\.npz .*Resume on its data \(--data .*a\.npz"):
        train(apply_overrides(cfg, {"data.source": str(other), "train.max_steps": 3}), out_dir=tmp_path / "run",
              resume="latest", log=quiet)
    with pytest.raises(ConfigError, match=r"64 images \(1, 16, 16\).*64 images \(1, 8, 8\)"):
        train(apply_overrides(cfg, {"data.resize": 8, "train.max_steps": 3}), out_dir=tmp_path / "run",
              resume="latest", log=quiet)
    with pytest.raises(ConfigError, match="train.seed was 0 in the checkpoint but is 5 now"):
        train(apply_overrides(cfg, {"train.seed": 5, "train.max_steps": 3}), out_dir=tmp_path / "run",
              resume="latest", log=quiet)
    moved = tmp_path / "moved" / "a.npz"
    moved.parent.mkdir()
    src.rename(moved)
    lines = []
    result = train(apply_overrides(cfg, {"data.source": str(moved), "train.max_steps": 3}), out_dir=tmp_path / "run",
                   resume="latest", log=lines.append)
    assert result.step == 3
    assert any(line.startswith(f"note: the checkpoint's run read its data from {src}, this run from {moved}: the "
                               "same images") for line in lines), lines


def test_a_resume_with_a_length_that_ends_before_its_step_is_refused_and_another_end_is_said(tmp_path):
    """A shorter --max-steps on resume ended the run where it stood without a word, and config.json kept the
    shorter length, so a later plain `--resume latest` took the run for done."""
    cfg = _cfg(_npz(tmp_path / "a.npz"), max_steps=3, checkpoint_every=3)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    config = (tmp_path / "run" / "config.json").read_text()
    for length, says in (({"train.max_steps": 2}, "--max-steps 2 ends this run at step 2"),
                         ({"train.max_steps": None, "train.max_images": 1}, "--max-images 1 ends this run at step 3")):
        with pytest.raises(ConfigError, match=rf"{says}, and .*ckpt_000000003\.pt is at step 3, so nothing would "
                                              rf"be trained \(the run was to train to step 3, --max-steps 3\)"):
            train(apply_overrides(cfg, length), out_dir=tmp_path / "run", resume="latest", log=quiet)
    assert (tmp_path / "run" / "config.json").read_text() == config  # the refusal changed nothing
    lines = []
    assert train(apply_overrides(cfg, {"train.max_steps": 5}), out_dir=tmp_path / "run", resume="latest",
                 log=lines.append).step == 5
    assert "note: this run now ends at step 5 (--max-steps 5); it was to end at step 3 (--max-steps 3)" in lines
    with pytest.raises(ConfigError, match=r"give a length beyond step 5 \(the run as it began is done; "):
        train(apply_overrides(cfg, {"train.max_steps": 4}), out_dir=tmp_path / "run", resume="latest", log=quiet)
    # from a checkpoint before the run's end: a shorter length is refused with the way to finish it; the same end in
    # other units is no change, and no note
    run = tmp_path / "unfinished"
    train(_cfg(tmp_path / "a.npz", max_steps=4, checkpoint_every=2), out_dir=run, log=quiet)
    at_2 = str(run / "checkpoints" / "ckpt_000000002.pt")
    with pytest.raises(ConfigError, match=r"give a length beyond step 2, or resume without this length \(from a "
                                          r"flag or a config file\) to finish the run as it began"):
        train(apply_overrides(cfg, {"train.max_steps": 1}), out_dir=run, resume=at_2, log=quiet)
    lines = []
    same_end = {"train.max_steps": None, "train.max_images": 4 * cfg.train.batch_size}
    assert train(apply_overrides(cfg, same_end), out_dir=run, resume=at_2, log=lines.append).step == 4
    assert not any("now ends at step" in line for line in lines), lines


def test_an_unconditional_resume_compares_pixels_and_a_changed_file_is_named_as_changed(tmp_path):
    """An unconditional model reads no labels: the same images with other labels or class names (Fashion-MNIST by
    name and its IDX files by path) were refused as other data. Pixels changed under the same path were described
    as two identical datasets, with the advice to pass the path already in use."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(64, 1, 16, 16), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", images=images, labels=rng.integers(0, 2, size=64))
    np.savez(tmp_path / "relabelled.npz", images=images, labels=rng.integers(0, 3, size=64))
    cfg = _cfg(tmp_path / "a.npz", max_steps=2, checkpoint_every=2)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    lines = []
    result = train(apply_overrides(cfg, {"data.source": str(tmp_path / "relabelled.npz"), "train.max_steps": 3}),
                   out_dir=tmp_path / "run", resume="latest", log=lines.append)
    assert result.step == 3
    assert any("the same images (count, shape and sampled pixels), so the run continues" in line for line in lines)
    conditional = apply_overrides(cfg, {"model.conditional": True})
    train(conditional, out_dir=tmp_path / "cond", log=quiet)
    with pytest.raises(ConfigError, match=r"64 images \(1, 16, 16\), classes 0, 1\), this one's data is "
                                          r".*relabelled\.npz \(64 images \(1, 16, 16\), classes 0, 1, 2\)"):
        train(apply_overrides(conditional, {"data.source": str(tmp_path / "relabelled.npz"), "train.max_steps": 3}),
              out_dir=tmp_path / "cond", resume="latest", log=quiet)
    train(apply_overrides(cfg, {"train.max_steps": 4}), out_dir=tmp_path / "run", resume="latest", log=quiet)
    images[5, 0, 3, 3] ^= 1  # one bit of one sampled image, under the path the last checkpoint recorded
    np.savez(tmp_path / "a.npz", images=images, labels=rng.integers(0, 2, size=64))
    with pytest.raises(ConfigError, match=r"the images at .*a\.npz changed since the checkpoint was written \(the "
                                          r"same count and shape; sampled pixels differ") as e:
        train(apply_overrides(cfg, {"train.max_steps": 5}), out_dir=tmp_path / "run", resume="latest", log=quiet)
    assert "--data" not in str(e.value) and "--init-from" not in str(e.value)  # no export route for this family
    # an image added, or a class folder renamed, under the same path: said as changed with what changed, not as
    # other data with the advice to pass the path already given
    np.savez(tmp_path / "a.npz", images=np.concatenate([images, images[:1]]), labels=rng.integers(0, 3, size=65))
    for model, changed in ((cfg, r"\(64 images then, 65 now: files added"),
                           (conditional, r"\(64 images then, 65 now; classes 0, 1 then, 0, 1, 2 now: files added")):
        with pytest.raises(ConfigError, match=r"the images at .*a\.npz changed since the checkpoint was written "
                           + changed) as e:
            train(apply_overrides(model, {"data.source": str(tmp_path / "a.npz"), "train.max_steps": 5}),
                  out_dir=tmp_path / ("run" if model is cfg else "cond"), resume="latest", log=quiet)
        assert "Put its images back" in str(e.value) and "--data" not in str(e.value)
    with pytest.raises(ConfigError, match=r"its run trained on .*a\.npz .*Resume on its data \(--data .*a\.npz, "
                                          r"without --resize\)"):  # other options at the same path: other data
        train(apply_overrides(cfg, {"data.resize": 8, "train.max_steps": 5}), out_dir=tmp_path / "run",
              resume="latest", log=quiet)


def test_a_seed_changed_by_a_preset_on_resume_says_the_preset_replaces_the_config(tmp_path):
    cfg = _cfg(_npz(tmp_path / "a.npz"), max_steps=2, checkpoint_every=2, seed=5)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    with pytest.raises(ConfigError, match=r"train.seed was 5 in the checkpoint but is 0 now.*A --preset \(here "
                                          r"cpu-demo, .*replaces the run's whole config on resume"):
        train(apply_overrides(cfg, {"preset": "cpu-demo", "train.seed": 0, "train.max_steps": 3}),
              out_dir=tmp_path / "run", resume="latest", log=quiet)
    # the run's own preset given again replaces its config too (the preset's seed 0): "resume without --seed" alone
    # was advice already followed
    with pytest.raises(ConfigError, match=r"Pass --seed 5 \(or resume without --seed and without --preset tiny: a "
                                          r"preset given on resume replaces the run's whole config"):
        train(apply_overrides(cfg, {"preset": "tiny", "train.seed": 0, "train.max_steps": 3}),
              out_dir=tmp_path / "run", resume="latest", log=quiet)


def test_hflip_switched_on_resume_is_said(tmp_path):
    """Flips change every step's batch from there; a resume that switches them on or off goes on, saying so."""
    cfg = _cfg(_npz(tmp_path / "a.npz"), max_steps=2, checkpoint_every=2)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    lines = []
    train(apply_overrides(cfg, {"data.hflip": True, "train.max_steps": 3}), out_dir=tmp_path / "run",
          resume="latest", log=lines.append)
    assert ("note: data.hflip was off in the checkpoint's run and is on now: the steps from here see other flips "
            "than an uninterrupted run would (--no-hflip keeps its own)") in lines


def test_a_learning_rate_or_ema_decay_changed_on_resume_is_said_with_the_old_value(tmp_path):
    """--lr and --ema-decay on resume went on silently, and config.json, rewritten, kept no trace of the old ones."""
    cfg = _cfg(_npz(tmp_path / "a.npz"), max_steps=2, checkpoint_every=2)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    lines = []
    train(apply_overrides(cfg, {"train.lr": 5e-3, "train.ema_decay": 0.5, "train.max_steps": 3}),
          out_dir=tmp_path / "run", resume="latest", log=lines.append)
    said = [line for line in lines if line.startswith("note: this resume changes")]
    assert said == [f"note: this resume changes train.lr {cfg.train.lr!r} -> 0.005; train.ema_decay "
                    f"{cfg.train.ema_decay!r} -> 0.5: the steps from here train with the new values (config.json now "
                    f"holds them; {tmp_path / 'run' / 'checkpoints' / 'ckpt_000000002.pt'} keeps the run's own)"]
    lines.clear()
    train(apply_overrides(cfg, {"train.lr": 5e-3, "train.ema_decay": 0.5, "train.max_steps": 4}),
          out_dir=tmp_path / "run", resume="latest", log=lines.append)
    assert not [line for line in lines if "this resume changes" in line]  # the run's values now


def test_the_resume_refusals_advice_names_what_this_command_changed():
    """Another --split of the same source was advised as `--data fashion-mnist`, the data already given; a seed
    given without a preset was told to drop a --preset the command did not have (the run's own, read back)."""
    from types import SimpleNamespace

    from fastddpm.trainer.resume_checks import check_same_inputs

    run_cfg = apply_overrides(get_preset("tiny"), {"data.source": "fashion-mnist", "train.seed": 5})
    saved = {"source": "fashion-mnist", "num_images": 60000, "image_shape": [1, 28, 28], "class_names": ["a", "b"],
             "sample_sha256": "s1", "pixels_sha256": "p1"}
    resumed = SimpleNamespace(config=run_cfg, meta={"data": saved}, path="ckpt_000000002.pt")
    test_split = {**saved, "num_images": 10000, "sample_sha256": "s2", "pixels_sha256": "p2"}
    with pytest.raises(ConfigError, match=r"Resume on its data \(--data fashion-mnist --split train\)"):
        check_same_inputs(resumed, apply_overrides(run_cfg, {"data.split": "test"}), test_split, quiet)
    with pytest.raises(ConfigError, match=r"Pass --seed 5 \(or resume without --seed\), or start") as e:
        check_same_inputs(resumed, apply_overrides(run_cfg, {"train.seed": 7}), saved, quiet)
    assert "--preset" not in str(e.value)
    with pytest.raises(ConfigError, match=r"without --seed and without --preset tiny"):  # the preset's own seed 0
        check_same_inputs(resumed, get_preset("tiny"), saved, quiet)
    # a resize mode without a resize reads the same images: a changed folder is still said as changed
    changed = {**saved, "num_images": 60001, "sample_sha256": "s3", "pixels_sha256": "p3"}
    with pytest.raises(ConfigError, match=r"the images at fashion-mnist changed .*60000 images then, 60001 now"):
        check_same_inputs(resumed, apply_overrides(run_cfg, {"data.resize_mode": "stretch"}), changed, quiet)
