"""CIFAR-10 python batches (folder and tar.gz, read in place) and the restricted unpickler
(RELIABILITY promise 12: a pickle that would run code is refused and runs nothing)."""

from __future__ import annotations

import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import (
    CIFAR_NAMES,
    cache_dir,  # noqa: F401  (fixture)
    cifar_batches,
    cifar_expected,
    cifar_files,
    leftovers,
    write_cifar_folder,
    write_cifar_tar,
)
from fastddpm.data import DataError, prepare
from fastddpm.data.cifar import load_batch_pickle


@pytest.mark.parametrize("py2", [True, False], ids=["py2-cPickle", "py3-protocol4"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_cifar_tar_gz_read_in_place_exact(tmp_path: Path, cache_dir: Path, py2: bool, split: str) -> None:
    batches = cifar_batches()
    tar_path = write_cifar_tar(tmp_path / "cifar-10-python.tar.gz", cifar_files(batches, py2=py2))
    data = prepare(tar_path, split=split, cache_dir=cache_dir, progress=False)
    images, labels = cifar_expected(batches, split)
    assert data.images.shape == (len(images), 3, 32, 32)
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.class_names == CIFAR_NAMES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "cifar-10-python.tar.gz"]  # nothing extracted


def test_cifar_pixel_layout_is_channel_planes(tmp_path: Path, cache_dir: Path) -> None:
    """Row = 1024 red, 1024 green, 1024 blue values; a pure-red image must come out red."""
    batches = cifar_batches(per_batch=1)
    red = np.zeros(3072, dtype=np.uint8)
    red[:1024] = 255
    batches["test_batch"] = (red[None], [3])
    write_cifar_folder(tmp_path / "cifar-10-batches-py", cifar_files(batches))
    data = prepare(tmp_path / "cifar-10-batches-py", split="test", cache_dir=cache_dir, progress=False)
    assert (data.images[0, 0] == 255).all() and (data.images[0, 1:] == 0).all()
    assert data.class_names[data.labels[0]] == "cat"


def test_cifar_batch_folder_found_from_its_parent(tmp_path: Path, cache_dir: Path) -> None:
    batches = cifar_batches()
    write_cifar_folder(tmp_path / "downloads" / "cifar-10-batches-py", cifar_files(batches))
    data = prepare(tmp_path / "downloads", cache_dir=cache_dir, progress=False)
    images, labels = cifar_expected(batches, "train")
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.meta["kind"] == "cifar10"


class _RunsCode:
    """Unpickling this calls os.system: what a poisoned data_batch_1 would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


class _Evals:
    def __reduce__(self) -> tuple:
        return (eval, ("__import__('pathlib').Path('EVAL_RAN').touch()",))


@pytest.mark.parametrize("where", ["folder", "tar"])
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path, cache_dir: Path, where: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    files = cifar_files(cifar_batches())
    files["data_batch_1"] = pickle.dumps({"data": _RunsCode(marker), "labels": [0]}, protocol=2)
    source = (write_cifar_folder(tmp_path / "cifar-10-batches-py", files) if where == "folder"
              else write_cifar_tar(tmp_path / "cifar.tar.gz", files))
    with pytest.raises(DataError) as err:
        prepare(source, cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert "refusing to unpickle" in message and "system" in message and "data_batch_1" in message
    assert "CIFAR batches contain only numpy arrays; this file may be malicious" in message
    assert not marker.exists()
    assert leftovers(cache_dir) == []


def test_restricted_unpickler_refuses_builtins_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps(_Evals(), protocol=4)
    with pytest.raises(DataError, match=r"refusing to unpickle builtins\.eval from evil"):
        load_batch_pickle(payload, source="evil")
    assert not (tmp_path / "EVAL_RAN").exists()
    assert pickle.loads(pickle.dumps([1, 2]), encoding="latin1") == [1, 2]  # control: plain data is fine


def test_tar_without_cifar_batches_is_explained(tmp_path: Path, cache_dir: Path) -> None:
    path = tmp_path / "photos.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("photos/a.png")
        tar.addfile(info)
    with pytest.raises(DataError, match=r"photos\.tar\.gz: no cifar-10-batches-py/.*use a folder or a \.zip"):
        prepare(path, cache_dir=cache_dir, progress=False)


def test_truncated_tar_is_a_teaching_error(tmp_path: Path, cache_dir: Path) -> None:
    path = write_cifar_tar(tmp_path / "cifar-10-python.tar.gz", cifar_files(cifar_batches(per_batch=50)))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=r"cifar-10-python\.tar\.gz: unreadable or truncated tar archive"):
        prepare(path, cache_dir=cache_dir, progress=False)


def test_missing_batch_in_folder_is_named(tmp_path: Path, cache_dir: Path) -> None:
    files = cifar_files(cifar_batches())
    del files["data_batch_3"]
    write_cifar_folder(tmp_path / "cifar-10-batches-py", files)
    with pytest.raises(DataError, match="missing data_batch_3 for the train split"):
        prepare(tmp_path / "cifar-10-batches-py", cache_dir=cache_dir, progress=False)


@pytest.mark.parametrize("protocol", [2, 3, 5])
def test_cifar_batches_pickled_by_python3_at_any_protocol_are_read(tmp_path: Path, cache_dir: Path,
                                                                   protocol: int) -> None:
    """Python 3 writes bytes at protocol 2 as _codecs.encode(str, 'latin1') and numpy writes arrays at protocol 5
    (Python 3.14's default) as numeric._frombuffer: both were refused as 'may be malicious'."""
    batches = cifar_batches()
    files = cifar_files(batches, py2=False, protocol=protocol)
    files["batches.meta"] = pickle.dumps({b"label_names": [n.encode() for n in CIFAR_NAMES], b"empty": b""},
                                         protocol=protocol)  # b'' is bytes() at protocol 2
    data = prepare(write_cifar_tar(tmp_path / "cifar.tar.gz", files), cache_dir=cache_dir, progress=False)
    images, labels = cifar_expected(batches, "train")
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.class_names == CIFAR_NAMES


@pytest.mark.parametrize("payload", [
    b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.",  # encode('a', 'rot13')
    b"\x80\x02c__builtin__\nbytes\nJ\x00\x00\x00\x40\x85R.",  # bytes(2**30): a GiB from a few bytes
])
def test_the_byte_string_globals_allowed_for_protocol_2_do_nothing_else(payload: bytes) -> None:
    with pytest.raises(DataError, match="not a readable CIFAR-10 pickle"):
        load_batch_pickle(payload, source="odd")
