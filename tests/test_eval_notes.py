"""What `fastddpm eval` says about the data it scores against: a note when the reference images are not the ones
the checkpoint's run trained on, and the feature network's notes said once each, naming where its accuracy was
measured and on how many images."""

import re

import numpy as np
import pytest
from PIL import Image

from conftest import read_fmnist
from fastddpm.cli import main
from fastddpm.config import apply_overrides, get_preset
from fastddpm.eval import features
from fastddpm.eval.classifier import ClassifierRecipe
from fastddpm.trainer.loop import train


def quiet(*args):
    pass


@pytest.fixture
def fast_feature_net(monkeypatch):
    """A feature network trained in a few steps: these tests read what eval says, not how good its features are
    (the recipe is part of the network's cache key, so no other test gets this one)."""
    monkeypatch.setattr(features, "ClassifierRecipe", lambda: ClassifierRecipe(min_steps=2, epochs=0.01))


def tiny_run(source, run, **model):
    over = {"data.source": str(source), "train.progress": False, "train.checkpoint_every": None,
            "train.num_sample_images": 4, "train.sample_steps": 2, "train.max_steps": 1,
            **{f"model.{k}": v for k, v in model.items()}}
    train(apply_overrides(get_preset("tiny"), over), out_dir=run, log=quiet)
    return run


EVAL = ["--num-samples", "10", "--steps", "1", "--no-progress"]


def test_eval_against_data_changed_since_training_says_so_naming_both_sides(tmp_path, fast_feature_net, capsys):
    images, labels = read_fmnist(120)
    src = tmp_path / "data.npz"
    np.savez(src, images=images, labels=labels)
    run = tiny_run(src, tmp_path / "run")
    capsys.readouterr()
    # the same images moved elsewhere are the same data: no note
    moved = tmp_path / "moved.npz"
    np.savez(moved, images=images, labels=labels)
    assert main(["eval", "--checkpoint", str(run), "--data", str(moved), *EVAL]) == 0
    assert "learned" not in capsys.readouterr().out
    # the file changed under its path: scored (the user may mean it), and said, with both sides' records
    np.savez(src, images=images[:, :, ::-1].copy(), labels=labels)
    assert main(["eval", "--checkpoint", str(run), *EVAL]) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if "learned" in line]
    assert note.startswith(f"note: the images at {src} changed since the checkpoint was written: ")
    assert "120 images (1, 28, 28)" in note and "other images than the model learned" in note
    assert "--data SOURCE" in note
    from fastddpm.rundir.locate import locate

    saved = locate(str(run), weights="ema", what="--checkpoint").meta["data"]
    assert saved["pixels_sha256"] in note and saved["source"] == str(src)


def test_the_feature_networks_notes_are_true_and_said_once(tmp_path, fast_feature_net, capsys):
    """A folder with no test split and a bad file: the skipped files are said once, the accuracy names how many
    held-out training images it was measured on (not "real test images"), and no line doubles its punctuation."""
    images, labels = read_fmnist(130)
    src = tmp_path / "data.npz"
    np.savez(src, images=images, labels=labels)
    run = tiny_run(src, tmp_path / "run", conditional=True)
    root = tmp_path / "folder"
    for i, (image, label) in enumerate(zip(images, labels)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0]).save(root / str(label) / f"{i}.png")
    (root / "3" / "broken.png").write_bytes(b"not an image")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(root), "--skip-bad", *EVAL]) == 0
    said = capsys.readouterr()
    assert said.err.count("skipped 1 of 131 files") == 1
    out = said.out
    assert "real test images" not in out
    assert "(100.00% on 13 held-out training images)" in out or " on 13 held-out training images)" in out
    assert "note: a weak feature network (test accuracy " in out
    weak = next(line for line in out.splitlines() if line.startswith("note: a weak feature network"))
    assert " on 13 held-out training images, trained on 117 images)" in weak
    (no_test,) = [line for line in out.splitlines() if line.startswith("feature network: no test split (")]
    assert no_test.endswith(" has no splits); holding out part of train"), no_test
    for line in out.splitlines():
        line = line.replace("...", "")  # an ellipsis is no doubled punctuation
        assert ".)" not in line and ".;" not in line and ".." not in line, line



def _wide_run(tmp_path):
    """A one-step tiny run on 120 Fashion-MNIST images padded to 28x40 (a center crop and a stretch to 28x28
    differ), read center-cropped: (the .npz's path, the run's folder)."""
    images, labels = read_fmnist(120)
    src = tmp_path / "wide.npz"
    np.savez(src, images=np.pad(images, ((0, 0), (0, 0), (0, 0), (6, 6))), labels=labels)
    over = {"data.source": str(src), "data.resize": 28, "train.progress": False, "train.checkpoint_every": None,
            "train.num_sample_images": 4, "train.sample_steps": 2, "train.max_steps": 1}
    run = tmp_path / "run"
    train(apply_overrides(get_preset("tiny"), over), out_dir=run, log=quiet)
    return src, run


def test_eval_reading_the_runs_data_with_other_options_says_which(tmp_path, fast_feature_net, capsys):
    """The same file read another way (--resize-mode stretch where the run center-cropped) is not its files changed:
    the note names the options and the fix is to leave them out."""
    src, run = _wide_run(tmp_path)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--resize-mode", "stretch", *EVAL]) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if "learned" in line]
    assert note.startswith(f"note: this evaluation reads {src} with other options (--resize-mode stretch): ")
    assert note.endswith("for its score on its own data, leave out --resize-mode.")


def test_evaluate_from_python_warns_when_the_data_differs_from_the_runs(tmp_path, fast_feature_net):
    """fastddpm.evaluate said nothing where `fastddpm eval` notes that the reference images are not the ones the run
    trained on: a UserWarning now (it survives log=None), spelling the fix as the API's data='SOURCE'."""
    import warnings

    import fastddpm

    images, labels = read_fmnist(120)
    src = tmp_path / "data.npz"
    np.savez(src, images=images, labels=labels)
    run = tiny_run(src, tmp_path / "run")
    moved = tmp_path / "moved.npz"  # the same images elsewhere: no warning
    np.savez(moved, images=images, labels=labels)
    api_eval = dict(num_samples=10, steps=1, device="cpu", log=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fastddpm.evaluate(run, data=str(moved), **api_eval)
    other = tmp_path / "other.npz"
    np.savez(other, images=images[::-1].copy(), labels=labels[::-1].copy())
    with pytest.warns(UserWarning, match=r"^this evaluation reads other data: the checkpoint's run trained on ") as w:
        fastddpm.evaluate(run, data=str(other), **api_eval)
    (note,) = [str(x.message) for x in w if "learned" in str(x.message)]
    assert f"this evaluation's reference is {other}" in note and "120 images (1, 28, 28)" in note
    assert note.endswith("evaluate against a copy of those images (data='SOURCE').") and "--" not in note
    assert w[0].filename == __file__  # pointed at the caller's line, not inside fastddpm
    np.savez(src, images=images[:, :, ::-1].copy(), labels=labels)  # the run's own file, changed under its path
    with pytest.warns(UserWarning, match=rf"^the images at {re.escape(str(src))} changed since the checkpoint was "):
        fastddpm.evaluate(run, **api_eval)


def test_evaluate_from_python_reads_the_data_with_evals_options_and_warns_which(tmp_path, fast_feature_net):
    """fastddpm.evaluate had none of `fastddpm eval`'s --resize, --resize-mode, --image-mode, --skip-bad and
    --reference-split (a TypeError): it takes them, and the run's data read another way is warned about naming the
    option as the API spells it."""
    import fastddpm
    from fastddpm.config import ConfigError

    src, run = _wide_run(tmp_path)
    api_eval = dict(num_samples=10, steps=1, device="cpu", log=None)
    with pytest.warns(UserWarning, match=rf"^this evaluation reads {re.escape(str(src))} with other options "
                                         r"\(resize_mode='stretch'\): ") as w:
        metrics = fastddpm.evaluate(run, resize_mode="stretch", reference_split="train", **api_eval)
    assert str(w[0].message).endswith("for its score on its own data, leave out resize_mode.")
    assert metrics["fid"] >= 0
    with pytest.raises(ConfigError, match=r"resize_mode='sideways'"):
        fastddpm.evaluate(run, resize_mode="sideways", **api_eval)
    with pytest.raises(ConfigError, match=r"^evaluate: reference_split='val' is not one of train, test"):
        fastddpm.evaluate(run, reference_split="val", **api_eval)
