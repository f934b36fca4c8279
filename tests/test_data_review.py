"""`fastddpm data` on folders a user makes: what export-images --overwrite removes, and when."""

import numpy as np
import pytest

from fastddpm.data.errors import DataError
from fastddpm.data.export import export_images


def _images(n: int, value: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((n, 1, 8, 8), value, dtype=np.uint8), np.arange(n, dtype=np.int64) % 2


@pytest.mark.parametrize("stray", ["notes.txt", "0/notes.txt"])
def test_export_images_overwrite_over_a_folder_with_other_files_refuses_before_removing_anything(tmp_path, stray):
    """A file an export never writes, beside the export or in one of its class folders: --overwrite refuses
    naming it and leaves the earlier export whole (it had removed the earlier PNGs and export.json, then
    refused, leaving neither export)."""
    root = tmp_path / "png"
    export_images(*_images(6, 10), root)
    (root / stray).write_text("mine")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(DataError, match=r"never writes \(" + stray.replace(".", r"\.") + r"\); nothing was removed"):
        export_images(*_images(6, 200), root, overwrite=True)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert export_images(*_images(6, 10), root).reused  # the earlier export is still whole
    (root / stray).unlink()
    assert not export_images(*_images(6, 200), root, overwrite=True).reused
    assert len(list(root.glob("*/*.png"))) == 6
