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
