"""Named datasets: md5-verified downloads from a local HTTP mirror, rejection of corrupted files,
the offline teaching error, and local copies (including Debian's Fashion-MNIST) used first."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import (
    CIFAR_NAMES,
    FASHION_DIR,
    cache_dir,  # noqa: F401  (fixture)
    cifar_batches,
    cifar_expected,
    cifar_files,
    closed_port_url,
    make_idx_folder,
    md5_of,
    needs_fashion,
    serve_directory,
    write_cifar_tar,
)
from fastddpm.data import DataError, info, prepare
from fastddpm.data import named


@pytest.fixture
def mnist_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Tiny MNIST files served over HTTP, with their md5s in the checksum table."""
    written = make_idx_folder(tmp_path / "mirror")
    for path in (tmp_path / "mirror").iterdir():
        monkeypatch.setitem(named.CHECKSUMS["mnist"], path.name, md5_of(path))
    with serve_directory(tmp_path / "mirror") as (url, requests):
        monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", url)
        yield written, requests, tmp_path / "mirror", url


def test_download_verifies_and_is_used_then_reused(cache_dir: Path, mnist_mirror) -> None:
    written, requests, _, _ = mnist_mirror
    data = prepare("mnist", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], written["train"][0])
    np.testing.assert_array_equal(data.labels, written["train"][1])
    assert data.class_names == [str(d) for d in range(10)]
    downloads = cache_dir / "downloads" / "mnist"
    assert sorted(p.name for p in downloads.iterdir()) == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]
    assert sorted(requests) == ["/train-images-idx3-ubyte.gz", "/train-labels-idx1-ubyte.gz"]
    prepare("mnist", cache_dir=cache_dir, progress=False)
    prepare("MNIST", split="train", resize=8, cache_dir=cache_dir, progress=False)  # new cache, local copy
    assert len(requests) == 2  # no second download


def test_corrupted_download_is_rejected_and_leaves_no_file(cache_dir: Path, mnist_mirror) -> None:
    _, _, mirror, url = mnist_mirror
    path = mirror / "train-images-idx3-ubyte.gz"
    expected = named.CHECKSUMS["mnist"][path.name]
    path.write_bytes(path.read_bytes()[:-1] + b"X")  # one flipped byte
    actual = md5_of(path)
    with pytest.raises(DataError) as err:
        prepare("mnist", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert f"{url}train-images-idx3-ubyte.gz: md5 mismatch" in message
    assert expected in message and actual in message and "md5 mismatch" in message
    downloads = cache_dir / "downloads" / "mnist"
    assert "train-images-idx3-ubyte.gz" not in [p.name for p in downloads.iterdir()]
    assert not [p for p in downloads.iterdir() if ".part" in p.name]


def test_next_mirror_is_tried_after_a_bad_one(cache_dir: Path, mnist_mirror, monkeypatch: pytest.MonkeyPatch) -> None:
    written, _, _, good = mnist_mirror
    monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", f"{closed_port_url()},{good}")
    data = prepare("mnist", split="test", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], written["test"][0])


def test_a_mirror_urllib_cannot_even_parse_is_skipped_like_a_dead_one(cache_dir: Path, mnist_mirror,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-numeric port raises http.client.InvalidURL (neither an OSError nor a ValueError): the next mirror is
    tried, and with none left the error names the URL, not a traceback."""
    written, _, _, good = mnist_mirror
    monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", f"http://localhost:80a/,{good}")
    data = prepare("mnist", split="test", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], written["test"][0])
    monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", "http://localhost:80a/")
    with pytest.raises(DataError, match="localhost:80a"):
        prepare("mnist", split="train", cache_dir=cache_dir / "other", progress=False)


def test_offline_without_local_copy_is_a_teaching_error(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = closed_port_url()
    monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", dead)
    with pytest.raises(DataError) as err:
        prepare("mnist", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert message.startswith("could not download mnist (train)")
    assert f"{dead}train-images-idx3-ubyte.gz: download failed" in message and "refused" in message.lower()
    assert str(cache_dir / "downloads" / "mnist") in message
    assert "Fix: put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz in" in message
    assert "pass a path" in message
    assert not (cache_dir / "prepared").exists() or not any((cache_dir / "prepared").glob("mnist*"))


def test_offline_fashion_mnist_error_mentions_the_debian_package(cache_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(named, "DATASETS", {**named.DATASETS, "fashion-mnist": named.NamedDataset(
        **{**named.DATASETS["fashion-mnist"].__dict__, "system_dirs": (cache_dir / "no-such-dir",)})})
    monkeypatch.setenv("FASTDDPM_MIRROR_FASHION_MNIST", closed_port_url())
    with pytest.raises(DataError) as err:
        prepare("fashion-mnist", cache_dir=cache_dir, progress=False)
    assert "apt-get install dataset-fashion-mnist" in str(err.value)
    assert str(cache_dir / "no-such-dir") in str(err.value)


def test_cifar10_download_of_the_archive(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = cifar_batches()
    (tmp_path / "mirror").mkdir()
    archive = write_cifar_tar(tmp_path / "mirror" / "cifar-10-python.tar.gz", cifar_files(batches))
    monkeypatch.setitem(named.CHECKSUMS["cifar10"], archive.name, md5_of(archive))
    with serve_directory(tmp_path / "mirror") as (url, requests):
        monkeypatch.setenv("FASTDDPM_MIRROR_CIFAR10", url)
        train = prepare("cifar10", cache_dir=cache_dir, progress=False)
        test = prepare("cifar-10", split="test", cache_dir=cache_dir, progress=False)
    assert requests == ["/cifar-10-python.tar.gz"]
    for data, split in ((train, "train"), (test, "test")):
        images, labels = cifar_expected(batches, split)
        np.testing.assert_array_equal(np.asarray(data.images), images)
        np.testing.assert_array_equal(data.labels, labels)
        assert data.class_names == CIFAR_NAMES


def test_info_on_a_named_dataset_never_downloads(cache_dir: Path, mnist_mirror) -> None:
    _, requests, _, _ = mnist_mirror
    text = info("mnist", cache_dir=cache_dir)
    assert "not downloaded yet" in text and "not prepared yet: run `fastddpm data prepare mnist" in text
    assert requests == [] and not (cache_dir / "prepared").exists()


def test_prepared_named_dataset_survives_deleting_the_downloads(cache_dir: Path, mnist_mirror,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _, requests, _, _ = mnist_mirror
    first = prepare("mnist", cache_dir=cache_dir, progress=False)
    for p in (cache_dir / "downloads" / "mnist").iterdir():
        p.unlink()
    monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", closed_port_url())  # a download now would fail
    again = prepare("mnist", cache_dir=cache_dir, progress=False)
    assert again.meta["created"] == first.meta["created"] and len(requests) == 2
    assert "downloaded files are gone" in info("mnist", cache_dir=cache_dir)


def test_local_copy_in_downloads_dir_is_used_without_network(tmp_path: Path, cache_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    written = make_idx_folder(cache_dir / "downloads" / "mnist")
    monkeypatch.setenv("FASTDDPM_MIRROR_MNIST", closed_port_url())
    data = prepare("mnist", split="test", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], written["test"][0])


@needs_fashion
def test_prepare_fashion_mnist_train_from_debian(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTDDPM_MIRROR_FASHION_MNIST", closed_port_url())
    data = prepare("fashion-mnist", cache_dir=cache_dir, progress=False)
    assert data.images.shape == (60000, 1, 28, 28) and data.labels.shape == (60000,)
    assert data.class_names == list(named.FASHION_MNIST_CLASSES)
    with gzip.open(FASHION_DIR / "train-images-idx3-ubyte.gz") as f:
        f.seek(16 + 59_990 * 784)
        last10 = np.frombuffer(f.read(10 * 784), dtype=np.uint8).reshape(10, 28, 28)
    np.testing.assert_array_equal(data.images[-10:, 0], last10)
    assert data.meta["files"] == [str(FASHION_DIR / "train-images-idx3-ubyte.gz"),
                                  str(FASHION_DIR / "train-labels-idx1-ubyte.gz")]
