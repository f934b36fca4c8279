"""IDX (MNIST / Fashion-MNIST layout): exact pixels and labels, and teaching errors for broken files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import (
    FASHION_DIR,
    cache_dir,  # noqa: F401  (fixture)
    idx_bytes,
    leftovers,
    make_idx_folder,
    needs_fashion,
    real_fashion_slice,
    rng_images,
    write_idx,
)
from fastddpm.data import DataError, prepare


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("split,key", [("train", "train"), ("test", "test"), ("t10k", "test")])
def test_idx_folder_reads_exact_pixels_and_labels(tmp_path: Path, cache_dir: Path, gz: bool, split: str,
                                                  key: str) -> None:
    written = make_idx_folder(tmp_path / "mnist", gz=gz)
    data = prepare(tmp_path / "mnist", split=split, cache_dir=cache_dir, progress=False)
    images, labels = written[key]
    assert data.images.dtype == np.uint8 and data.images.shape == (len(images), 1, 28, 28)
    np.testing.assert_array_equal(data.images[:, 0], images)
    np.testing.assert_array_equal(data.labels, labels.astype(np.int64))
    assert data.labels.dtype == np.int64
    assert data.class_names == [str(i) for i in range(int(labels.max()) + 1)]
    assert data.meta["kind"] == "idx" and data.meta["split"] == key
    assert (data.num_images, data.channels, data.height, data.width) == (len(images), 1, 28, 28)


def test_single_idx_images_file_finds_sibling_labels(tmp_path: Path, cache_dir: Path) -> None:
    written = make_idx_folder(tmp_path / "m")
    data = prepare(tmp_path / "m" / "t10k-images-idx3-ubyte.gz", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], written["test"][0])
    np.testing.assert_array_equal(data.labels, written["test"][1])


def test_single_idx_images_file_without_labels_is_unlabeled(tmp_path: Path, cache_dir: Path) -> None:
    images = rng_images(4, 5, 7)
    path = write_idx(tmp_path / "digits-images-idx3-ubyte", images, gz=False)
    data = prepare(path, cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], images)
    assert data.labels.tolist() == [-1] * 4
    assert data.class_names == [] and data.meta["labeled"] is False


def test_wrong_magic_names_file_expected_and_found(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m")
    labels_as_images = gzip.compress(idx_bytes(np.zeros(12, dtype=np.uint8)))  # a labels file in the images slot
    (tmp_path / "m" / "train-images-idx3-ubyte.gz").write_bytes(labels_as_images)
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "m", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert "train-images-idx3-ubyte.gz" in message
    assert "0x00000803" in message and "0x00000801" in message


def test_truncated_idx_names_file_and_byte_counts(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m", n_train=10)
    good = idx_bytes(rng_images(10, 28, 28))
    (tmp_path / "m" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(good[:-100]))
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "m", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert "train-images-idx3-ubyte.gz" in message and "truncated" in message
    assert f"{len(good):,}" in message and f"{len(good) - 100:,}" in message
    assert leftovers(cache_dir) == []


def test_truncated_gzip_stream_is_named(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m")
    path = tmp_path / "m" / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz: the gzip stream ends early"):
        prepare(tmp_path / "m", cache_dir=cache_dir, progress=False)


def test_image_and_label_counts_must_agree(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m", n_train=12)
    write_idx(tmp_path / "m" / "train-labels-idx1-ubyte.gz", np.zeros(11, dtype=np.uint8))
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "m", cache_dir=cache_dir, progress=False)
    assert "12 images" in str(err.value) and "11 labels" in str(err.value)
    assert "train-labels-idx1-ubyte.gz" in str(err.value)


def test_idx_has_no_val_split(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m")
    with pytest.raises(DataError, match="only train and test"):
        prepare(tmp_path / "m", split="val", cache_dir=cache_dir, progress=False)


@needs_fashion
def test_real_fashion_mnist_slice_as_idx_roundtrips_exactly(tmp_path: Path, cache_dir: Path) -> None:
    images, labels = real_fashion_slice(50)
    folder = tmp_path / "fm50"
    folder.mkdir()
    write_idx(folder / "train-images-idx3-ubyte.gz", images)
    write_idx(folder / "train-labels-idx1-ubyte.gz", labels)
    data = prepare(folder, cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], images)
    np.testing.assert_array_equal(data.labels, labels)


@needs_fashion
def test_prepare_fashion_mnist_uses_the_debian_copy(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Any download attempt fails loudly: the local copy must be found first.
    monkeypatch.setenv("FASTDDPM_MIRROR_FASHION_MNIST", "http://127.0.0.1:9/")
    data = prepare("fashion-mnist", split="test", cache_dir=cache_dir, progress=False)
    assert data.images.shape == (10000, 1, 28, 28)
    assert data.class_names[0] == "T-shirt/top" and data.class_names[9] == "Ankle boot"
    assert data.meta["source_path"] == str(FASHION_DIR)
    first_images, first_labels = real_fashion_slice(50, split="test")
    np.testing.assert_array_equal(data.images[:50, 0], first_images)
    np.testing.assert_array_equal(data.labels[:50], first_labels)
    assert np.bincount(data.labels).tolist() == [1000] * 10
    assert not (cache_dir / "downloads").exists()
