""".npy / .npz sources: layouts, keys, labels, and errors that say how to convert."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_fixtures import cache_dir, rng_images  # noqa: F401  (fixture)
from fastddpm.data import DataError, prepare


@pytest.mark.parametrize("layout", ["NHW", "NHW1", "NHW3", "NCHW3", "NCHW1"])
def test_npy_layouts_become_nchw_exactly(tmp_path: Path, cache_dir: Path, layout: str) -> None:
    nchw = {
        "NHW": rng_images(4, 6, 5)[:, None],
        "NHW1": rng_images(4, 6, 5)[:, None],
        "NHW3": rng_images(4, 6, 5, c=3).transpose(0, 3, 1, 2),
        "NCHW3": rng_images(4, 6, 5, c=3).transpose(0, 3, 1, 2),
        "NCHW1": rng_images(4, 6, 5)[:, None],
    }[layout]
    stored = {"NHW": nchw[:, 0], "NHW1": nchw.transpose(0, 2, 3, 1), "NHW3": nchw.transpose(0, 2, 3, 1),
              "NCHW3": nchw, "NCHW1": nchw}[layout]
    np.save(tmp_path / "x.npy", np.ascontiguousarray(stored))
    data = prepare(tmp_path / "x.npy", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(np.asarray(data.images), nchw)
    assert data.labels.tolist() == [-1] * 4


@pytest.mark.parametrize("image_key,label_key", [("images", "labels"), ("x", "y"), ("arr_0", None)])
def test_npz_keys(tmp_path: Path, cache_dir: Path, image_key: str, label_key: str | None) -> None:
    images = rng_images(5, 4, 4, c=3)
    labels = np.array([2, 0, 1, 2, 2], dtype=np.int32)
    arrays = {image_key: images, **({label_key: labels} if label_key else {})}
    np.savez(tmp_path / "d.npz", **arrays)
    data = prepare(tmp_path / "d.npz", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(np.asarray(data.images), images.transpose(0, 3, 1, 2))
    if label_key:
        np.testing.assert_array_equal(data.labels, labels)
        assert data.class_names == ["0", "1", "2"] and data.meta["class_counts"] == {"0": 1, "1": 1, "2": 3}
    else:
        assert data.labels.tolist() == [-1] * 5 and data.meta["labeled"] is False


def test_npz_class_names_and_keras_style_splits(tmp_path: Path, cache_dir: Path) -> None:
    x_train, x_test = rng_images(6, 4, 4, seed=1), rng_images(3, 4, 4, seed=2)
    y_train, y_test = np.array([0, 1, 0, 1, 1, 0]), np.array([1, 1, 0])
    np.savez_compressed(tmp_path / "mnist.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    for split, (x, y) in {"train": (x_train, y_train), "test": (x_test, y_test)}.items():
        data = prepare(tmp_path / "mnist.npz", split=split, cache_dir=cache_dir, progress=False)
        np.testing.assert_array_equal(data.images[:, 0], x)
        np.testing.assert_array_equal(data.labels, y)
    np.savez(tmp_path / "named.npz", images=x_train, labels=y_train, class_names=np.array(["cat", "dog"]))
    assert prepare(tmp_path / "named.npz", cache_dir=cache_dir, progress=False).class_names == ["cat", "dog"]


def test_float_images_error_says_how_to_convert(tmp_path: Path, cache_dir: Path) -> None:
    np.save(tmp_path / "f.npy", np.random.default_rng(0).random((3, 4, 4), dtype=np.float32))
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "f.npy", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert "f.npy" in message and "float32" in message and "(x * 255).round().astype(np.uint8)" in message


def test_rgba_needs_image_mode(tmp_path: Path, cache_dir: Path) -> None:
    rgba = rng_images(2, 4, 4, c=4)
    np.save(tmp_path / "rgba.npy", rgba)
    with pytest.raises(DataError, match=r"4 channels \(RGBA\).*--image-mode RGB"):
        prepare(tmp_path / "rgba.npy", cache_dir=cache_dir, progress=False)
    data = prepare(tmp_path / "rgba.npy", image_mode="RGB", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(np.asarray(data.images), rgba[..., :3].transpose(0, 3, 1, 2))


def test_object_arrays_are_never_unpickled(tmp_path: Path, cache_dir: Path) -> None:
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=r"obj\.npy: cannot load without pickle"):
        prepare(tmp_path / "obj.npy", cache_dir=cache_dir, progress=False)


def test_bad_shapes_and_keys_are_explained(tmp_path: Path, cache_dir: Path) -> None:
    np.save(tmp_path / "flat.npy", rng_images(1, 3, 7)[0])  # 2-D
    with pytest.raises(DataError, match=r"shape \(3, 7\); expected \(N, H, W\)"):
        prepare(tmp_path / "flat.npy", cache_dir=cache_dir, progress=False)
    np.savez(tmp_path / "wrong.npz", pixels=rng_images(2, 4, 4))
    with pytest.raises(DataError, match=r"looked for keys images, x, arr_0 but found pixels"):
        prepare(tmp_path / "wrong.npz", cache_dir=cache_dir, progress=False)
    np.savez(tmp_path / "mismatch.npz", images=rng_images(3, 4, 4), labels=np.arange(2))
    with pytest.raises(DataError, match=r"labels are int64 \(2,\); expected integers of shape \(3,\)"):
        prepare(tmp_path / "mismatch.npz", cache_dir=cache_dir, progress=False)


def test_npz_object_arrays_bytes_class_names_and_keras_column_labels(tmp_path: Path, cache_dir: Path) -> None:
    """An .npz loads its members lazily: an object array in it escaped as a bare numpy ValueError; class names saved
    as bytes came out as "b'cat'"; labels of shape (N, 1), as keras.datasets.cifar10 gives them, were refused."""
    x = rng_images(4, 4, 4)
    np.savez(tmp_path / "obj_names.npz", images=x, labels=np.array([0, 1, 0, 1]),
             class_names=np.array(["cat", "dog"], dtype=object))
    with pytest.raises(DataError, match=r"obj_names\.npz\[class_names\]: cannot load without pickle"):
        prepare(tmp_path / "obj_names.npz", cache_dir=cache_dir, progress=False)
    np.savez(tmp_path / "obj_images.npz", images=np.array([None, 1], dtype=object))
    with pytest.raises(DataError, match=r"obj_images\.npz\[images\]: cannot load without pickle"):
        prepare(tmp_path / "obj_images.npz", cache_dir=cache_dir, progress=False)
    np.savez(tmp_path / "bytes_names.npz", images=x, labels=np.array([0, 1, 0, 1]),
             class_names=np.array([b"cat", b"dog"]))
    assert prepare(tmp_path / "bytes_names.npz", cache_dir=cache_dir, progress=False).class_names == ["cat", "dog"]
    np.savez(tmp_path / "keras.npz", x_train=x, y_train=np.array([[1], [0], [1], [1]], dtype=np.uint8))
    data = prepare(tmp_path / "keras.npz", cache_dir=cache_dir, progress=False)
    assert data.labels.tolist() == [1, 0, 1, 1] and data.class_names == ["0", "1"]
