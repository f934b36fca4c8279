"""fastddpm.evaluate from Python: the sampling choices `fastddpm eval` takes (--eta, --spacing, --precision,
--weights), measured by the same code."""

import json

import numpy as np
import pytest

import fastddpm
from conftest import read_fmnist
from fastddpm.cli import main
from fastddpm.config import ConfigError
from fastddpm.eval import features
from fastddpm.eval.classifier import ClassifierRecipe


@pytest.fixture
def fast_feature_net(monkeypatch):
    """A feature network trained in a few steps: these tests compare the API with the command, not the features'
    quality (the recipe is part of the network's cache key, so no other test gets this one)."""
    monkeypatch.setattr(features, "ClassifierRecipe", lambda: ClassifierRecipe(min_steps=2, epochs=0.01))


def _tiny_run(tmp_path, n_images: int, steps: int):
    """A tiny run of `steps` steps on the first `n_images` Fashion-MNIST training images saved to data.npz:
    (images, labels, the .npz's path, the run's folder)."""
    images, labels = read_fmnist(n_images)
    src = tmp_path / "data.npz"
    np.savez(src, images=images, labels=labels)
    run = tmp_path / "run"
    fastddpm.train("tiny", out=run, data=str(src), max_steps=steps, num_sample_images=4, sample_steps=2,
                   progress=False, log=None)
    return images, labels, src, run


def test_evaluate_takes_evals_eta_spacing_precision_and_weights(tmp_path, fast_feature_net):
    """evaluate() had no eta, spacing, precision or weights (a TypeError), where `fastddpm eval` and Model.sample
    take them: the same choices now give the command's numbers, and a bad one is refused naming it."""
    images, labels, src, run = _tiny_run(tmp_path, 120, 2)
    choices = dict(num_samples=10, sampler="ddim", steps=2, device="cpu")
    metrics = fastddpm.evaluate(run, eta=1.0, spacing="karras", precision="fp32", weights="model", log=None,
                                **choices)
    assert metrics["sampling"]["eta"] == 1.0 and metrics["sampling"]["spacing"] == "karras"
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--sampler", "ddim", "--steps", "2",
                 "--eta", "1", "--spacing", "karras", "--precision", "fp32", "--weights", "model", "--device", "cpu",
                 "--no-progress", "--out", str(tmp_path / "cli")]) == 0
    (saved,) = (tmp_path / "cli").glob("*.json")
    cli = json.loads(saved.read_text())
    assert metrics["fid"] == cli["fid"] and metrics["precision"] == cli["precision"]
    plain = fastddpm.evaluate(run, log=None, **choices)  # the choices were used, not dropped
    assert plain["sampling"]["eta"] == 0.0 and plain["fid"] != metrics["fid"]
    for kw, message in ((dict(precision="half"), r"^evaluate: precision='half' is not one of auto, fp32, bf16, fp16$"),
                        (dict(spacing="linear"), r"^evaluate: spacing='linear' is not one of trailing, karras"),
                        (dict(eta="1"), r"^evaluate: eta='1' must be a number$"),
                        (dict(weights="raw"), r"^fastddpm.load: weights='raw' is not one of ema, model$")):
        with pytest.raises(ConfigError, match=message):
            fastddpm.evaluate(run, log=None, **choices, **kw)
    with pytest.raises(ConfigError, match=r"^evaluate: spacing='karras': sampler='ddpm' walks every one"):
        fastddpm.evaluate(run, num_samples=10, sampler="ddpm", spacing="karras", log=None)


def test_evaluate_of_a_run_whose_data_is_gone_names_where_it_trained_and_data_source(tmp_path, capsys):
    """The run's data moved or deleted since training: `fastddpm eval` adds where the run trained and --data SOURCE
    to the data's error, fastddpm.evaluate said only "no such file"; now both, each in its own spelling."""
    from fastddpm.data import DataError

    images, labels, src, run = _tiny_run(tmp_path, 40, 1)
    src.unlink()
    hint = f"(The checkpoint was trained on data.source={str(src)!r}; pass data='SOURCE' to evaluate against"
    with pytest.raises(DataError, match="no such file") as raised:
        fastddpm.evaluate(run, num_samples=10, steps=1, device="cpu", log=None)
    assert hint in str(raised.value)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--steps", "1", "--no-progress"]) == 2
    assert hint.replace("data='SOURCE'", "--data SOURCE") in capsys.readouterr().err
    with pytest.raises(DataError, match="no such file") as raised:  # data the user named: its error alone
        fastddpm.evaluate(run, data=str(tmp_path / "nowhere.npz"), num_samples=10, steps=1, device="cpu", log=None)
    assert "The checkpoint was trained on" not in str(raised.value)


def test_evaluate_against_data_of_another_shape_names_a_fix_the_api_can_take(tmp_path, fast_feature_net):
    """Reference data of another shape named only `fastddpm eval ... --resize 28 --image-mode L`, options
    fastddpm.evaluate did not have: it names the API's spelling too, and that call scores."""
    images, labels, src, run = _tiny_run(tmp_path, 120, 1)
    rgb = tmp_path / "rgb32.npz"  # the same images as 3x32x32
    np.savez(rgb, images=np.pad(np.repeat(images, 3, axis=1), ((0, 0), (0, 0), (2, 2), (2, 2))), labels=labels)
    api_eval = dict(num_samples=10, steps=1, device="cpu", log=None)
    with pytest.raises(ConfigError, match=r"\(from Python: fastddpm.evaluate\(\.\.\., resize=28, image_mode='L'\)\)$"):
        fastddpm.evaluate(run, data=str(rgb), **api_eval)
    with pytest.warns(UserWarning, match="this evaluation reads other data"):
        assert fastddpm.evaluate(run, data=str(rgb), resize=28, image_mode="L", **api_eval)["fid"] >= 0
