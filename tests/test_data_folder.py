"""Image folders and zips of them: labels from folder names, exact pixels, layouts, zip safety."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_fixtures import (
    cache_dir,  # noqa: F401  (fixture)
    leftovers,
    make_class_folder,
    needs_fashion,
    real_fashion_slice,
    rng_images,
    save_image,
    zip_folder,
)
from fastddpm.data import DataError, info, prepare


def _expected(per_class: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Images in (class, file name) order as N C H W, and their labels."""
    images = np.concatenate(list(per_class.values()))
    if images.ndim == 3:
        images = images[:, None]
    else:
        images = images.transpose(0, 3, 1, 2)
    labels = np.concatenate([[i] * len(v) for i, v in enumerate(per_class.values())])
    return images, labels


@pytest.mark.parametrize("channels", [None, 3])
def test_png_class_folders_give_exact_pixels_and_labels(tmp_path: Path, cache_dir: Path, channels: int | None) -> None:
    per_class = {"0": rng_images(3, 6, 5, c=channels, seed=1), "1": rng_images(2, 6, 5, c=channels, seed=2),
                 "2": rng_images(4, 6, 5, c=channels, seed=3)}
    make_class_folder(tmp_path / "root", per_class)
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    images, labels = _expected(per_class)
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.class_names == ["0", "1", "2"]
    assert data.meta["class_counts"] == {"0": 3, "1": 2, "2": 4}
    assert data.meta["kind"] == "image-folder" and data.meta["skipped"] == []


def test_integer_class_folders_sort_numerically(tmp_path: Path, cache_dir: Path) -> None:
    per_class = {str(k): rng_images(1, 4, 4, seed=k) for k in (2, 10, 9, 0, 1)}
    make_class_folder(tmp_path / "root", per_class)
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert data.class_names == ["0", "1", "2", "9", "10"]
    for label, name in enumerate(data.class_names):
        np.testing.assert_array_equal(data.images[data.labels == label][0, 0], per_class[name][0])


def test_named_class_folders_sort_by_name(tmp_path: Path, cache_dir: Path) -> None:
    per_class = {"dog": rng_images(2, 4, 4, seed=1), "cat": rng_images(1, 4, 4, seed=2),
                 "bird": rng_images(1, 4, 4, seed=3)}
    make_class_folder(tmp_path / "root", per_class)
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert data.class_names == ["bird", "cat", "dog"]
    assert data.labels.tolist() == [0, 1, 2, 2]
    np.testing.assert_array_equal(data.images[0, 0], per_class["bird"][0])


def test_files_directly_in_root_are_one_unlabeled_set(tmp_path: Path, cache_dir: Path) -> None:
    images = rng_images(3, 5, 5)
    for i, im in enumerate(images):
        save_image(tmp_path / "flat" / f"{i}.png", im)
    (tmp_path / "flat" / "README.txt").write_text("not an image, ignored")
    (tmp_path / "flat" / ".DS_Store").write_bytes(b"\0\0")
    data = prepare(tmp_path / "flat", cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], images)
    assert data.labels.tolist() == [-1, -1, -1]
    assert data.class_names == [] and data.meta["labeled"] is False
    assert any("unlabeled" in note for note in data.meta["notes"])


def test_empty_folder_names_folder_and_expected_layout(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "empty" / "0").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "empty", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert str(tmp_path / "empty") in message
    assert "<label>/*.png" in message and "notes.txt" in message


def test_split_folders_are_picked_with_split(tmp_path: Path, cache_dir: Path) -> None:
    train = {"0": rng_images(2, 4, 4, seed=1), "1": rng_images(2, 4, 4, seed=2)}
    test = {"0": rng_images(1, 4, 4, seed=3), "1": rng_images(1, 4, 4, seed=4)}
    make_class_folder(tmp_path / "root" / "training", train)
    make_class_folder(tmp_path / "root" / "testing", test)
    for split, per_class in (("train", train), ("test", test)):
        data = prepare(tmp_path / "root", split=split, cache_dir=cache_dir, progress=False)
        images, labels = _expected(per_class)
        np.testing.assert_array_equal(np.asarray(data.images), images)
        np.testing.assert_array_equal(data.labels, labels)
        assert data.class_names == ["0", "1"] and data.meta["split"] == split
    with pytest.raises(DataError, match="no folder for split 'val'"):
        prepare(tmp_path / "root", split="val", cache_dir=cache_dir, progress=False)


def test_train_takes_a_val_split_folder_like_data_prepare(tmp_path: Path, cache_dir: Path) -> None:
    """`data prepare --split val` read a val/ folder; `train --split val` was refused by the config's choices."""
    from fastddpm.cli import main

    make_class_folder(tmp_path / "root" / "train", {"0": rng_images(4, 8, 8, seed=1), "1": rng_images(4, 8, 8, seed=2)})
    make_class_folder(tmp_path / "root" / "val", {"0": rng_images(3, 8, 8, seed=3), "1": rng_images(3, 8, 8, seed=4)})
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "root"), "--split", "val", "--preset", "tiny", "--out", str(run),
                 "--max-steps", "1", "--batch-size", "2", "--num-sample-images", "2", "--sample-steps", "2",
                 "--no-progress"]) == 0
    assert json.loads((run / "run.json").read_text())["data"]["shape"][0] == 6


def test_split_on_a_source_without_splits_is_an_error(tmp_path: Path, cache_dir: Path) -> None:
    make_class_folder(tmp_path / "root", {"a": rng_images(1, 4, 4)})
    with pytest.raises(DataError, match="has no splits"):
        prepare(tmp_path / "root", split="test", cache_dir=cache_dir, progress=False)


def test_jpeg_folder_matches_pillow_decode(tmp_path: Path, cache_dir: Path) -> None:
    per_class = {"a": rng_images(2, 16, 16, c=3, seed=5), "b": rng_images(1, 16, 16, c=3, seed=6)}
    written = make_class_folder(tmp_path / "root", per_class, ext=".jpg")
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    for row, (rel, label) in enumerate(written):
        with Image.open(tmp_path / "root" / rel) as im:
            np.testing.assert_array_equal(data.images[row], np.asarray(im).transpose(2, 0, 1))
        assert data.labels[row] == label


def test_an_image_stored_sideways_is_cached_upright_as_its_exif_orientation_says(tmp_path: Path,
                                                                                 cache_dir: Path) -> None:
    """A phone stores a portrait photo as landscape pixels with EXIF Orientation 6 (turn 90 degrees clockwise to
    show it): cached upright, so it has the shape of the upright images beside it and no size error."""
    stored = rng_images(1, 4, 8, seed=3)[0]  # 4 high, 8 wide, as the pixels lie in the file
    upright = rng_images(1, 8, 4, seed=4)[0]  # 8 high, 4 wide
    (tmp_path / "root").mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(tmp_path / "root" / "a.png", exif=exif)
    Image.fromarray(upright).save(tmp_path / "root" / "b.png")
    data = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert data.images.shape == (2, 1, 8, 4)
    np.testing.assert_array_equal(data.images[0, 0], np.rot90(stored, k=-1))  # clockwise
    np.testing.assert_array_equal(data.images[1, 0], upright)
    # a cache written before images were turned upright is rebuilt, once; array sources' caches are not touched
    meta_path = data.cache_path / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["exif_upright"]
    meta_path.write_text(json.dumps(meta))
    rebuilt = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert rebuilt.meta["exif_upright"] and rebuilt.meta["created"] != meta["created"]
    assert prepare(tmp_path / "root", cache_dir=cache_dir, progress=False).meta["created"] == rebuilt.meta["created"]


def test_zip_reads_same_pixels_as_folder_without_extracting(tmp_path: Path, cache_dir: Path) -> None:
    per_class = {"0": rng_images(3, 6, 6, seed=1), "1": rng_images(2, 6, 6, seed=2)}
    make_class_folder(tmp_path / "root", per_class)
    zip_dir = tmp_path / "zips"
    zip_dir.mkdir()
    zip_path = zip_folder(tmp_path / "root", zip_dir / "data.zip", prefix="mnist_train/",
                          extra={"__MACOSX/mnist_train/0/._000.png": b"junk", "mnist_train/.hidden.png": b"junk"})
    before = sorted(p.name for p in zip_dir.iterdir())
    data = prepare(zip_path, cache_dir=cache_dir, progress=False)
    assert sorted(p.name for p in zip_dir.iterdir()) == before == ["data.zip"]
    images, labels = _expected(per_class)
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)
    assert data.class_names == ["0", "1"] and data.meta["kind"] == "zip"
    assert any("mnist_train/" in note for note in data.meta["notes"])
    assert data.cache_path.parent == cache_dir / "prepared"


def _without_utf8_flags(zip_path: Path) -> None:
    """Clear the UTF-8 flag (general purpose bit 11) of every member, as Info-ZIP's `zip` on Linux writes UTF-8
    names: in each local header (flags at byte 6) and central directory entry (byte 8)."""
    data = bytearray(zip_path.read_bytes())
    for signature, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = data.find(signature)
        while start != -1:
            data[start + at + 1] &= ~0x08  # bit 11 is bit 3 of the flags' high byte
            start = data.find(signature, start + 4)
    zip_path.write_bytes(bytes(data))


def test_a_zip_of_utf8_names_without_the_flag_reads_the_folders_class_names(tmp_path: Path, cache_dir: Path) -> None:
    """`zip -r` on Linux stores `ç/` as its UTF-8 bytes without the UTF-8 flag, which zipfile reads as code page
    437 (`├º`): the zip's classes differed from its folder's, and `--class ç` matched none."""
    make_class_folder(tmp_path / "root", {"ç": rng_images(2, 6, 6, seed=1), "dog": rng_images(2, 6, 6, seed=2)})
    zip_path = zip_folder(tmp_path / "root", tmp_path / "data.zip")
    _without_utf8_flags(zip_path)
    with zipfile.ZipFile(zip_path) as zf:
        assert any(n.startswith("├º/") for n in zf.namelist())  # as zipfile reads it
    folder = prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    zipped = prepare(zip_path, cache_dir=cache_dir, progress=False)
    assert zipped.class_names == folder.class_names == ["dog", "ç"]
    np.testing.assert_array_equal(np.asarray(zipped.images), np.asarray(folder.images))


def test_a_zipped_folder_of_unlabeled_images_stays_unlabeled(tmp_path: Path, cache_dir: Path) -> None:
    """`zip -r faces.zip faces/` of a folder of images (no class folders): unlabeled, as the folder itself reads,
    not one class named "faces". A lone split folder (train/*.png) stays a split: --split test finds nothing."""
    images = rng_images(3, 6, 6, seed=7)
    for i, im in enumerate(images):
        save_image(tmp_path / "faces" / f"{i}.png", im)
    (tmp_path / "zips").mkdir()
    folder = prepare(tmp_path / "faces", cache_dir=cache_dir, progress=False)
    zipped = prepare(zip_folder(tmp_path / "faces", tmp_path / "zips" / "faces.zip", prefix="faces/"),
                     cache_dir=cache_dir, progress=False)
    assert folder.labels.tolist() == zipped.labels.tolist() == [-1, -1, -1]
    np.testing.assert_array_equal(np.asarray(zipped.images), np.asarray(folder.images))
    split_zip = zip_folder(tmp_path / "faces", tmp_path / "zips" / "split.zip", prefix="train/")
    assert prepare(split_zip, split="train", cache_dir=cache_dir, progress=False).num_images == 3
    with pytest.raises(DataError, match="no folder for split 'test'"):
        prepare(split_zip, split="test", cache_dir=cache_dir, progress=False)


def test_zip_with_split_folders_kaggle_layout(tmp_path: Path, cache_dir: Path) -> None:
    train = {"0": rng_images(2, 4, 4, seed=1), "1": rng_images(1, 4, 4, seed=2)}
    test = {"0": rng_images(1, 4, 4, seed=3), "1": rng_images(2, 4, 4, seed=4)}
    make_class_folder(tmp_path / "root" / "training", train)
    make_class_folder(tmp_path / "root" / "testing", test)
    zip_path = zip_folder(tmp_path / "root", tmp_path / "mnist_png.zip", prefix="mnist_png/")
    data = prepare(zip_path, split="test", cache_dir=cache_dir, progress=False)
    images, labels = _expected(test)
    np.testing.assert_array_equal(np.asarray(data.images), images)
    np.testing.assert_array_equal(data.labels, labels)


@pytest.mark.parametrize("evil", ["../evil.png", "/abs/evil.png", "0/../../evil.png", "..\\win.png"])
def test_zip_traversal_members_are_refused_before_reading(tmp_path: Path, cache_dir: Path, evil: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    make_class_folder(tmp_path / "root", {"0": rng_images(2, 4, 4)})
    zip_path = tmp_path / "evil.zip"
    zip_folder(tmp_path / "root", zip_path)
    with zipfile.ZipFile(zip_path, "a") as zf:
        info = zipfile.ZipInfo("placeholder")
        info.filename = evil  # ZipInfo() would sanitise the name; real attack archives are not so kind
        zf.writestr(info, b"payload")

    def no_member_reads(*args: object, **kwargs: object) -> None:
        raise AssertionError("a member was read before the names were checked")

    monkeypatch.setattr(zipfile.ZipFile, "open", no_member_reads)
    with pytest.raises(DataError) as err:
        prepare(zip_path, cache_dir=cache_dir, progress=False)
    assert evil in str(err.value) and "refusing" in str(err.value)
    assert leftovers(cache_dir) == []


def test_zip_with_no_images_is_explained(tmp_path: Path, cache_dir: Path) -> None:
    zip_path = tmp_path / "docs.zip"
    with zipfile.ZipFile(zip_path, "w") as zf:
        zf.writestr("readme.md", "hi")
    with pytest.raises(DataError, match=r"no images found in .*docs\.zip.*readme\.md"):
        prepare(zip_path, cache_dir=cache_dir, progress=False)


@needs_fashion
def test_real_fashion_mnist_as_png_folder_and_zip_equals_idx_pixels(tmp_path: Path, cache_dir: Path) -> None:
    images, labels = real_fashion_slice(50)
    for i, (im, label) in enumerate(zip(images, labels)):
        save_image(tmp_path / "fm" / str(label) / f"{i:05d}.png", im)
    zip_path = zip_folder(tmp_path / "fm", tmp_path / "fm.zip", prefix="fashion_train/")
    # Folder order is (class, file name); file names are the original indices.
    order = np.lexsort((np.arange(50), labels))
    for source in (tmp_path / "fm", zip_path):
        data = prepare(source, cache_dir=cache_dir, progress=False)
        np.testing.assert_array_equal(data.images[:, 0], images[order])
        present = sorted(set(labels.tolist()))
        assert data.class_names == [str(c) for c in present]
        np.testing.assert_array_equal(np.asarray(data.class_names)[data.labels].astype(int), labels[order])


def test_class_ids_are_the_same_in_every_split_when_a_split_lacks_a_class(tmp_path: Path, cache_dir: Path) -> None:
    """Each split numbered only its own class folders: a test/ without class b gave c the id 1, which is b in
    train/, so a model trained on train/ was scored on test/ against the wrong classes."""
    train = {"a": rng_images(2, 4, 4, seed=1), "b": rng_images(2, 4, 4, seed=2), "c": rng_images(2, 4, 4, seed=3)}
    test = {"a": rng_images(1, 4, 4, seed=4), "c": rng_images(1, 4, 4, seed=5)}
    make_class_folder(tmp_path / "root" / "train", train)
    make_class_folder(tmp_path / "root" / "test", test)
    zip_folder(tmp_path / "root", tmp_path / "root.zip", prefix="data/")
    for source in (tmp_path / "root", tmp_path / "root.zip"):
        tr = prepare(source, split="train", cache_dir=cache_dir, progress=False)
        te = prepare(source, split="test", cache_dir=cache_dir, progress=False)
        assert tr.class_names == te.class_names == ["a", "b", "c"]
        assert tr.labels.tolist() == [0, 0, 1, 1, 2, 2] and te.labels.tolist() == [0, 2]
        np.testing.assert_array_equal(te.images[1, 0], test["c"][0])
        assert te.meta["class_counts"] == {"a": 1, "b": 0, "c": 1}
        assert any("only in the other splits: b" in n for n in te.meta["notes"])


def test_a_split_cache_numbered_before_the_shared_class_ids_is_rebuilt(tmp_path: Path, cache_dir: Path) -> None:
    make_class_folder(tmp_path / "root" / "train", {"a": rng_images(1, 4, 4), "b": rng_images(1, 4, 4)})
    make_class_folder(tmp_path / "root" / "test", {"b": rng_images(1, 4, 4)})
    old = prepare(tmp_path / "root", split="test", cache_dir=cache_dir, progress=False)
    meta_path = old.cache_path / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["classes_from_all_splits"]
    meta_path.write_text(json.dumps(meta))
    assert "STALE: the cache prepared at" in info(tmp_path / "root", split="test", cache_dir=cache_dir)
    again = prepare(tmp_path / "root", split="test", cache_dir=cache_dir, progress=False)
    assert again.meta["created"] != old.meta["created"] and again.labels.tolist() == [1]


def test_symlinked_class_folders_are_read_and_a_link_loop_ends(tmp_path: Path, cache_dir: Path) -> None:
    """Class folders linked from another disk were skipped without a word (os.walk does not follow links)."""
    elsewhere = {"cat": rng_images(2, 4, 4, seed=1), "dog": rng_images(3, 4, 4, seed=2)}
    make_class_folder(tmp_path / "big_disk", elsewhere)
    root = tmp_path / "root"
    make_class_folder(root, {"ant": rng_images(1, 4, 4, seed=3)})
    (root / "cat").symlink_to(tmp_path / "big_disk" / "cat", target_is_directory=True)
    (root / "dog").symlink_to(tmp_path / "big_disk" / "dog", target_is_directory=True)
    (root / "ant" / "loop").symlink_to(root, target_is_directory=True)  # would walk forever
    (root / "ant" / "gone").symlink_to(tmp_path / "nowhere", target_is_directory=True)  # a broken link
    data = prepare(root, cache_dir=cache_dir, progress=False)
    assert data.class_names == ["ant", "cat", "dog"]
    assert data.meta["class_counts"] == {"ant": 1, "cat": 2, "dog": 3}
    np.testing.assert_array_equal(data.images[data.labels == 2][:, 0], elsewhere["dog"])


def test_a_folder_that_cannot_be_listed_is_an_error_not_a_missing_class(tmp_path: Path, cache_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    make_class_folder(tmp_path / "root", {"a": rng_images(1, 4, 4), "b": rng_images(1, 4, 4)})
    locked = str(tmp_path / "root" / "b")
    real_scandir = os.scandir

    def scandir(path: object = ".") -> object:
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)  # root cannot take its own permission away
    with pytest.raises(DataError, match=r"cannot list the folder b \(Permission denied\)"):
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)


def test_a_zip_with_backslash_paths_keeps_its_class_folders(tmp_path: Path, cache_dir: Path) -> None:
    """PowerShell 5's Compress-Archive writes `data\\cat\\0.png`: read as written, every image was a file at the
    top and a labeled dataset became one unlabeled set. A cache made that way is rebuilt."""
    per_class = {"cat": rng_images(2, 4, 4, seed=1), "dog": rng_images(1, 4, 4, seed=2)}
    make_class_folder(tmp_path / "root", per_class)
    with zipfile.ZipFile(tmp_path / "win.zip", "w") as zf:
        for path in sorted((tmp_path / "root").rglob("*.png")):
            zf.write(path, "data\\" + path.relative_to(tmp_path / "root").as_posix().replace("/", "\\"))
    data = prepare(tmp_path / "win.zip", cache_dir=cache_dir, progress=False)
    images, labels = _expected(per_class)
    np.testing.assert_array_equal(np.asarray(data.images), images)
    assert data.class_names == ["cat", "dog"] and data.labels.tolist() == labels.tolist()
    meta_path = data.cache_path / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["backslash_paths_as_folders"]
    meta_path.write_text(json.dumps(meta))
    assert prepare(tmp_path / "win.zip", cache_dir=cache_dir, progress=False).meta["created"] != meta["created"]


def test_images_of_a_format_not_read_are_named_in_the_notes(tmp_path: Path, cache_dir: Path) -> None:
    make_class_folder(tmp_path / "root", {"a": rng_images(2, 4, 4)})
    save_image(tmp_path / "root" / "a" / "scan.tif", rng_images(1, 4, 4)[0])
    save_image(tmp_path / "root" / "b" / "anim.gif", rng_images(1, 4, 4)[0])
    (tmp_path / "root" / "README.md").write_text("not an image")
    zip_folder(tmp_path / "root", tmp_path / "root.zip")
    for source in (tmp_path / "root", tmp_path / "root.zip"):
        data = prepare(source, cache_dir=cache_dir, progress=False)
        assert data.num_images == 2
        assert ("left out 2 image file(s) of a format not read (.gif, .tif), e.g. a/scan.tif, b/anim.gif"
                in " ".join(data.meta["notes"]))


def test_a_class_folder_without_images_is_no_class_and_the_notes_say_so(tmp_path: Path, cache_dir: Path) -> None:
    """An empty class folder (an interrupted copy) is not a class, as in a labelled zip; the class ids after it
    shift, so the prepared data's notes name it (torchvision's ImageFolder refuses one)."""
    from fastddpm.data.summary import describe

    root = tmp_path / "root"
    make_class_folder(root, {"0": rng_images(2, 4, 4), "2": rng_images(2, 4, 4)})
    (root / "1").mkdir()
    (root / "0" / "thumbs").mkdir()  # deeper than a class folder: not a class either way, not named
    assert "note: 1 folder(s) hold no image read, so they are not classes: 1/" in info(root, cache_dir=cache_dir)
    # before a build, `data info` also names what `data prepare` would stop on or leave out
    save_image(root / "stray.png", rng_images(1, 4, 4)[0])
    save_image(root / "2" / "anim.gif", rng_images(1, 4, 4)[0])
    text = info(root, cache_dir=cache_dir)
    assert "note: 1 image(s) beside the class folders have no label, e.g. stray.png: `data prepare` stops" in text
    assert "left out 1 image file(s) of a format not read (.gif), e.g. 2/anim.gif" in text
    assert "stray.png: --skip-bad skips them" in info(root, cache_dir=cache_dir, skip_bad=True)
    zip_folder(root, tmp_path / "root.zip")  # a zip of it says the same
    text = info(tmp_path / "root.zip", cache_dir=cache_dir)
    assert "image(s) beside the class folders have no label, e.g. stray.png" in text and "(.gif)" in text
    (root / "stray.png").unlink()
    (root / "2" / "anim.gif").unlink()
    data = prepare(root, cache_dir=cache_dir, progress=False)
    assert list(data.class_names) == ["0", "2"] and data.labels.tolist() == [0, 0, 1, 1]
    note = "1 folder(s) hold no image read, so they are not classes: 1/ (if one should be a class, add its images)"
    assert note in data.meta["notes"]
    assert note in describe(data)
    # under split folders: a class folder empty in one split is still a class (the other split has its images)
    split_root = tmp_path / "splits"
    make_class_folder(split_root / "train", {"0": rng_images(2, 4, 4), "1": rng_images(1, 4, 4)})
    make_class_folder(split_root / "test", {"0": rng_images(1, 4, 4)})
    (split_root / "test" / "1").mkdir()
    (split_root / "test" / "7").mkdir()
    (split_root / "train" / "8").mkdir()  # the other split's: not named when test/ is read
    (split_root / "test" / "9").mkdir()
    save_image(split_root / "test" / "9" / "scan.tif", rng_images(1, 4, 4)[0])  # the unread-format note's
    test = prepare(split_root, split="test", cache_dir=cache_dir, progress=False)
    assert list(test.class_names) == ["0", "1"]
    notes = " ".join(test.meta["notes"])
    assert "1 folder(s) hold no image read, so they are not classes: test/7/ (" in notes
    assert "format not read (.tif), e.g. test/9/scan.tif" in notes
    bare = tmp_path / "bare"  # no images at all: the error names what it found instead
    (bare / "a").mkdir(parents=True)
    (bare / "b").mkdir()
    (bare / "a" / "README.txt").write_text("no images here")
    with pytest.raises(DataError, match=r"found 1 other files, e.g. a/README.txt, 2 folders without images, "
                                        r"e.g. a/, b/\)"):
        prepare(bare, cache_dir=cache_dir, progress=False)
