"""Decode once: cache reuse, rebuild on change, cache keys for transforms, and RELIABILITY promise 4/11
for the cache (a failed build leaves no partial cache and keeps the old one byte-identical)."""

from __future__ import annotations

import errno
import os
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_fixtures import (
    cache_dir,  # noqa: F401  (fixture)
    leftovers,
    make_class_folder,
    make_idx_folder,
    rng_images,
    save_image,
)
from fastddpm.data import DataError, PreparedData, default_cache_dir, prepare
from fastddpm.data import cache as cache_module
from fastddpm.data import decode as decode_module


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _folder(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    per_class = {"0": rng_images(3, 8, 8, seed=seed), "1": rng_images(2, 8, 8, seed=seed + 1)}
    make_class_folder(root, per_class)
    return per_class


def test_second_prepare_reuses_the_cache_without_decoding(tmp_path: Path, cache_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _folder(tmp_path / "root")
    first = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)

    def must_not_decode(*args: object, **kwargs: object) -> None:
        raise AssertionError("decoded again although the cache is current")

    monkeypatch.setattr(decode_module, "decode_image", must_not_decode)
    monkeypatch.setattr(decode_module, "probe_image", must_not_decode)
    second = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert second.cache_path == first.cache_path
    assert second.meta["created"] == first.meta["created"]
    np.testing.assert_array_equal(np.asarray(second.images), np.asarray(first.images))


def test_prepared_images_are_a_read_only_memmap(tmp_path: Path, cache_dir: Path) -> None:
    _folder(tmp_path / "root")
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert isinstance(data, PreparedData) and isinstance(data.images, np.memmap)
    assert not data.images.flags.writeable
    assert sorted(p.name for p in data.cache_path.iterdir()) == ["images.npy", "labels.npy", "meta.json"]
    assert data.meta["format_version"] == cache_module.CACHE_FORMAT_VERSION


def test_changed_source_file_triggers_rebuild(tmp_path: Path, cache_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _folder(tmp_path / "root")
    first = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    replacement = np.full((8, 8), 7, dtype=np.uint8)
    path = tmp_path / "root" / "1" / "000.png"
    save_image(path, replacement)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # coarse-mtime file systems
    capsys.readouterr()
    second = prepare(tmp_path / "root", cache_dir=cache_dir, progress=True)
    assert "source changed: rebuilding" in capsys.readouterr().err
    assert second.cache_path == first.cache_path and second.meta["created"] != first.meta["created"]
    np.testing.assert_array_equal(second.images[3, 0], replacement)


def test_added_file_and_changed_idx_file_trigger_rebuild(tmp_path: Path, cache_dir: Path) -> None:
    _folder(tmp_path / "root")
    assert prepare(tmp_path / "root", cache_dir=cache_dir, progress=False).num_images == 5
    save_image(tmp_path / "root" / "1" / "new.png", rng_images(1, 8, 8, seed=5)[0])
    assert prepare(tmp_path / "root", cache_dir=cache_dir, progress=False).num_images == 6

    make_idx_folder(tmp_path / "m", n_train=4)
    assert prepare(tmp_path / "m", cache_dir=cache_dir, progress=False).num_images == 4
    make_idx_folder(tmp_path / "m", n_train=9)
    assert prepare(tmp_path / "m", cache_dir=cache_dir, progress=False).num_images == 9


def test_rebuild_flag_forces_a_new_build(tmp_path: Path, cache_dir: Path) -> None:
    _folder(tmp_path / "root")
    first = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    second = prepare(tmp_path / "root", rebuild=True, cache_dir=cache_dir, progress=False)
    assert second.meta["created"] != first.meta["created"] and second.cache_path == first.cache_path
    assert leftovers(cache_dir) == [first.cache_path.name]


def test_center_crop_and_stretch_shapes_values_and_cache_keys(tmp_path: Path, cache_dir: Path) -> None:
    wide = rng_images(1, 20, 40, c=3, seed=1)[0]  # H=20, W=40
    save_image(tmp_path / "root" / "a" / "wide.png", wide)
    plain = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    crop = prepare(tmp_path / "root", resize=10, cache_dir=cache_dir, progress=False)
    stretch = prepare(tmp_path / "root", resize=10, resize_mode="stretch", cache_dir=cache_dir, progress=False)
    crop20 = prepare(tmp_path / "root", resize=20, cache_dir=cache_dir, progress=False)
    assert plain.images.shape == (1, 3, 20, 40)
    assert crop.images.shape == stretch.images.shape == (1, 3, 10, 10)
    assert len({d.cache_path for d in (plain, crop, stretch, crop20)}) == 4
    im = Image.fromarray(wide)
    # The definition: scale the short side to 10 (40x20 -> 20x10), then crop the centre 10x10.
    expected_crop = np.asarray(im.resize((20, 10), Image.Resampling.LANCZOS).crop((5, 0, 15, 10)))
    expected_stretch = np.asarray(im.resize((10, 10), Image.Resampling.LANCZOS))
    np.testing.assert_array_equal(crop.images[0], expected_crop.transpose(2, 0, 1))
    np.testing.assert_array_equal(stretch.images[0], expected_stretch.transpose(2, 0, 1))
    # Short side already 20: centre-crop is a pure crop, pixels untouched.
    np.testing.assert_array_equal(crop20.images[0], wide[:, 10:30].transpose(2, 0, 1))
    assert crop.meta["transform"] == {"resize": 10, "resize_mode": "center-crop", "image_mode": None}


def test_upscaling_and_resize_on_array_sources(tmp_path: Path, cache_dir: Path) -> None:
    written = make_idx_folder(tmp_path / "m", n_train=3)
    data = prepare(tmp_path / "m", resize=32, image_mode="RGB", cache_dir=cache_dir, progress=False)
    assert data.images.shape == (3, 3, 32, 32)
    expected = np.asarray(Image.fromarray(written["train"][0][1]).convert("RGB").resize(
        (32, 32), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(data.images[1], expected.transpose(2, 0, 1))


def _fail_in_the_middle_of_decoding(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    """Raise `exc` after some rows were already written into the temp cache."""
    calls = {"n": 0}
    real = decode_module.decode_image

    def flaky(*args: object, **kwargs: object) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 4:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_module, "decode_image", flaky)
    monkeypatch.setattr(decode_module, "_CHUNK_IMAGES", 2)  # so rows hit the disk before the failure


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
def test_failed_build_leaves_nothing_behind(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                            exc: BaseException) -> None:
    _folder(tmp_path / "root")
    _fail_in_the_middle_of_decoding(monkeypatch, exc)
    with pytest.raises(type(exc)):
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert leftovers(cache_dir) == []


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
def test_failed_rebuild_keeps_the_old_cache_byte_identical(tmp_path: Path, cache_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    _folder(tmp_path / "root")
    old = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    before = _snapshot(old.cache_path)
    _fail_in_the_middle_of_decoding(monkeypatch, exc)
    with pytest.raises(type(exc)):
        prepare(tmp_path / "root", rebuild=True, cache_dir=cache_dir, progress=False)
    assert leftovers(cache_dir) == [old.cache_path.name]
    assert _snapshot(old.cache_path) == before
    monkeypatch.undo()
    again = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert again.meta["created"] == old.meta["created"]  # still the old, loadable cache


@pytest.mark.parametrize("code, said", [(errno.ENOSPC, "no space left on device"),
                                        (errno.EFBIG, "file too large")])  # EFBIG: FAT32's 4 GiB, `ulimit -f`
def test_disk_full_while_writing_is_a_teaching_error_and_cleans_up(tmp_path: Path, cache_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, code, said) -> None:
    make_idx_folder(tmp_path / "m")
    old = prepare(tmp_path / "m", cache_dir=cache_dir, progress=False)
    before = _snapshot(old.cache_path)

    def full(path: Path, obj: dict) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(cache_module, "_write_json", full)
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "m", rebuild=True, cache_dir=cache_dir, progress=False)
    assert str(err.value).startswith(f"{said} while writing the cache in") and "--cache-dir" in str(err.value)
    assert ("ulimit -f" in str(err.value)) == (code == errno.EFBIG)  # a size limit, not a full disk
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == code
    assert leftovers(cache_dir) == [old.cache_path.name]
    assert _snapshot(old.cache_path) == before


def test_not_enough_free_space_fails_before_decoding(tmp_path: Path, cache_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _folder(tmp_path / "root")
    monkeypatch.setattr(decode_module.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=10))
    with pytest.raises(DataError, match=r"the cache needs .* MiB .* free"):
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert leftovers(cache_dir) == []


def test_corrupted_cache_is_rebuilt(tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _folder(tmp_path / "root")
    first = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    images_path = first.cache_path / "images.npy"
    expected = np.asarray(first.images).copy()
    del first
    images_path.write_bytes(images_path.read_bytes()[:-50])  # truncated images.npy
    capsys.readouterr()
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=True)
    assert "cache unusable" in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(data.images), expected)


def test_stale_temp_dirs_from_a_killed_build_are_removed(tmp_path: Path, cache_dir: Path) -> None:
    _folder(tmp_path / "root")
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    stale = data.cache_path.parent / f".tmp-{data.cache_path.name}-999-dead"
    stale.mkdir()
    (stale / "images.npy").write_bytes(b"partial")
    prepare(tmp_path / "root", rebuild=True, cache_dir=cache_dir, progress=False)
    assert not stale.exists()


def test_default_cache_dir_honours_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASTDDPM_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("FASTDDPM_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "fastddpm"


def test_prepare_without_cache_dir_uses_fastddpm_cache(tmp_path: Path, cache_dir: Path) -> None:
    _folder(tmp_path / "root")
    data = prepare(tmp_path / "root", progress=False)  # the fixture set FASTDDPM_CACHE=cache_dir
    assert data.cache_path.parent == cache_dir / "prepared"


def test_bad_options_are_teaching_errors(tmp_path: Path, cache_dir: Path) -> None:
    _folder(tmp_path / "root")
    for kwargs, pattern in (({"resize": 0}, "positive integer"), ({"resize_mode": "crop"}, "center-crop"),
                            ({"image_mode": "RGBA"}, "use L or RGB"), ({"split": "dev"}, "unknown split 'dev'")):
        with pytest.raises(DataError, match=pattern):
            prepare(tmp_path / "root", cache_dir=cache_dir, progress=False, **kwargs)


def test_concurrent_prepare_waits_for_the_builder(tmp_path: Path, cache_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Two processes (e.g. DDP ranks) preparing the same cache: the second waits, then reuses it."""
    _folder(tmp_path / "root")
    first = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    outcome: dict[str, object] = {}
    with cache_module.build_lock(first.cache_path, say=lambda message: None):
        waiter = threading.Thread(target=lambda: outcome.setdefault(
            "data", prepare(tmp_path / "root", cache_dir=cache_dir, progress=True)))
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive(), "prepare did not wait for the lock holder"
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert outcome["data"].meta["created"] == first.meta["created"]
    assert "waiting for another process" in capsys.readouterr().err


def _read_only_cache_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening the lock file fails as on a read-only mount (the tests run as root, which chmod cannot stop)."""
    real_open = open

    def read_only_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(cache_module, "open", read_only_open, raising=False)


def test_a_complete_cache_in_a_read_only_folder_is_used(tmp_path: Path, cache_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock file was opened for writing before looking for the cache: a shared, prepared, read-only cache
    folder could not be used at all (a bare OSError traceback)."""
    _folder(tmp_path / "root")
    make_idx_folder(tmp_path / "idx")
    built = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    _read_only_cache_folder(monkeypatch)
    again = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert again.cache_path == built.cache_path and again.meta["created"] == built.meta["created"]
    for call in (lambda: prepare(tmp_path / "idx", cache_dir=cache_dir, progress=False),
                 lambda: prepare(tmp_path / "root", rebuild=True, cache_dir=cache_dir, progress=False)):
        with pytest.raises(DataError, match=r"cannot write in the cache folder .*prepared \(Read-only file "
                                            r"system\)\. Fix: pass --cache-dir DIR or set FASTDDPM_CACHE"):
            call()


def test_a_file_system_without_locks_still_prepares(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Lustre without -o flock answers flock() with ENOSYS: prepare failed there with a bare OSError."""
    import fcntl

    def no_flock(fd: object, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    per_class = _folder(tmp_path / "root")
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=True)
    assert data.num_images == sum(len(v) for v in per_class.values())
    assert "has no file locks (Function not implemented)" in capsys.readouterr().err


def test_a_rebuild_to_the_same_pixels_keeps_what_was_computed_from_them(tmp_path: Path, cache_dir: Path) -> None:
    """A feature network or reference statistics computed from a cache stay valid across a rebuild that writes the
    same images, labels and class names (a format upgrade, --rebuild); new pixels invalidate them."""
    _folder(tmp_path / "root")
    first = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert first.built == first.meta["created"]
    derived = tmp_path / "reference.npz"
    derived.write_bytes(b"statistics")  # written after the build, recording it
    same = prepare(tmp_path / "root", rebuild=True, cache_dir=cache_dir, progress=False)
    assert same.meta["created"] != first.meta["created"]  # rebuilt, with the same pixels
    assert same.built == first.built
    assert same.computed_from_this_build(first.built, derived) and same.computed_from_this_build(None, derived)

    path = tmp_path / "root" / "1" / "000.png"
    save_image(path, np.full((8, 8), 7, dtype=np.uint8))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # coarse-mtime file systems
    changed = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert changed.built == changed.meta["created"] != first.built
    assert not changed.computed_from_this_build(first.built, derived)
    assert not changed.computed_from_this_build(None, derived)  # older than the new pixels
