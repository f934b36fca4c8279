"""Evaluation end to end on real Fashion-MNIST slices: `fastddpm eval` on a tiny run (JSON, grid, labels, errors
that name the fix), `train --eval-every` (records, curve, clocks that exclude evaluation, a run that is otherwise
unchanged), a longer-trained model scoring better than an untrained one, and `bench quality --quick`."""

import json
import time

import numpy as np
import pytest
import torch
from eval_fixtures import fmnist_splits  # noqa: F401 (a fixture)

from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, get_preset
from fastddpm.eval import during_training
from fastddpm.eval.classifier import FEATURES_LABEL
from fastddpm.rundir.checkpoint import load_checkpoint, list_checkpoints
from fastddpm.rundir.metrics import read_metrics
from fastddpm.trainer.loop import train

from conftest import needs_bf16_gpu


def quiet(*args):
    pass


# The tiny U-Net without its attention: at 28x28 (over 784 positions) it is most of a CPU step's and a sampler
# step's time, and these tests are about the evaluation, not the model (tests/test_sdpa_shapes.py tests attention).
def tiny_cfg(source, **train):
    over = {"data.source": str(source), "train.progress": False, "train.checkpoint_every": None,
            "train.num_sample_images": 4, "train.sample_steps": 2, "model.attention": False}
    over.update({f"train.{k}": v for k, v in train.items()})
    return apply_overrides(get_preset("tiny"), over)


@pytest.fixture(scope="session")
def evaluated_run(fmnist_splits, tmp_path_factory):
    """A tiny CLI run evaluated every 160 images (10 steps), 40 steps in all (without attention, as tiny_cfg)."""
    run = tmp_path_factory.mktemp("eval-run") / "run"
    rc = main(["train", "--data", str(fmnist_splits), "--out", str(run), "--preset", "tiny", "--max-steps", "40",
               "--log-every", "5", "--eval-every", "160", "--eval-samples", "32", "--eval-steps", "4",
               "--num-sample-images", "4", "--no-attention", "--no-progress"])
    assert rc == 0
    return run


def test_eval_every_writes_records_and_the_curve(evaluated_run):
    records = read_metrics(evaluated_run / "metrics.jsonl")
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["images_seen"] for r in evals] == [160, 320, 480, 640]
    for r in evals:
        assert r["fid"] > 0 and 0 <= r["precision"] <= 1 and 0 <= r["recall"] <= 1
        assert r["wall_s"] > 0 and r["eval_s"] > 0 and r["features_label"] == FEATURES_LABEL
    assert [r["wall_s"] for r in evals] == sorted(r["wall_s"] for r in evals)
    assert all("loss" in r for r in records if r.get("event") != "eval")  # loss lines are unchanged
    full = read_metrics(evaluated_run / "eval.jsonl")
    assert len(full) == 4 and full[0]["coverage"]["label_histogram"] and full[0]["sampling"]["steps"] == 4
    assert (evaluated_run / "eval_curve.png").stat().st_size > 1000


def test_charts_leave_the_callers_pyplot_backend_alone(tmp_path):
    """A chart drawn from a notebook (through the Python API) must not switch its inline backend to Agg: the charts
    use matplotlib's object API, never pyplot."""
    import matplotlib

    from fastddpm.eval.curve import write_curve

    before = matplotlib.get_backend()
    path = write_curve([{"fid": 30.0, "wall_s": 1.0, "images_seen": 10},
                        {"fid": 20.0, "wall_s": 2.0, "images_seen": 20}],
                       tmp_path / "c.png", title="t", log=lambda *a: None)
    assert path.stat().st_size > 1000 and matplotlib.get_backend() == before
    assert not list(tmp_path.glob(".*.tmp.png"))  # written under a temporary name, then renamed


@pytest.mark.parametrize("values, expected", [([12.1, 24.4], {"12", "14", "20"}),  # FID, under a decade
                                               ([0.06, 0.5], {"0.1", "0.2", "0.4"}),  # a loss
                                               ([0.5, 300.0], {"1", "10", "100"})])  # several decades
def test_log_axes_are_labelled_in_plain_numbers(tmp_path, values, expected):
    """matplotlib's default writes a log axis's labels as 1.2x10^1 or 4e-01; fastddpm's charts write 12 and 0.4,
    on the ticks matplotlib would label."""
    from fastddpm import charts

    fig = charts.figure(5, 3)
    ax = fig.subplots()
    ax.plot([0, 1], values)
    charts.log_y(ax)
    charts.save(fig, tmp_path / "log.png")  # draws, so the formatters have seen the axis' range
    labels = {t.get_text() for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True)} - {""}
    assert expected <= labels, labels
    assert not any("e" in s or "times" in s or "^" in s for s in labels), labels


def test_a_log_x_axis_is_labelled_in_plain_numbers_too(tmp_path):
    """The samplers' plot puts network calls (5 to 1,000) on a log x axis: 10 and 100, not 10^1 and 10^2."""
    from fastddpm import charts

    fig = charts.figure(5, 3)
    ax = fig.subplots()
    ax.plot([5, 1000], [1, 2])
    charts.log_x(ax)
    charts.save(fig, tmp_path / "log.png")
    labels = {t.get_text() for t in ax.get_xticklabels(minor=False)} - {""}
    assert {"10", "100", "1000"} <= labels, labels
    assert not any("e" in s or "times" in s or "^" in s for s in labels), labels


def test_eval_cli_end_to_end(evaluated_run, capsys):
    rc = main(["eval", "--checkpoint", str(evaluated_run), "--num-samples", "48", "--steps", "4",
               "--batch-size", "32", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert FEATURES_LABEL in out and "samples/s" in out and "classifier test accuracy" in out
    result = json.loads((evaluated_run / "eval" / "eval_dpmpp-2m-sde4_n48_seed0_step40.json").read_text())
    assert result["schema"] == "fastddpm-eval-1" and result["fid"] > 0
    assert 0 <= result["precision"] <= 1 and 0 <= result["recall"] <= 1 and result["pr"]["k"] == 3
    assert result["features"]["label"] == FEATURES_LABEL
    assert result["features"]["comparable_to_published_inception_fid"] is False
    assert result["features"]["test_accuracy"] > 0.5 and result["coverage"]["classes_present"] > 0
    assert result["checkpoint"]["step"] == 40 and result["sampling"]["num_samples"] == 48
    assert result["sampling"]["drawn"] == 64 and result["sampling"]["samples_per_s"] > 0
    assert result["reference"]["num_images"] == 2000 and result["reference"]["split"] == "train"
    assert (evaluated_run / "eval" / "eval_dpmpp-2m-sde4_n48_seed0_step40.png").stat().st_size > 100
    assert result["environment"]["torch"] == torch.__version__


def test_each_checkpoint_and_choice_gets_its_own_eval_files(fmnist_splits, tmp_path, capsys):
    """Successive checkpoints of one run, and the raw weights beside the EMA, are kept side by side: the file name
    carries the step and each non-default choice."""
    run = tmp_path / "run"
    train(tiny_cfg(fmnist_splits, max_steps=4, checkpoint_every=2), out_dir=run, log=quiet)
    base = ["--num-samples", "10", "--steps", "1", "--no-progress"]
    step2 = next(p for p in list_checkpoints(run / "checkpoints") if "000000002" in p.name)
    assert main(["eval", "--checkpoint", str(step2), *base]) == 0
    assert main(["eval", "--checkpoint", str(run), *base]) == 0
    assert main(["eval", "--checkpoint", str(run), "--weights", "model", *base]) == 0
    names = sorted(p.name for p in (run / "eval").glob("eval_*.json"))
    assert names == ["eval_dpmpp-2m-sde1_n10_seed0_step2.json", "eval_dpmpp-2m-sde1_n10_seed0_step4.json",
                     "eval_dpmpp-2m-sde1_n10_seed0_step4_model.json"]
    steps = [json.loads((run / "eval" / n).read_text())["checkpoint"] for n in names]
    assert [(c["step"], c["weights"]) for c in steps] == [(2, "ema"), (4, "ema"), (4, "model")]
    # another precision samples other floats: beside the default's file, not over it; a file as --out is refused
    # before anything is sampled (it failed after sampling and scoring, losing the result)
    assert main(["eval", "--checkpoint", str(run), "--precision", "bf16", *base]) == 0
    assert (run / "eval" / "eval_dpmpp-2m-sde1_n10_seed0_step4_bf16.json").is_file()
    (tmp_path / "a-file").write_text("x")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--out", str(tmp_path / "a-file"), *base]) == 2
    err = capsys.readouterr()
    assert "error: --out " in err.err and "a-file: is a file" in err.err and "sampling" not in err.out
    assert main(["eval", "--checkpoint", str(run), "--out", str(tmp_path / "a-file" / "under"), *base]) == 2
    assert "a-file is a file)" in capsys.readouterr().err


def test_eval_resizes_and_converts_other_data_to_the_models_shape(evaluated_run, tmp_path, monkeypatch):
    """--data of another size and mode, fitted with --resize and --image-mode as the shape error says."""
    from conftest import read_fmnist
    from fastddpm.eval import classifier, features

    # The feature network of these 120 images in 20 steps, not the recipe's minimum of 200: what is checked is that
    # the images reach it resized and converted, not how good its features are.
    monkeypatch.setattr(features, "ClassifierRecipe", lambda: classifier.ClassifierRecipe(min_steps=20))

    images, labels = read_fmnist(120)
    rgb = np.repeat(np.pad(images, ((0, 0), (0, 0), (2, 2), (2, 2))), 3, axis=1).transpose(0, 2, 3, 1)
    src = tmp_path / "rgb32.npz"
    np.savez(src, images=rgb, labels=labels)  # (N, 32, 32, 3)
    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(evaluated_run), "--data", str(src), "--resize", "28", "--image-mode",
                 "L", "--num-samples", "10", "--steps", "1", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "eval_dpmpp-2m-sde1_n10_seed0_step40_data-rgb32.npz_resize28_L.json").read_text())
    assert result["reference"]["num_images"] == 120 and result["fid"] > 0


def test_eval_skips_bad_reference_files_when_told(evaluated_run, tmp_path, capsys, monkeypatch):
    """Bad files in the real data stop an evaluation with the data layer's fix, --skip-bad, which is one of eval's
    own flags (it named a flag eval did not have); the result's name says the data was skipped into."""
    from PIL import Image

    from conftest import read_fmnist
    from fastddpm.eval import classifier, features

    # The feature network of each folder (with the stray file, then without) in 20 steps, not the recipe's minimum
    # of 200: what is checked of it is the note that 120 training images make it weak, which names the count.
    monkeypatch.setattr(features, "ClassifierRecipe", lambda: classifier.ClassifierRecipe(min_steps=20))

    images, labels = read_fmnist(120)
    root = tmp_path / "folder"
    for i, (image, label) in enumerate(zip(images, labels)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0]).save(root / str(label) / f"{i}.png")
    Image.fromarray(images[0][0]).save(root / "stray.png")  # beside the class folders: no label
    out = tmp_path / "out"
    args = ["eval", "--checkpoint", str(evaluated_run), "--data", str(root), "--num-samples", "10", "--steps", "1",
            "--out", str(out), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "stray.png" in err and "--skip-bad" in err
    assert main([*args, "--skip-bad"]) == 0
    # 120 images train a feature network too weak to trust: said beside its accuracy; the folder has no test
    # split, said without the fix for a --split nobody passed
    out_text = capsys.readouterr().out
    assert "note: a weak feature network" in out_text
    assert "feature network: no test split (" in out_text and "leave --split out" not in out_text
    (result,) = out.glob("eval_*_skip-bad.json")
    assert json.loads(result.read_text())["reference"]["num_images"] == 120
    import fastddpm  # the API says it too (it returned the FID without a word)

    (root / "stray.png").unlink()
    said = []
    fastddpm.evaluate(evaluated_run, data=str(root), num_samples=10, steps=1, device="cpu", log=said.append)
    assert any(line.startswith("note: a weak feature network (") and "inception='auto'" in line for line in said)


def test_a_weak_classifier_is_named_with_why():
    from fastddpm.eval.cli import weak_classifier

    assert weak_classifier({"test_accuracy": 0.91, "train_images": 60_000}) is None
    assert weak_classifier({"test_accuracy": 0.91}) is None  # a cache from before the count was recorded
    assert weak_classifier({"test_accuracy": 0.42, "train_images": 60_000}) == (
        "test accuracy 42.0%, trained on 60,000 images")
    assert weak_classifier({"test_accuracy": 0.95, "train_images": 120}) == "test accuracy 95.0%, trained on 120 images"


def test_eval_refuses_reference_data_with_another_number_of_classes(fmnist_splits, tmp_path, capsys):
    from conftest import read_fmnist

    run = tmp_path / "run"
    train(apply_overrides(tiny_cfg(fmnist_splits, max_steps=1), {"model.conditional": True}), out_dir=run, log=quiet)
    images, labels = read_fmnist(200)
    two = tmp_path / "two-classes.npz"
    np.savez(two, images=images, labels=labels % 2)
    assert main(["eval", "--checkpoint", str(run), "--data", str(two), "--num-samples", "10", "--steps", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "conditional on 10 classes" in err and "has 2" in err and "--data SOURCE" in err


def test_eval_names_every_choice_that_changes_its_result_and_refuses_non_finite_guidance():
    import argparse
    from types import SimpleNamespace

    from fastddpm.config import DataConfig
    from fastddpm.eval.cli import _guidance_list, _identity_suffix

    evaluator = SimpleNamespace(net=SimpleNamespace(name="inception-v3", identity="6726825d0a1b2c3d"),
                                ref=SimpleNamespace(meta={"split": "test"}))
    args = SimpleNamespace(weights="model", data="/data/other.npz", resize=32, resize_mode="stretch", image_mode="RGB",
                           skip_bad=True)
    suffix = _identity_suffix(args, {"step": 7}, evaluator, trained=DataConfig(source="fashion-mnist"))
    assert suffix == "_step7_model_inception-v3_ref-test_data-other.npz_resize32_stretch_RGB_skip-bad"
    # another Inception file (a local --inception, NVlabs' TorchScript) gives other features: its hash joins the name
    other = SimpleNamespace(net=SimpleNamespace(name="inception-v3", identity="ab12cd34ef567890"),
                            ref=SimpleNamespace(meta={"split": "train"}))
    plain_args = SimpleNamespace(weights="ema", data=None, resize=None, resize_mode=None, image_mode=None,
                                 skip_bad=None)
    assert _identity_suffix(plain_args, {"step": 7}, other, trained=DataConfig()) == "_step7_inception-v3-ab12cd34"
    plain = SimpleNamespace(weights="ema", data=None, resize=None, resize_mode=None, image_mode=None, skip_bad=None)
    own = SimpleNamespace(net=SimpleNamespace(name="fastddpm-features"), ref=SimpleNamespace(meta={"split": "train"}))
    assert _identity_suffix(plain, {"step": None}, own, trained=DataConfig()) == ""
    assert _guidance_list("0,1,2.5") == [0.0, 1.0, 2.5]
    for bad in ("2,nan", "inf", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="finite numbers >= 0"):
            _guidance_list(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="each guidance scale once, got '2,1,2.0'"):
        _guidance_list("2,1,2.0")


def test_eval_cli_errors_name_the_value_and_the_fix(evaluated_run, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nope") in err and "run directory" in err
    # a missing --inception file is the first and only thing said (not after a note on the sample count)
    assert main(["eval", "--checkpoint", str(evaluated_run), "--inception", str(tmp_path / "no.pth"),
                 "--num-samples", "10", "--out", str(tmp_path / "new")]) == 2
    said = capsys.readouterr()
    assert "no.pth: no such file" in said.err and "50,000" not in said.out + said.err
    assert not (tmp_path / "new").exists()  # nothing made for an evaluation that did not start
    rgb = tmp_path / "rgb.npz"
    np.savez(rgb, images=np.zeros((16, 32, 32, 3), np.uint8), labels=np.arange(16) % 2)
    assert main(["eval", "--checkpoint", str(evaluated_run), "--data", str(rgb), "--num-samples", "16",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "1x28x28" in err and "3x32x32" in err and "--data SOURCE" in err
    assert "fastddpm eval ... --resize 28 --image-mode L" in err  # flags eval takes
    assert main(["eval", "--checkpoint", str(evaluated_run), "--steps", "5000", "--no-progress"]) == 2
    assert "--steps 5000" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(evaluated_run), "--num-samples", "5", "--no-progress"]) == 2
    assert "--num-samples 5: at least 10" in capsys.readouterr().err


def test_an_evaluation_a_stop_signal_skipped_runs_on_resume_from_the_same_weights(fmnist_splits, tmp_path):
    """A SIGTERM on a step that is due an evaluation stops at once (no evaluation) and saves that step's weights;
    the resumed run evaluates them before it trains on, so its eval records equal an uninterrupted run's."""
    import os
    import signal

    from fastddpm.trainer.loop import TrainingInterrupted
    from fastddpm.trainer.setup import TrainHooks

    cfg = tiny_cfg(fmnist_splits, max_steps=12, eval_every_images=96, eval_samples=16, eval_steps=2)
    train(cfg, out_dir=tmp_path / "straight", log=quiet)

    def sigterm_at_the_first_evaluation(step):
        if step == 6:  # 96 images: due an evaluation
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        train(cfg, out_dir=tmp_path / "split", log=quiet, hooks=TrainHooks(after_step=sigterm_at_the_first_evaluation))
    assert not (tmp_path / "split" / "eval.jsonl").exists()  # stopped without evaluating
    train(cfg, out_dir=tmp_path / "split", resume="latest", log=quiet)
    evals = {run: [(r["step"], r["images_seen"], r["fid"]) for r in read_metrics(tmp_path / run / "metrics.jsonl")
                   if r.get("event") == "eval"] for run in ("straight", "split")}
    assert [e[:2] for e in evals["straight"]] == [(6, 96), (12, 192)]
    assert evals["split"] == evals["straight"]


def test_a_stop_signal_during_an_evaluation_stops_it_between_batches_and_it_runs_on_resume(fmnist_splits, tmp_path,
                                                                                          monkeypatch):
    """SIGINT while an --eval-every evaluation samples was heard only after it (minutes on a large one), then one
    more step trained: the evaluation stops before its next batch, the run at that step, and the resumed run
    evaluates those weights (again cut short by a second signal, then whole), so the records equal an uninterrupted
    run's."""
    import os
    import signal

    from fastddpm.eval import evaluate as evaluate_module
    from fastddpm.trainer.loop import TrainingInterrupted

    cfg = tiny_cfg(fmnist_splits, max_steps=12, eval_every_images=96, eval_samples=64, eval_steps=2,  # 2 batches
                   log_every=4)
    train(cfg, out_dir=tmp_path / "straight", log=quiet)
    real_sample, batches = evaluate_module.sample, []

    def interrupted_sample(*args, **kwargs):
        batches.append(1)
        if len(batches) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "sample", interrupted_sample)
    lines = []
    for _ in range(2):  # during the step-6 evaluation, then during that evaluation on resume
        batches.clear()
        with pytest.raises(TrainingInterrupted) as e:
            train(cfg, out_dir=tmp_path / "split", resume="latest", log=lines.append)
        assert e.value.exit_code == 130 and len(batches) == 1 and e.value.checkpoint.name == "ckpt_000000006.pt"
        assert not (tmp_path / "split" / "eval.jsonl").exists()
        assert "evaluation at 96 images stopped by the signal: it runs on resume, from this step's weights" in lines
    monkeypatch.setattr(evaluate_module, "sample", real_sample)
    train(cfg, out_dir=tmp_path / "split", resume="latest", log=quiet)
    evals = {run: [(r["step"], r["images_seen"], r["fid"]) for r in read_metrics(tmp_path / run / "metrics.jsonl")
                   if r.get("event") == "eval"] for run in ("straight", "split")}
    assert [e[:2] for e in evals["straight"]] == [(6, 96), (12, 192)]
    assert evals["split"] == evals["straight"]
    losses = {run: {r["step"]: r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in r}
              for run in ("straight", "split")}
    # logged every 4 steps: the stop at step 6 writes steps 5-6's line, the step-8 line holds 7-8, none is lost
    assert sorted(losses["straight"]) == [4, 8, 12] and sorted(losses["split"]) == [4, 6, 8, 12]
    assert losses["split"][4] == losses["straight"][4] and losses["split"][12] == losses["straight"][12]
    assert (losses["split"][6] + losses["split"][8]) / 2 == pytest.approx(losses["straight"][8], rel=1e-5)


def test_evaluation_changes_nothing_in_the_run_and_is_off_the_clock(fmnist_splits, tmp_path, monkeypatch):
    """Same losses, weights and RNG state with and without --eval-every; a planted 1000-second evaluation (on the
    clock the loop reads, so the test does not depend on how busy the CPU is) shows up in neither wall_s nor
    images_per_s."""
    real_evaluate = during_training.Evaluator.evaluate
    real_clock = time.perf_counter
    offset_s = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset_s[0])

    def slow_evaluate(self, *args, **kwargs):
        offset_s[0] += 1000.0
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(during_training.Evaluator, "evaluate", slow_evaluate)
    with_eval = train(tiny_cfg(fmnist_splits, max_steps=12, log_every=1, eval_every_images=96, eval_samples=16,
                               eval_steps=2), out_dir=tmp_path / "a", log=quiet)
    without = train(tiny_cfg(fmnist_splits, max_steps=12, log_every=1), out_dir=tmp_path / "b", log=quiet)
    rec_a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    rec_b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    losses_a = [r["loss"] for r in rec_a if "loss" in r]
    assert losses_a == [r["loss"] for r in rec_b] and len(losses_a) == 12
    sa, sb = load_checkpoint(with_eval.checkpoint), load_checkpoint(without.checkpoint)
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]) and torch.equal(sa["ema"][k], sb["ema"][k]), k
    assert torch.equal(sa["rng"]["torch_cpu"], sb["rng"]["torch_cpu"])
    evals = [r for r in rec_a if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [6, 12] and all(r["eval_s"] >= 1000 for r in evals)
    loss_lines = [r for r in rec_a if "loss" in r]
    assert max(r["wall_s"] for r in loss_lines) < 1000  # the step after an evaluation included
    step7 = next(r for r in loss_lines if r["step"] == 7)
    assert step7["images_per_s"] > 16 / 1000
    assert evals[1]["wall_s"] < 1000


def test_longer_training_scores_better_than_none(fmnist_splits, tmp_path):
    """The EMA weights after 100 steps against the untrained initial weights: FID drops, precision rises. (The
    U-Net without attention, tiny_cfg's, 70% of its CPU step at 28x28: the test is about the evaluation, not the
    model.)"""
    from fastddpm.config import resolve_model_shape
    from fastddpm.eval.evaluate import Evaluator
    from fastddpm.models import UNet
    from fastddpm.rng import derive_seed
    from fastddpm.sampling import load_for_sampling

    cfg = tiny_cfg(fmnist_splits, max_steps=100, lr=2e-3, log_every=50)
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    trained, cfg = load_for_sampling(tmp_path / "run")
    torch.manual_seed(derive_seed(cfg.train.seed, "init"))  # exactly the run's initial weights
    untrained = UNet(resolve_model_shape(cfg, (1, 1, 28, 28)).model).eval()
    evaluator = Evaluator.for_config(cfg, device=torch.device("cpu"), log=quiet)
    kw = dict(num_samples=96, steps=6, batch_size=48, device=torch.device("cpu"))
    before, _ = evaluator.evaluate(untrained, cfg, **kw)
    after, _ = evaluator.evaluate(trained, cfg, **kw)
    assert after["fid"] < 0.7 * before["fid"], (before["fid"], after["fid"])
    assert after["precision"] > before["precision"]


def test_bench_quality_quick(fmnist_splits, tmp_path):
    """The --quick pipeline (reference, target, fast run, time to target, report) on the shared slice; the
    numbers of a tiny CPU run mean nothing, only that every part runs and is recorded."""
    import argparse

    from fastddpm.bench.cli import _add_quality_parser, quality_settings
    from fastddpm.bench.quality import QUICK, QualitySettings, run_quality

    parser = argparse.ArgumentParser()
    _add_quality_parser(parser.add_subparsers(dest="bench_command"))
    settings = quality_settings(parser.parse_args(["quality", "--quick", "--eval-samples", "16"]))
    assert settings.preset == "tiny" and settings.eval_samples == 16 and settings.quick
    assert settings.fast_max_images == QUICK["fast_max_images"]

    # The whole 2,000-image slice (its feature network is already cached), a tenth of an epoch of reference,
    # measured on its own first (as a GPU session does), then the fast run against its target: 128 images, a
    # quarter of --quick's, still evaluated twice (every 64), as the fast runs of the options below. The fast
    # recipe drops the U-Net's attention (at 28x28 most of a CPU step's and a sampler step's time): a recipe may
    # change the model, and what is checked is that every part runs and is recorded.
    base = {**QUICK, "num_images": None, "reference_epochs": 0.1, "fast_max_images": 128,
            "fast_eval_every_images": 64, "fast_overrides": (*QUICK["fast_overrides"], "model.attention=false")}
    ref = run_quality(QualitySettings(**base, data=str(fmnist_splits), device="cpu", quick=True, reference_only=True),
                      tmp_path / "ref", argv=["test"], log=quiet)
    assert ref["fast"] is None and len(ref["reference"]["evals"]) == 1
    out = tmp_path / "quality"
    s = QualitySettings(**base, data=str(fmnist_splits), device="cpu", quick=True,
                        reference_from=str(tmp_path / "ref" / "quality.json"))
    result = run_quality(s, out, argv=["test"], log=quiet)
    saved = json.loads((out / "quality.json").read_text())
    assert saved["schema"] == "fastddpm-bench-quality-1" and saved["environment"]["command"] == ["test"]
    assert saved["target_fid"] == saved["reference"]["final_fid"] == ref["target_fid"] > 0
    assert len(saved["fast"]["evals"]) == 2
    hit = saved["fast"]["time_to_target"]
    assert hit is None or (hit["fid"] <= saved["target_fid"] and hit["wall_s"] > 0)
    assert saved["features"] == FEATURES_LABEL and "Time to quality" in (out / "quality.md").read_text()
    assert list_checkpoints(out / "fast" / "checkpoints")  # the end-of-run checkpoint only
    assert result["out_dir"] == str(out)
    with pytest.raises(ConfigError, match="eval_samples=32.*--eval-samples 32"):
        run_quality(QualitySettings(**{**base, "eval_samples": 64}, data=str(fmnist_splits), device="cpu",
                                    reference_from=str(tmp_path / "ref" / "quality.json")), tmp_path / "x", log=quiet)

    # An objective that samples best with another sampler is scored with it too, from the same weights, features
    # and noise: scoring those weights again with the shared sampler gives the run's own last FID to the digit.
    from fastddpm.bench import quality

    opt = run_quality(QualitySettings(**base, data=str(fmnist_splits), device="cpu", quick=True,
                                      fast_from=str(out / "quality.json"), options=("flow", "lr-x2")),
                      tmp_path / "opt", argv=["test"], log=quiet)
    flow, lr = opt["options"]
    assert "own_sampler" not in lr  # the fast recipe's objective: nothing to score again
    own = flow["own_sampler"]
    assert (own["sampler"], own["steps"], own["nfe"]) == ("heun", 10, 19) and own["fid"] > 0
    assert own["fid"] != flow["final_fid"]
    again = quality._score_own_sampler(flow, (s.eval_sampler, s.eval_steps), quiet)
    assert again["fid"] == pytest.approx(flow["final_fid"], rel=1e-6)
    report = (tmp_path / "opt" / "quality.md").read_text()
    assert f"| flow | {flow['final_fid']:.3f} | heun 10 | 19 | {own['fid']:.3f} |" in report
    assert f"FID at {s.eval_sampler} {s.eval_steps} ({s.eval_steps} calls)" in report


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_bf16_gpu
def test_cuda_eval_compiled_bf16_and_eval_every(evaluated_run, fmnist_splits, tmp_path, capsys):
    """On a GPU: `fastddpm eval` samples compiled in bf16 and agrees with the CPU's FID to within sampling noise
    of the precision change; --eval-every runs inside a CUDA-graph-captured training run."""
    rc = main(["eval", "--checkpoint", str(evaluated_run), "--num-samples", "64", "--steps", "4", "--batch-size",
               "32", "--device", "cuda", "--out", str(tmp_path / "gpu"), "--no-progress"])
    assert rc == 0
    gpu = json.loads((tmp_path / "gpu" / "eval_dpmpp-2m-sde4_n64_seed0_step40.json").read_text())
    assert gpu["sampling"]["compile"] is True and gpu["sampling"]["precision"] == "bf16"
    assert gpu["fid"] > 0 and gpu["sampling"]["steady_samples_per_s"] > 0
    cfg = tiny_cfg(fmnist_splits, max_steps=20, eval_every_images=160, eval_samples=32, eval_steps=4, device="cuda")
    # with attention on a GPU, where it is cheap: the captured step and the evaluation's compiled sampler hold it
    result = train(apply_overrides(cfg, {"model.attention": True}), out_dir=tmp_path / "run", log=quiet)
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "eval"]
    assert [r["images_seen"] for r in evals] == [160, 320] and result.step == 20


def test_the_sampling_estimate_counts_a_guided_scales_batches_twice(monkeypatch):
    """`eval --guidance 0,2`: the batches at W = 2 call the model on the conditional and the unconditional copy of
    each image, so the estimate after the first (unguided) batch counts them twice."""
    import time

    from fastddpm.eval.cli import _FirstBatchTimer

    clock = iter([0.0, 3.0])  # the first batch's first call, then the second batch's
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    lines = []
    timer = _FirstBatchTimer(lambda *a: None, calls_per_batch=2, costs=[1, 1, 2, 2], log=lines.append)
    for _ in range(3):
        timer()
    assert "the first of 4 batches took 3.0 s" in lines[0] and "the other 3 should take about 15 s" in lines[0]
    assert "a guided scale's batches count twice" in lines[0]
