"""`fastddpm data export-images`: the seed's PNG folder layout, read back exactly by prepare()."""

import numpy as np

from data_fixtures import real_fashion_slice
from fastddpm.data.cli import main as data_main
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
