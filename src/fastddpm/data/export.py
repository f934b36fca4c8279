"""`fastddpm data export-images`: write a dataset as the seed's PNG folder layout, ROOT/<label>/<index>.png.

This is the form the seed notebook trained from (one small PNG per image, decoded per item in a Dataset), and
the form rung 0 of `fastddpm bench ladder` reads. Reading the folder back with `prepare(ROOT)` gives the same
pixels and labels, ordered by (label, index): files are named by their zero-padded index in the source, and
class folders are the integer labels (read back in numeric order, as class ids 0..K-1: labels with gaps, e.g.
a slice holding only classes 0 and 2, come back as 0 and 1, with class names "0" and "2"). Unlabeled images
(label -1) go straight into ROOT, which `prepare` reads as one unlabeled set.

An export is reused only when ROOT/export.json records the same pixels and labels (a SHA-256 of both) and every
PNG is still there: a source rebuilt under the same cache path, or a folder someone pruned, is written again.
"""

from __future__ import annotations

import hashlib
import json
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


def export_images(images_NCHW: np.ndarray, labels: np.ndarray, root: str | Path, *, identity: dict | None = None,
                  overwrite: bool = False, compress_level: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Write uint8 (N, C, H, W) images (C in {1, 3}) as ROOT/<label>/<index>.png.

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
    marker = root / MARKER
    if marker.is_file():
        try:
            earlier = json.loads(marker.read_text())
        except json.JSONDecodeError:
            earlier = {}
        if earlier == record and _count_pngs(root) == n:
            return ExportResult(root=root, num_images=n, reused=True)
        # an export by a version that recorded no content digest: what it holds cannot be checked, and the folder
        # holds only what an export writes, so it is written again rather than refused
        overwrite = overwrite or (earlier.get("format") == record["format"] and "content_sha256" not in earlier)
    if root.exists() and any(root.iterdir()):
        if not overwrite:
            what = ("an export of other images, or one missing files" if marker.is_file()
                    else "no export of these images")
            raise DataError(f"export-images: {root} is not empty and holds {what}; choose an empty folder or pass "
                            "--overwrite (its PNG files and class folders are replaced)")
        _clear_export(root)
    root.mkdir(parents=True, exist_ok=True)
    width = max(6, len(str(n - 1)))
    for label in np.unique(labels):
        if label >= 0:
            (root / str(int(label))).mkdir(exist_ok=True)
    for i in range(n):
        folder = root / str(int(labels[i])) if labels[i] >= 0 else root
        array_to_image(images_NCHW[i]).save(folder / f"{i:0{width}d}.png", compress_level=compress_level)
        if progress is not None and (i + 1) % 1000 == 0:
            progress(i + 1, n)
    marker.write_text(json.dumps(record, indent=2))
    return ExportResult(root=root, num_images=n, reused=False)


def _count_pngs(root: Path) -> int:
    """The PNG files an export wrote: in ROOT (unlabeled) and in its integer class folders."""
    folders = [root] + [p for p in root.iterdir() if p.is_dir() and p.name.lstrip("-").isdigit()]
    return sum(1 for folder in folders for f in folder.iterdir() if f.suffix.lower() == ".png" and f.is_file())


def _clear_export(root: Path) -> None:
    """Remove what an export writes (PNG files, integer class folders of PNGs, the marker), nothing else."""
    for path in root.iterdir():
        if path.is_file() and path.suffix.lower() == ".png" or path.name == MARKER:
            path.unlink()
        elif path.is_dir() and path.name.lstrip("-").isdigit():
            for f in path.iterdir():
                if f.is_file() and f.suffix.lower() == ".png":
                    f.unlink()
            if not any(path.iterdir()):
                path.rmdir()
    if any(root.iterdir()):
        raise DataError(f"export-images --overwrite: {root} holds files an export never writes; clear it by hand")


def export_source(source: str, root: str | Path, *, split: str = "train", limit: int | None = None,
                  overwrite: bool = False, cache_dir: Path | None = None, progress: bool = True) -> ExportResult:
    """prepare(SOURCE) (decode once into the uint8 cache), then export its first `limit` images to ROOT."""
    from fastddpm.data.prepare import prepare

    prepared = prepare(source, split=split, cache_dir=cache_dir, progress=progress)
    n = prepared.num_images if limit is None else min(limit, prepared.num_images)
    identity = {"cache": str(prepared.cache_path), "num_images": n}

    def say(done: int, total: int) -> None:
        if progress:
            print(f"export-images: {done:,}/{total:,} PNGs", flush=True)

    return export_images(np.asarray(prepared.images[:n]), prepared.labels[:n], root, identity=identity,
                         overwrite=overwrite, progress=say)
