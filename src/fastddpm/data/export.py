"""`fastddpm data export-images`: write a dataset as the seed's PNG folder layout, ROOT/<label>/<index>.png.

This is the form the seed notebook trained from (one small PNG per image, decoded per item in a Dataset), and
the form rung 0 of `fastddpm bench ladder` reads. Reading the folder back with `prepare(ROOT)` gives the same
pixels and labels, ordered by (label, index): files are named by their zero-padded index in the source. Class
folders carry the source's class names where the image-folder reader gives them back as the same ids: it sorts
names (numeric order when all are integers), so names already in that order, each a valid folder name, are
written as they are; otherwise (Fashion-MNIST's "T-shirt/top", "Trouser", ... are neither) the folders are the
integer labels, read back in numeric order as class ids 0..K-1 (labels with gaps, e.g. a slice holding only
classes 0 and 2, come back as 0 and 1, with class names "0" and "2"). Unlabeled images (label -1) go straight
into ROOT, which `prepare` reads as one unlabeled set.

An export is reused only when ROOT/export.json records the same pixels and labels (a SHA-256 of both) and every
PNG is still there: a source rebuilt under the same cache path, or a folder someone pruned, is written again.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from fastddpm.data.errors import DataError
from fastddpm.data.images import array_to_image

MARKER = "export.json"  # written last: a folder without it is an interrupted export


@dataclass
class ExportResult:
    root: Path
    num_images: int
    reused: bool  # True: an identical, complete export was already there


_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def folder_names(class_names, labels: np.ndarray) -> list[str] | None:
    """The class folder of each class id, from the source's class names; None (integer folders) where reading
    the folders back would not give the same names in the same order: a name that is no plain folder name, two
    names a case-insensitive file system would merge, or names whose sorted order (the reader's) is not the id
    order. Only the classes that have images count: the reader sees no other folder."""
    from fastddpm.data.imagefolder import class_order, skip_name
    from fastddpm.data.options import SPLIT_ALIASES

    k = int(labels.max()) + 1 if labels.size and labels.max() >= 0 else 0
    names = [str(n) for n in class_names]
    if k == 0 or len(names) < k:
        return None
    names = names[:k]
    used = [names[c] for c in np.unique(labels[labels >= 0])]  # the folders written, in id order
    if all(n.isdigit() for n in used):  # integer folders already; "1", "2", "3" would read back as ids 0-2
        return None
    # a folder the reader skips (.hidden, __MACOSX), or names that all read as split folders (train/, test/), or
    # names a file system would take as one (case, Unicode normalisation) or refuse (Windows' reserved names)
    plain = all(n and n.strip() == n and not n.endswith(".") and not skip_name(n) and n.isprintable()
                and not any(ch in n for ch in '/\\:*?"<>|') and n.split(".")[0].upper() not in _RESERVED
                for n in used)
    folded = {unicodedata.normalize("NFC", n).casefold() for n in used}
    if (not plain or len(folded) < len(used) or all(n.lower() in SPLIT_ALIASES for n in used)
            or class_order(set(used)) != used):
        return None
    return names


def export_images(images_NCHW: np.ndarray, labels: np.ndarray, root: str | Path, *, identity: dict | None = None,
                  overwrite: bool = False, compress_level: int = 1,
                  progress: Callable[[int, int], None] | None = None,
                  class_names=()) -> ExportResult:
    """Write uint8 (N, C, H, W) images (C in {1, 3}) as ROOT/<label>/<index>.png.

    <label> is the class's name where `class_names` (by id) read back as the same ids (see folder_names), else
    the integer label.

    `identity` (any JSON-able dict, e.g. the prepared cache's path and the count) is stored in ROOT/export.json;
    a complete export with the same identity is reused. A non-empty ROOT holding anything else is an error
    unless `overwrite`. compress_level=1: PNG's deflate is the slow part of writing and has no effect on pixels.
    """
    root = Path(root)
    if images_NCHW.ndim != 4 or images_NCHW.dtype != np.uint8 or images_NCHW.shape[1] not in (1, 3):
        raise DataError(f"export-images: expected uint8 (N, C, H, W) images with C = 1 or 3, got "
                        f"{images_NCHW.dtype} {tuple(images_NCHW.shape)}")
    n = int(images_NCHW.shape[0])
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (n,):
        raise DataError(f"export-images: {labels.shape[0]} labels for {n} images")
    content = hashlib.sha256(np.ascontiguousarray(images_NCHW).data)
    content.update(np.ascontiguousarray(labels).data)
    record = {"format": "fastddpm-png-folder-1", "num_images": n, "shape_CHW": list(images_NCHW.shape[1:]),
              "content_sha256": content.hexdigest(), "identity": identity or {}}
    names = folder_names(class_names, labels)
    if names is not None:  # recorded only then: an export with integer folders keeps the record earlier ones have
        record["class_folders"] = names
    marker = root / MARKER
    earlier: dict = {}
    if marker.is_file():
        try:
            earlier = json.loads(marker.read_text())
        except json.JSONDecodeError:
            earlier = {}
        if earlier == record and _count_pngs(root, names or []) == n:
            return ExportResult(root=root, num_images=n, reused=True)
        # an export by a version that recorded no content digest: what it holds cannot be checked, and the folder
        # holds only what an export writes, so it is written again rather than refused
        overwrite = overwrite or (earlier.get("format") == record["format"] and "content_sha256" not in earlier)
        # the same images exported under other class folder names (integer folders, by a version that kept no
        # names): what it holds is this export's, so it is written again under the names
        overwrite = overwrite or (earlier.get("content_sha256") == record["content_sha256"]
                                  and earlier.get("class_folders") != record.get("class_folders"))
    if root.exists() and any(root.iterdir()):
        if not overwrite:
            what = ("an export of other images, or one missing files" if marker.is_file()
                    else "no export of these images")
            raise DataError(f"export-images: {root} is not empty and holds {what}; choose an empty folder or pass "
                            "--overwrite (its PNG files and class folders are replaced)")
        _clear_export(root, earlier.get("class_folders") or [])
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"export-images: cannot create {root} ({e.strerror or e}): give a folder that can be created "
                        "and written") from None
    width = max(6, len(str(n - 1)))
    folder_of = names or [str(c) for c in range(int(labels.max()) + 1 if n else 0)]
    for label in np.unique(labels):
        if label >= 0:
            (root / folder_of[label]).mkdir(exist_ok=True)
    for i in range(n):
        folder = root / folder_of[labels[i]] if labels[i] >= 0 else root
        array_to_image(images_NCHW[i]).save(folder / f"{i:0{width}d}.png", compress_level=compress_level)
        if progress is not None and (i + 1) % 1000 == 0:
            progress(i + 1, n)
    marker.write_text(json.dumps(record, indent=2))
    return ExportResult(root=root, num_images=n, reused=False)


def _ours(path: Path, class_folders: list[str]) -> bool:
    """Whether `path` is a class folder an export writes: an integer one, or one its record names."""
    return path.is_dir() and (path.name.lstrip("-").isdigit() or path.name in class_folders)


def _count_pngs(root: Path, class_folders: list[str]) -> int:
    """The PNG files an export wrote: in ROOT (unlabeled) and in its class folders."""
    folders = [root] + [p for p in root.iterdir() if _ours(p, class_folders)]
    return sum(1 for folder in folders for f in folder.iterdir() if f.suffix.lower() == ".png" and f.is_file())


def _clear_export(root: Path, class_folders: list[str]) -> None:
    """Remove what an export writes (PNG files, class folders of PNGs: integer ones and those its record names,
    the marker), nothing else. Anything else in ROOT is refused before a file is removed: a refusal after the
    removal left the folder without the earlier export and still not written."""
    foreign = []
    for path in sorted(root.iterdir()):
        if _ours(path, class_folders):
            foreign += [f for f in sorted(path.iterdir()) if not (f.is_file() and f.suffix.lower() == ".png")]
        elif not (path.is_file() and path.suffix.lower() == ".png" or path.name == MARKER):
            foreign.append(path)
    if foreign:
        named = ", ".join(str(p.relative_to(root)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DataError(f"export-images --overwrite: {root} holds {len(foreign)} file(s) or folder(s) an export "
                        f"never writes ({named}); nothing was removed. Move them out of it, or choose an empty "
                        "folder")
    for path in root.iterdir():
        if path.is_file() and path.suffix.lower() == ".png" or path.name == MARKER:
            path.unlink()
        elif _ours(path, class_folders):
            for f in path.iterdir():
                f.unlink()
            path.rmdir()


def export_source(source: str, root: str | Path, *, split: str = "train", limit: int | None = None,
                  overwrite: bool = False, cache_dir: Path | None = None, progress: bool = True,
                  resize: int | None = None, resize_mode: str = "center-crop", image_mode: str | None = None,
                  skip_bad: bool = False) -> ExportResult:
    """prepare(SOURCE) (decode once into the uint8 cache, with prepare's data-reading options), then export its
    first `limit` images to ROOT."""
    from fastddpm.data.prepare import prepare
    from fastddpm.data.sources import refuse_output_among_images
    from fastddpm.rundir.files import check_writable_dir

    check_writable_dir(Path(root), flag="export-images", fix="give a folder that can be created and written: new, "
                       "empty, or an earlier export's")  # before the source is decoded
    refuse_output_among_images(source, root, flag="export-images OUT_DIR", what="the exported PNGs")
    prepared = prepare(source, split=split, cache_dir=cache_dir, progress=progress, resize=resize,
                       resize_mode=resize_mode, image_mode=image_mode, skip_bad=skip_bad)
    n = prepared.num_images if limit is None else min(limit, prepared.num_images)
    identity = {"cache": str(prepared.cache_path), "num_images": n}

    def say(done: int, total: int) -> None:
        if progress:
            print(f"export-images: {done:,}/{total:,} PNGs", flush=True)

    return export_images(np.asarray(prepared.images[:n]), prepared.labels[:n], root, identity=identity,
                         overwrite=overwrite, progress=say, class_names=prepared.class_names)
