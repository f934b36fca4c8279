"""`fastddpm data export-images`: the seed's PNG folder layout, read back exactly by prepare()."""

import json

import numpy as np
import pytest

from data_fixtures import real_fashion_slice
from fastddpm.data.cli import main as data_main
from fastddpm.data.errors import DataError
from fastddpm.data.export import export_images
from fastddpm.data.prepare import prepare


def test_export_roundtrip_real_fashion_mnist(tmp_path):
    images, labels = real_fashion_slice(120)
    images, labels = images[:, None], labels.astype(np.int64)  # (N, 1, 28, 28)
    root = tmp_path / "png"
    res = export_images(images, labels, root)
    assert res.num_images == 120 and not res.reused
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(str(l) for l in np.unique(labels))
    back = prepare(root, progress=False)
    order = np.lexsort((np.arange(120), labels))  # prepare reads (label, file name) order
    assert np.array_equal(np.asarray(back.images), images[order])
    assert np.array_equal(back.labels, labels[order])
    assert export_images(images, labels, root).reused  # an identical export is not rewritten


def test_an_export_of_other_pixels_or_missing_files_is_never_reused(tmp_path):
    """The same identity (a cache path rebuilt from a changed source) with other pixels, or a PNG deleted since:
    refused without --overwrite, written again with it, never handed back as reused."""
    images, labels = real_fashion_slice(30)
    images, labels = images[:, None], labels.astype(np.int64)
    root, identity = tmp_path / "png", {"cache": "/cache/fashion-mnist-train", "num_images": 30}
    assert not export_images(images, labels, root, identity=identity).reused
    changed = images.copy()
    changed[0] = 255 - changed[0]
    with pytest.raises(DataError, match="an export of other images"):
        export_images(changed, labels, root, identity=identity)
    res = export_images(changed, labels, root, identity=identity, overwrite=True)
    assert not res.reused
    assert np.array_equal(np.asarray(prepare(root, progress=False).images)[np.argsort(
        np.lexsort((np.arange(30), labels)))][0], changed[0])
    next(root.glob("*/*.png")).unlink()
    assert not export_images(changed, labels, root, identity=identity, overwrite=True).reused
    assert len(list(root.glob("*/*.png"))) == 30
    # an export written before the digest was recorded: written again, not refused and not trusted
    marker = json.loads((root / "export.json").read_text())
    del marker["content_sha256"]
    (root / "export.json").write_text(json.dumps(marker))
    assert not export_images(images, labels, root, identity=identity).reused
    assert export_images(images, labels, root, identity=identity).reused


def test_export_images_cli(tmp_path, capsys):
    src = tmp_path / "slice.npz"
    images, labels = real_fashion_slice(40)
    np.savez(src, images=images, labels=labels)
    assert data_main(["data", "export-images", str(src), str(tmp_path / "out"), "--limit", "30"]) == 0
    assert len(list((tmp_path / "out").glob("*/*.png"))) == 30
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    assert data_main(["data", "export-images", str(src), str(tmp_path / "other")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_export_images_takes_prepares_reading_options(tmp_path, capsys):
    """A folder with a bad file, another size and another mode: export-images refuses it naming --skip-bad, as
    prepare does, and with --skip-bad --resize --image-mode (prepare's options) exports it."""
    from data_fixtures import make_class_folder, save_image

    images, labels = real_fashion_slice(12)
    src = tmp_path / "src"
    make_class_folder(src, {"a": images[:6], "b": images[6:]})
    save_image(src / "a" / "big.png", np.zeros((32, 32, 3), np.uint8))  # a minority size and mode
    (src / "b" / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "out"
    assert data_main(["data", "export-images", str(src), str(out)]) == 2
    assert "--skip-bad" in capsys.readouterr().err
    assert data_main(["data", "export-images", str(src), str(out), "--skip-bad"]) == 0
    assert len(list(out.glob("*/*.png"))) == 12  # the 32x32 RGB image is a minority size: skipped too
    out2 = tmp_path / "out2"
    assert data_main(["data", "export-images", str(src), str(out2), "--skip-bad", "--resize", "16",
                      "--image-mode", "RGB"]) == 0
    back = prepare(out2, progress=False)
    assert back.num_images == 13 and (back.channels, back.height, back.width) == (3, 16, 16)


def test_export_keeps_class_names_where_they_read_back_as_the_same_ids(tmp_path):
    """Named class folders (or an .npz's class_names) come back with their names and ids; names the reader would
    sort into other ids keep integer folders, which read back as the same ids."""
    from data_fixtures import make_class_folder

    images, labels = real_fashion_slice(30)
    src = tmp_path / "named"
    make_class_folder(src, {"pullover": images[:7], "trouser": images[7:16], "tshirt": images[16:]})
    first = prepare(src, progress=False)
    assert data_main(["data", "export-images", str(src), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["pullover", "trouser", "tshirt"]
    back = prepare(tmp_path / "out", progress=False)
    assert list(back.class_names) == list(first.class_names) == ["pullover", "trouser", "tshirt"]
    assert np.array_equal(back.labels, first.labels) and np.array_equal(back.images, first.images)
    assert data_main(["data", "export-images", str(src), str(tmp_path / "out")]) == 0  # reused, not refused
    # names not in sorted order: sorted folders would swap the ids, so the folders are the integer labels
    y = np.arange(30) % 2
    unsorted = tmp_path / "unsorted.npz"
    np.savez(unsorted, images=images, labels=y, class_names=np.array(["zebra", "apple"]))
    assert data_main(["data", "export-images", str(unsorted), str(tmp_path / "out2")]) == 0
    assert sorted(p.name for p in (tmp_path / "out2").iterdir() if p.is_dir()) == ["0", "1"]
    assert np.array_equal(np.bincount(prepare(tmp_path / "out2", progress=False).labels), np.bincount(y))


def test_names_the_reader_would_skip_or_merge_keep_integer_folders_and_an_older_export_is_renamed(tmp_path):
    """`.a` and `__MACOSX` folders are skipped by the reader (their images were lost on read-back without a word),
    names that are all split names read as split folders, and names one file system takes as one merge; an
    export written before names were kept (integer folders, same images) was refused as 'other images'."""
    from fastddpm.data.export import export_images, folder_names

    labels = np.array([0, 0, 1, 1])
    for names in ([".a", "b"], ["__MACOSX", "b"], ["test", "train"], ["caf\u00e9", "cafe\u0301"], ["aux", "b"],
                  ["a.", "b"]):
        assert folder_names(names, labels) is None, names
    assert folder_names(["cat", "dog"], labels) == ["cat", "dog"]
    # only the classes with images are folders the reader sees: "test" and "train" alone read as split folders
    # (one of them lost) though "cat" has none; an absent class's odd name ("T-shirt/top") is written nowhere
    assert folder_names(["cat", "test", "train"], np.array([1, 1, 2, 2])) is None
    assert folder_names(["T-shirt/top", "bag", "coat"], np.array([1, 2])) == ["T-shirt/top", "bag", "coat"]
    # apple, b read back as ids 0 and 1, as integer folders 1 and 2 would (docstring): the names at least are kept
    assert folder_names(["zebra", "apple", "b"], np.array([1, 2])) == ["zebra", "apple", "b"]
    images = real_fashion_slice(4)[0][:, None]  # (N, 1, 28, 28)
    export_images(images, labels, tmp_path / "out")  # an older export: integer folders, no names recorded
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["0", "1"]
    export_images(images, labels, tmp_path / "out", class_names=["cat", "dog"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["cat", "dog"]
    back = prepare(tmp_path / "out", progress=False)
    assert list(back.class_names) == ["cat", "dog"] and np.array_equal(back.images, images)
    with pytest.raises(DataError, match="holds an export of other images"):  # other pixels still need --overwrite
        export_images(images[::-1].copy(), labels, tmp_path / "out", class_names=["cat", "dog"])
