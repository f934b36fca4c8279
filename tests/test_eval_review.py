"""`fastddpm eval` flags and inputs found wrong in review: --sampler ddpm with --spacing (refused, as `sample` does),
evaluations at two --eta values (two files, not one overwritten), reference data too small for a covariance and
3-NN radii (refused up front, not a traceback after training a classifier); and the Frechet distance against
pytorch-fid's formula on near-singular covariances."""

import json

import numpy as np
import pytest

from fastddpm.cli import main
from fastddpm.config import apply_overrides, get_preset
from fastddpm.data import DataError, prepare
from fastddpm.trainer.loop import train


def quiet(*args):
    pass


@pytest.fixture(scope="module")
def one_step_run(fmnist_npz, tmp_path_factory):
    """A tiny unconditional run trained one step on 256 real Fashion-MNIST images."""
    run = tmp_path_factory.mktemp("review-run") / "run"
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.checkpoint_every": None, "train.num_sample_images": 4,
                                               "train.sample_steps": 2, "train.max_steps": 1})
    train(cfg, out_dir=run, log=quiet)
    return run


def test_eval_refuses_a_spacing_with_the_ddpm_sampler(one_step_run, tmp_path, capsys):
    """DDPM walks all T timesteps: a --spacing would be ignored and only name the output file."""
    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(one_step_run), "--sampler", "ddpm", "--spacing", "karras",
                 "--num-samples", "10", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--spacing karras: --sampler ddpm walks every one of the 1000 timesteps and takes no spacing" in err
    assert "drop --spacing, or pick a few-step sampler" in err
    assert not out.exists()


def test_evaluations_at_two_etas_keep_both_results(one_step_run, tmp_path):
    out = tmp_path / "out"
    base = ["eval", "--checkpoint", str(one_step_run), "--sampler", "ddim", "--steps", "2", "--num-samples", "10",
            "--out", str(out), "--no-progress"]
    assert main(base) == 0
    assert main([*base, "--eta", "0.5"]) == 0
    names = sorted(p.name for p in out.glob("eval_*.json"))
    assert names == ["eval_ddim2-eta0.5_n10_seed0_step1.json", "eval_ddim2_n10_seed0_step1.json"]
    etas = [json.loads((out / n).read_text())["sampling"]["eta"] for n in names]
    assert etas == [0.5, 0.0]
    assert (out / "eval_ddim2-eta0.5_n10_seed0_step1.png").is_file()


def test_reference_data_too_small_for_the_metrics_is_refused_up_front(one_step_run, tmp_path, capsys):
    """3 real images: no 3-NN radius exists (each image has 2 others). Refused before a classifier is trained on
    them, naming the count and the fix, instead of a ValueError traceback from the precision/recall code."""
    from conftest import read_fmnist

    images, labels = read_fmnist(3)
    three = tmp_path / "three.npz"
    np.savez(three, images=images, labels=labels)
    assert main(["eval", "--checkpoint", str(one_step_run), "--data", str(three), "--num-samples", "10",
                 "--steps", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "three.npz, split train) has 3 image(s)" in captured.err and "at least 10" in captured.err
    assert "--data SOURCE" in captured.err
    assert "feature network" not in captured.out  # no classifier was trained on 3 images


def _sqrtm_general(a):
    w, v = np.linalg.eig(a.astype(complex))
    return (v * np.sqrt(w)) @ np.linalg.inv(v)


def _pytorch_fid_formula(mu1, s1, mu2, s2, eps=1e-6):
    """pytorch-fid's calculate_frechet_distance, with a general matrix square root in place of scipy's sqrtm."""
    covmean = _sqrtm_general(s1 @ s2)
    if not np.isfinite(covmean).all():
        offset = np.eye(s1.shape[0]) * eps
        covmean = _sqrtm_general((s1 + offset) @ (s2 + offset))
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean.real))


@pytest.mark.parametrize("n, d", [(500, 16), (40, 16), (12, 48)])
def test_frechet_distance_matches_pytorch_fids_formula_on_singular_covariances(n, d):
    """Dead feature units (zero columns) and fewer samples than dimensions make the covariances singular."""
    from fastddpm.eval.frechet import frechet_distance, mean_cov

    rng = np.random.default_rng(n + d)
    a = rng.normal(size=(n, d))
    b = rng.normal(size=(n, d)) * 1.3 + 0.2
    a[:, :3] = 0.0
    b[:, -2:] = 0.0
    mu1, s1 = mean_cov(a)
    mu2, s2 = mean_cov(b)
    np.testing.assert_allclose(s1, np.cov(a, rowvar=False), atol=1e-12)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_pytorch_fid_formula(mu1, s1, mu2, s2), rel=1e-6)


def test_a_conditional_model_against_unlabelled_data_is_not_sent_to_inception_features(fmnist_npz, tmp_path,
                                                                                         capsys):
    """Class accuracy needs the dataset's classifier whatever the feature space of FID: the error for unlabelled
    data must not name --features inception as the fix when that flag is already given and cannot help."""
    from conftest import read_fmnist

    run = tmp_path / "run"
    _one_step_conditional_run(fmnist_npz, run)
    images, _ = read_fmnist(64)
    unlabelled = tmp_path / "unlabelled.npz"
    np.savez(unlabelled, images=images)
    for features in ([], ["--features", "inception"]):
        assert main(["eval", "--checkpoint", str(run), "--data", str(unlabelled), *features, "--num-samples", "10",
                     "--steps", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "the model is conditional" in err and "unlabelled.npz, which has none" in err, err
        assert "--data SOURCE" in err and "`fastddpm eval --features inception`" not in err


def _one_step_conditional_run(source, run) -> None:
    """A conditional tiny model trained one step on `source`, into `run`: a checkpoint for eval to refuse or score."""
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(source), "train.progress": False,
                                               "train.checkpoint_every": None, "train.num_sample_images": 4,
                                               "train.sample_steps": 2, "train.max_steps": 1,
                                               "model.conditional": True})
    train(cfg, out_dir=run, log=quiet)


def _class_folder(root, counts: dict[str, int]):
    """root/<name>/*.png of real Fashion-MNIST images, `counts[name]` of them in each class folder."""
    from conftest import read_fmnist
    from data_fixtures import make_class_folder

    images, _ = read_fmnist(sum(counts.values()))
    parts, start = {}, 0
    for name, n in counts.items():
        parts[name] = images[start:start + n, 0]
        start += n
    make_class_folder(root, parts)
    return root


@pytest.fixture(scope="module")
def named_conditional_run(tmp_path_factory):
    """A tiny conditional run trained one step on a folder of classes pullover/trouser/tshirt."""
    base = tmp_path_factory.mktemp("named-run")
    data = _class_folder(base / "garments", {"pullover": 30, "trouser": 34, "tshirt": 38})
    _one_step_conditional_run(data, base / "run")
    return base / "run"


def test_a_conditional_model_against_data_with_other_class_names_is_refused(named_conditional_run, tmp_path,
                                                                             capsys):
    """Class accuracy and per-class FID pair the model's classes with the data's by id: other names (or the same
    names under other ids) are refused naming both lists and the fix, before a classifier is trained."""
    other = _class_folder(tmp_path / "fruit", {"apple": 30, "mango": 34, "zebra": 38})
    reordered = tmp_path / "reordered.npz"
    prepared = prepare(str(other), progress=False)
    np.savez(reordered, images=np.asarray(prepared.images), labels=prepared.labels,
             class_names=np.array(["tshirt", "trouser", "pullover"]))
    for data, says in ((other, "other classes"), (reordered, "the same class names with other ids")):
        assert main(["eval", "--checkpoint", str(named_conditional_run), "--data", str(data), "--num-samples", "10",
                     "--steps", "1", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        captured = capsys.readouterr()
        assert says in captured.err, captured.err
        assert "['pullover', 'trouser', 'tshirt']" in captured.err and "--data SOURCE" in captured.err
        assert "feature network" not in captured.out  # refused before a classifier is trained
        assert ("['apple', 'mango', 'zebra']" if data == other else "['tshirt', 'trouser', 'pullover']") in captured.err
    assert not (tmp_path / "out").exists()


def test_class_names_are_compared_only_where_both_sides_have_names():
    """Integer names ("0", "1", ...: data without names, or folders 1/, 2/, 3/) are never compared."""
    from fastddpm.config import ConfigError
    from fastddpm.eval.evaluate import check_class_names

    check_class_names(("0", "1", "2"), ("pullover", "trouser", "tshirt"), where="x")
    check_class_names(("pullover", "trouser", "tshirt"), ("1", "2", "3"), where="x")
    check_class_names(("pullover", "trouser", "tshirt"), ("pullover", "trouser", "tshirt"), where="x")
    with pytest.raises(ConfigError, match=r"other classes: .*\['a', 'b'\].*\(x\) \['a', 'c'\]"):
        check_class_names(("a", "b"), ("a", "c"), where="x")
    check_class_names(("Cat", "dog"), ("cat", "Dog"), where="x")  # case aside, as --class matches names
    with pytest.raises(ConfigError, match=r"the same class names with other ids: .*\['B', 'a'\].*\['a', 'b'\]"):
        check_class_names(("B", "a"), ("a", "b"), where="x")
    # where case tells two classes apart it is compared: "Cat" and "cat" swapped are other ids, not one class
    with pytest.raises(ConfigError, match=r"the same class names with other ids: .*\['Cat', 'cat'\]"):
        check_class_names(("Cat", "cat"), ("cat", "Cat"), where="x")
    check_class_names(("Cat", "cat"), ("Cat", "cat"), where="x")
    check_class_names(("Cat", "cat", "dog"), ("Cat", "cat", "DOG"), where="x")  # the other names still ignore case


def test_a_one_class_dataset_trains_no_feature_classifier(tmp_path, capsys):
    """One class folder: the classifier's cross-entropy is zero whatever its weights, so its features would be
    random. Refused naming the data and Inception features, by eval and by --eval-every before training starts."""
    one = _class_folder(tmp_path / "one", {"pullover": 40})
    run = tmp_path / "run"
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(one), "train.progress": False,
                                               "train.checkpoint_every": None, "train.num_sample_images": 4,
                                               "train.sample_steps": 2, "train.max_steps": 1})
    with pytest.raises(DataError, match=r"one class \('pullover'\).*--features inception.*--inception PATH"):
        train(apply_overrides(cfg, {"train.eval_every_images": 16, "train.eval_samples": 10}),
              out_dir=tmp_path / "eval-every", log=quiet)
    assert not list((tmp_path / "eval-every").glob("**/ckpt_*"))  # failed before training, nothing saved
    train(cfg, out_dir=run, log=quiet)
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--steps", "1",
                 "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "has one class ('pullover')" in captured.err and "--features inception" in captured.err, captured.err
    assert "feature network: trained" not in captured.out


def test_per_class_notes_and_the_label_histogram_name_the_reference_datas_classes(tmp_path, capsys, monkeypatch):
    """A model with integer class names (an .npz without class_names) evaluated against named class folders
    whose counts all differ: the per-class note pairs each count with the name of the class it counts, and the
    JSON's reference.label_histogram is the real labels' (the classifier's predictions are recorded apart)."""
    counts = {"pullover": 30, "trouser": 34, "tshirt": 38}
    named = _class_folder(tmp_path / "garments", counts)
    prepared = prepare(str(named), progress=False)
    unnamed = tmp_path / "unnamed.npz"
    np.savez(unnamed, images=np.asarray(prepared.images), labels=prepared.labels)
    run = tmp_path / "run"
    _one_step_conditional_run(unnamed, run)
    from functools import partial

    from fastddpm.eval import features
    from fastddpm.eval.classifier import ClassifierRecipe

    # what is checked is which name each count gets, not the classifier's accuracy: 20 steps, not 200 (~20 s here)
    monkeypatch.setattr(features, "ClassifierRecipe", partial(ClassifierRecipe, min_steps=20, epochs=1.0))
    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(run), "--data", str(named), "--num-samples", "12", "--steps", "1",
                 "--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "pullover (30), trouser (34), tshirt (38)" in said, said
    reference = json.loads(next(out.glob("eval_*.json")).read_text())["reference"]
    assert reference["label_histogram"] == [30, 34, 38]
    assert sum(reference["predicted_label_histogram"]) == 102
