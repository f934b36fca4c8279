"""Where source pixels become the rows of the uint8 cache: the one decode a dataset ever gets.

Readers hand over one of two things:
  ArrayData     sources that are already one uint8 array (IDX, CIFAR, .npy/.npz): copied in chunks,
                or sent through Pillow one image at a time when a resize or mode change is asked for;
  ImageListing  one entry per image file (folders, zips): header pass, majority shape, full decode.
Both stream rows into the cache file, so memory stays at one chunk however large the dataset is.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np

from fastddpm.data.errors import MAX_LISTED_BAD_FILES, BadFile, DataError, bad_files_message
from fastddpm.data.images import (
    CONVERTIBLE_MODES,
    BadImage,
    OpenFn,
    Probe,
    Target,
    array_to_image,
    decode_image,
    finish_image,
    probe_image,
)
from fastddpm.data.options import PrepareOptions
from fastddpm.progress import progress_bar

if TYPE_CHECKING:
    from fastddpm.data.cache import CacheBuilder

# Rows per chunk: big enough to amortise thread-pool overhead on 28x28 images, small enough that a
# chunk of 256x256 RGB images (~100 MB) still fits comfortably in RAM.
_CHUNK_IMAGES = 512
# Pillow releases the GIL while decoding and resampling, so threads give real parallelism for large
# images; past ~8 the file system, not the CPU, is the limit.
_DECODE_THREADS = min(8, os.cpu_count() or 1)

_MODE_NAMES = {"P": "palette", "PA": "palette with alpha", "RGBA": "RGB with alpha", "LA": "grey with alpha",
               "1": "1-bit"}


@dataclass(kw_only=True)
class ArrayData:
    """A source that is already one array of pixels."""

    images_nchw: np.ndarray  # uint8 (N, C, H, W), C in {1, 3, 4}; may be a read-only view of the source
    labels: np.ndarray  # int64 (N,); -1 where the source has no labels
    class_names: list[str]
    notes: list[str] = field(default_factory=list)


@dataclass(kw_only=True, frozen=True)
class ImageEntry:
    """One image file of a folder or zip."""

    path: str  # as shown to the user: relative to the folder, or the member name in the zip
    label: int  # index into class_names, or -1 for an unlabeled set
    size_bytes: int  # 0 means an empty file; -1 when the size could not be read
    open: OpenFn


@dataclass(kw_only=True)
class ImageListing:
    """The image files of a folder/zip, in a fixed order, with what the layout told us."""

    where: str  # the folder or zip path, for messages
    entries: list[ImageEntry]
    class_names: list[str]
    labeled: bool
    layout_bad: list[BadFile] = field(default_factory=list)  # e.g. stray images beside class folders
    notes: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Decoded:
    """What a decode wrote into the cache, for meta.json."""

    num_images: int
    channels: int
    height: int
    width: int
    labels: np.ndarray  # int64 (num_images,)
    class_names: list[str]
    labeled: bool
    skipped: list[BadFile]
    total_files: int  # files considered, good and bad (== num_images for array sources)
    notes: list[str]


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(start + size, n))


def write_array_data(data: ArrayData, *, where: str, options: PrepareOptions, builder: CacheBuilder,
                     progress: bool) -> Decoded:
    """Copy (or resize/convert) an in-memory source into the cache."""
    n, c, h, w = data.images_nchw.shape
    if n == 0:
        raise DataError(f"{where} holds no images (shape {data.images_nchw.shape}). Fix: check the file.")
    source_mode = {1: "L", 3: "RGB", 4: "RGBA"}[c]
    if source_mode == "RGBA" and options.image_mode is None:
        raise DataError(
            f"{where}: images have 4 channels (RGBA), but a DDPM trains on L or RGB. "
            "Fix: pass --image-mode RGB (drops alpha) or --image-mode L."
        )
    out_mode = options.image_mode or source_mode
    out_c = 1 if out_mode == "L" else 3
    out_h, out_w = (options.resize, options.resize) if options.resize is not None else (h, w)
    per_image = out_mode != source_mode or (out_h, out_w) != (h, w)

    _check_free_space(builder, (n, out_c, out_h, out_w))
    writer = builder.open_images((n, out_c, out_h, out_w))
    peak = 0  # the brightest source pixel, taken from the chunks as they pass: no second read of the array
    with progress_bar(n, desc="writing cache", unit="img", disable=not progress) as bar:
        if not per_image:
            for rows in _chunks(n, 8 * _CHUNK_IMAGES):
                chunk = np.ascontiguousarray(data.images_nchw[rows.start:rows.stop])
                peak = max(peak, int(chunk.max()))
                writer.write(chunk)
                bar.update(len(rows))
        else:
            def one(i: int) -> np.ndarray:
                im = array_to_image(np.asarray(data.images_nchw[i]))
                return finish_image(im, image_mode=options.image_mode, resize=options.resize,
                                    resize_mode=options.resize_mode)

            with concurrent.futures.ThreadPoolExecutor(_DECODE_THREADS) as pool:
                for rows in _chunks(n, _CHUNK_IMAGES):
                    peak = max(peak, int(np.asarray(data.images_nchw[rows.start:rows.stop]).max()))
                    writer.write(np.stack(list(pool.map(one, rows))))
                    bar.update(len(rows))
    writer.close()
    notes = list(data.notes)
    if peak <= 1:
        dark = dim_pixels_note(where, peak)
        # printed even without progress, like skipped files: the run would otherwise learn black images unawares
        print(f"warning: {dark}", file=sys.stderr, flush=True)
        notes.append(dark)
    labels = np.asarray(data.labels, dtype=np.int64)
    gaps = class_gaps_note(where, labels, len(data.class_names))
    if gaps is not None:
        print(f"warning: {gaps}", file=sys.stderr, flush=True)
        notes.append(gaps)
    return Decoded(num_images=n, channels=out_c, height=out_h, width=out_w, labels=labels,
                   class_names=list(data.class_names), labeled=bool((labels >= 0).any()), skipped=[],
                   total_files=n, notes=notes)


def class_gaps_note(where: str, labels: np.ndarray, num_classes: int) -> str | None:
    """What class ids without an image mean, or None when every id from 0 up has one. The ids are kept as the
    file gives them (class names and a model's `--class` are by id), so the fix is the user's to choose."""
    present = np.unique(labels[labels >= 0])
    missing = num_classes - len(present)
    if not len(present) or missing <= 0:
        return None
    shown = ", ".join(str(int(i)) for i in present[:12]) + (", ..." if len(present) > 12 else "")
    return (f"{where}: the labels use {len(present):,} of the class ids 0-{num_classes - 1} ({shown}); the other "
            f"{missing:,} ids have no image, yet a conditional model trains a class for each of them. If the ids "
            f"are codes rather than class numbers, save np.unique(labels, return_inverse=True)[1] as the labels "
            f"(ids 0-{len(present) - 1}, in the same order) and prepare again with --rebuild")


def dim_pixels_note(where: str, peak: int) -> str:
    """What a uint8 array whose pixels are all 0 or 1 means: images scaled to [0, 1] and then cast to uint8,
    which a prepared dataset reads as 0..255 and so as near-black."""
    return (f"{where}: the brightest pixel of these uint8 images is {peak}, so they train as near-black images "
            "(uint8 pixels are read as 0..255). If they were scaled to [0, 1] before the cast, save "
            "(x * 255).round().astype(np.uint8) of the float images instead and prepare again with --rebuild")


def _describe_mode(mode: str) -> str:
    return f"mode {mode} ({_MODE_NAMES[mode]})" if mode in _MODE_NAMES else f"mode {mode}"


def _choose_target(probes: dict[int, Probe], options: PrepareOptions) -> tuple[Target | None, dict[int, BadImage]]:
    """The majority mode and size are what is expected; everything else is a bad file with a reason.

    Returns (target, bad-by-entry-index); target is None when no file is usable.
    """
    bad: dict[int, BadImage] = {}
    if options.image_mode is not None:
        expected_mode = options.image_mode
        for i, p in probes.items():
            if p.mode not in CONVERTIBLE_MODES:
                bad[i] = BadImage(f"{_describe_mode(p.mode)} cannot be converted to {expected_mode}", "mode")
    else:
        for i, p in probes.items():
            if p.mode not in ("L", "RGB"):
                bad[i] = BadImage(f"{_describe_mode(p.mode)} is not L or RGB: pass --image-mode L or RGB "
                                  "to convert it", "mode")
        modes = collections.Counter(p.mode for i, p in probes.items() if i not in bad)
        if not modes:
            return None, bad
        expected_mode = modes.most_common(1)[0][0]  # ties: the mode seen first, in sorted file order
        for i, p in probes.items():
            if i not in bad and p.mode != expected_mode:
                bad[i] = BadImage(f"mode {p.mode}, but most images are {expected_mode}", "mode")

    expected_size = None
    if options.resize is None:
        sizes = collections.Counter((p.width, p.height) for i, p in probes.items() if i not in bad)
        if not sizes:
            return None, bad
        expected_size = sizes.most_common(1)[0][0]
        ew, eh = expected_size
        for i, p in probes.items():
            if i not in bad and (p.width, p.height) != expected_size:
                bad[i] = BadImage(f"size {p.width}x{p.height}, but most images are {ew}x{eh}", "size")
    if len(bad) == len(probes):
        return None, bad
    target = Target(image_mode=options.image_mode, expected_mode=expected_mode, expected_size=expected_size,
                    resize=options.resize, resize_mode=options.resize_mode, max_pixels=options.max_image_pixels)
    return target, bad


def write_image_listing(listing: ImageListing, *, options: PrepareOptions, builder: CacheBuilder,
                        progress: bool) -> Decoded:
    """Header pass, majority shape, full decode; strict mode fails listing every bad file."""
    entries = listing.entries
    total_files = len(entries) + len(listing.layout_bad)

    # 1. Header pass (cheap): catches empty/non-image/bomb/16-bit files and learns every size and mode.
    #    Kept on the main thread: it is I/O-light, and Pillow's bomb-warning filter is not thread-safe.
    probes: dict[int, Probe] = {}
    bad: dict[int, BadImage] = {}
    with progress_bar(len(entries), desc="checking headers", unit="img", disable=not progress) as bar:
        for i, entry in enumerate(entries):
            try:
                probes[i] = probe_image(entry.open, size_bytes=entry.size_bytes, max_pixels=options.max_image_pixels)
            except BadImage as e:
                bad[i] = e
            bar.update(1)
    target, shape_bad = _choose_target(probes, options)
    bad.update(shape_bad)

    def report(extra: dict[int, BadImage]) -> list[BadFile]:
        merged = {**bad, **extra}
        return list(listing.layout_bad) + [
            BadFile(path=entries[i].path, reason=merged[i].reason, kind=merged[i].kind) for i in sorted(merged)]

    if target is None:
        raise DataError(_strict_message(listing.where, report({}), total_files, builder))

    # 2. Full decode of every file that passed the header checks. In strict mode with bad files already
    #    known we still decode (without writing) so the user gets the truncated files in the same list.
    good = [i for i in range(len(entries)) if i not in bad]
    keep_writing = options.skip_bad or not (bad or listing.layout_bad)
    side_h, side_w = (options.resize, options.resize) if options.resize else target.expected_size[::-1]
    out_shape = (len(good), target.channels, side_h, side_w)
    writer = None
    if keep_writing:
        _check_free_space(builder, out_shape)
        writer = builder.open_images(out_shape)
    decode_bad: dict[int, BadImage] = {}
    kept: list[int] = []

    def one(i: int) -> np.ndarray | BadImage:
        try:
            return decode_image(entries[i].open, target=target)
        except BadImage as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(_DECODE_THREADS) as pool, \
            progress_bar(len(good), desc="decoding", unit="img", disable=not progress) as bar:
        for rows in _chunks(len(good), _CHUNK_IMAGES):
            indices = [good[j] for j in rows]
            ok: list[np.ndarray] = []
            for i, result in zip(indices, pool.map(one, indices)):
                if isinstance(result, BadImage):
                    decode_bad[i] = result
                else:
                    ok.append(result)
                    kept.append(i)
            if writer is not None and ok:
                writer.write(np.stack(ok))
            bar.update(len(rows))

    skipped = report(decode_bad)
    if not kept or (skipped and not options.skip_bad):  # nothing left, or strict mode with bad files
        raise DataError(_strict_message(listing.where, skipped, total_files, builder))
    assert writer is not None  # without bad files or with skip_bad, every good row was written
    writer.close()
    labels = np.array([entries[i].label for i in kept], dtype=np.int64)
    return Decoded(num_images=len(kept), channels=target.channels, height=side_h, width=side_w, labels=labels,
                   class_names=list(listing.class_names), labeled=listing.labeled, skipped=skipped,
                   total_files=total_files, notes=list(listing.notes))


def _strict_message(where: str, bad: list[BadFile], total_files: int, builder: CacheBuilder) -> str:
    full_list = None
    if len(bad) > MAX_LISTED_BAD_FILES:
        # The error shows the first lines; the file next to the cache holds every one of them.
        full_list = builder.final_dir.with_name(builder.final_dir.name + ".bad-files.txt")
        full_list.parent.mkdir(parents=True, exist_ok=True)
        full_list.write_text("".join(f"{b.path}\t{b.reason}\n" for b in bad), encoding="utf-8")
    return bad_files_message(where=where, bad=bad, total_files=total_files, full_list_path=full_list)


def _check_free_space(builder: CacheBuilder, shape_nchw: tuple[int, int, int, int]) -> None:
    """Fail before a long decode, not after it, when the cache cannot fit on the disk."""
    needed = int(np.prod(shape_nchw, dtype=np.int64))
    free = shutil.disk_usage(builder.temp_dir).free
    if needed > free:
        raise DataError(
            f"the cache needs {needed / 2**20:,.0f} MiB ({shape_nchw} uint8) but {builder.temp_dir.parent} has only "
            f"{free / 2**20:,.0f} MiB free. Fix: free some space, or pass --cache-dir / set FASTDDPM_CACHE to a "
            "bigger disk."
        )
