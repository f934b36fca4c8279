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


def test_class_folders_holding_only_subfolders_of_images_are_named_in_a_note():
    """`ROOT/animals/{cat,dog}/` reads as the one class `animals` (as torchvision's ImageFolder reads it), where the
    subfolders may have been meant as the classes: said, with the way to read them so."""
    from fastddpm.data.imagefolder import plan_layout

    paths = ["animals/cat/1.png", "animals/dog/2.png", "plants/3.png", "plants/old/4.png", "rocks/granite/5.png"]
    layout = plan_layout(paths, split="train", where="ROOT", strip_top=False)
    assert layout.class_names == ["animals", "plants", "rocks"]  # the layout read as before
    assert layout.notes == ["1 class folder(s) hold their images only in subfolders, each read as one class: "
                            "animals/ (cat, dog); to train on the subfolders as the classes, give the class folder "
                            "itself as the source (e.g. animals/ under the folder given)"]
    assert plan_layout(["a/1.png", "b/2.png"], split="train", where="ROOT", strip_top=False).notes == []
