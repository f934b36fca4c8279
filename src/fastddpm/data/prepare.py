"""prepare(): SOURCE -> the uint8 cache, decoded once and reused; info(): what prepare would use or do."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from fastddpm.data.cache import (
    CACHE_FORMAT_VERSION,
    CacheBuilder,
    CacheInvalid,
    CacheNotWritable,
    PreparedData,
    build_lock,
    default_cache_dir,
    load_prepared,
)
from fastddpm.data.decode import ArrayData, Decoded, write_array_data, write_image_listing
from fastddpm.data.errors import BadFile, DataError, bad_files_message
from fastddpm.data.options import PrepareOptions
from fastddpm.data.sources import IMAGE_FILE_KINDS, Source, read_source, resolve_source
from fastddpm.data.summary import describe, describe_source, prepare_command


def _sayer(progress: bool) -> Callable[[str], None]:
    """Status lines go to stderr with the progress bars, leaving stdout for the summary."""
    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)
    return say


def prepare(
    source: str | os.PathLike,
    *,
    split: str = "train",
    resize: int | None = None,
    resize_mode: str = "center-crop",
    image_mode: str | None = None,
    skip_bad: bool = False,
    cache_dir: Path | None = None,
    rebuild: bool = False,
    progress: bool = True,
    max_image_pixels: int = 2**26,
) -> PreparedData:
    """Decode SOURCE once into <cache_dir>/prepared/<name>/ and return it memory-mapped.

    A cache whose source fingerprint and options match is reused without decoding anything; a changed
    source is rebuilt. Raises DataError (listing every bad file, with the fix) for unusable data.
    """
    options = PrepareOptions(split=split, resize=resize, resize_mode=resize_mode, image_mode=image_mode,
                             skip_bad=skip_bad, max_image_pixels=max_image_pixels)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    say = _sayer(progress)
    # download=False first: a named dataset that is already prepared needs no download.
    src = resolve_source(source, split=options.split, cache_root=cache_root, download=False)
    final_dir = src.cache_dir(cache_root, options)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(build_lock(final_dir, say=say))
        except CacheNotWritable:
            # A read-only cache folder (a shared, prepared copy; a read-only mount) cannot be built in or
            # locked, but a complete, current cache in it needs neither: it is swapped in whole, never
            # written in place.
            reused = None if rebuild else _reuse(final_dir, src, options, say)
            if reused is not None:
                return reused
            raise
        if not rebuild:
            reused = _reuse(final_dir, src, options, say)
            if reused is not None:
                return reused
        if src.path is None:
            src = resolve_source(source, split=options.split, cache_root=cache_root, download=True, progress=progress)
        return _build(src, options, final_dir, progress=progress, say=say)


def _reuse(final_dir: Path, src: Source, options: PrepareOptions, say: Callable[[str], None]) -> PreparedData | None:
    """The existing cache if it is complete and current, else None (after saying why it is rebuilt)."""
    try:
        data = load_prepared(final_dir)
    except CacheInvalid as e:
        if final_dir.exists():
            say(f"cache unusable ({e}): rebuilding")
        return None
    # src.fingerprint is None only for a named dataset whose downloads were deleted after preparing:
    # its content is fixed by the official checksums, so the cache is still right.
    if src.fingerprint is not None and data.meta["fingerprint"] != src.fingerprint:
        say("source changed: rebuilding")
        return None
    outdated = _outdated(src, data.meta)
    if outdated is not None:
        say(f"cache written {outdated}: rebuilding")
        return None
    skipped = [BadFile(path=s["path"], reason=s["reason"], kind=s.get("kind", "corrupt")) for s in data.meta["skipped"]]
    if any(b.kind == "bomb" for b in skipped) and data.meta.get("max_image_pixels") != options.max_image_pixels:
        say(f"max_image_pixels changed ({data.meta.get('max_image_pixels')} -> {options.max_image_pixels}) and the "
            "cache skipped images over the old limit: rebuilding")
        return None
    if skipped and not options.skip_bad:
        raise DataError(
            bad_files_message(where=str(src.path or src.display), bad=skipped, total_files=data.meta["total_files"])
            + f"\n(The cache {final_dir} was prepared with --skip-bad; pass --skip-bad to use it as it is.)"
        )
    if skipped:
        _say_skipped(len(skipped), data.meta["total_files"])
    return data


def _outdated(src: Source, meta: dict) -> str | None:
    """Why a cache of this source, current by its fingerprint, was made by a reader that has changed since
    (completes "cache written ..."), or None."""
    if src.kind in IMAGE_FILE_KINDS and not meta.get("exif_upright"):
        # arrays (IDX, CIFAR, .npy/.npz) hold pixels as they are; only decoded image files changed meaning
        return "before photos were turned upright by their EXIF orientation"
    if src.kind in IMAGE_FILE_KINDS and src.split is not None and not meta.get("classes_from_all_splits"):
        # split folders: labels were numbered from this split's class folders alone, so a class missing here
        # shifted the ids of the classes after it
        return "before the class ids of split folders were shared by every split"
    if src.backslash_paths and not meta.get("backslash_paths_as_folders"):
        return "when the zip's backslash-separated paths were read as file names, not folders"
    return None


def _build(src: Source, options: PrepareOptions, final_dir: Path, *, progress: bool,
           say: Callable[[str], None]) -> PreparedData:
    say(f"preparing {src.display} ({src.label}{', ' + src.split if src.split else ''}) -> {final_dir}")
    start_s = time.monotonic()
    with CacheBuilder(final_dir) as builder:
        with read_source(src, options) as data:
            if isinstance(data, ArrayData):
                decoded = write_array_data(data, where=str(src.path), options=options, builder=builder,
                                           progress=progress)
            else:
                decoded = write_image_listing(data, options=options, builder=builder, progress=progress)
        meta = _meta(src, options, decoded, build_seconds=time.monotonic() - start_s)
        builder.commit(labels=decoded.labels, meta=meta)
    # A bad-file list from an earlier failed attempt would now be misleading.
    final_dir.with_name(final_dir.name + ".bad-files.txt").unlink(missing_ok=True)
    if decoded.skipped:
        _say_skipped(len(decoded.skipped), decoded.total_files)
    return load_prepared(final_dir)


def _say_skipped(num_skipped: int, total_files: int) -> None:
    # Printed even without progress: training on fewer images than the user has should never be silent.
    print(f"skipped {num_skipped:,} of {total_files:,} files as bad (--skip-bad); they are listed in meta.json",
          file=sys.stderr, flush=True)


def _meta(src: Source, options: PrepareOptions, decoded: Decoded, *, build_seconds: float) -> dict:
    labels = decoded.labels
    counts = np.bincount(labels[labels >= 0], minlength=len(decoded.class_names)) if len(decoded.class_names) else []
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "source": src.display,
        "source_path": str(src.path),
        "name": src.name,
        "kind": src.kind,
        "split": src.split,
        "transform": options.transform_key(),
        "fingerprint": src.fingerprint,
        "files": [str(f) for f in src.files],
        "num_images": decoded.num_images,
        "channels": decoded.channels,
        "height": decoded.height,
        "width": decoded.width,
        "labeled": decoded.labeled,
        "class_names": decoded.class_names,
        "class_counts": {name: int(n) for name, n in zip(decoded.class_names, counts)},
        "total_files": decoded.total_files,
        "skipped": [{"path": b.path, "reason": b.reason, "kind": b.kind} for b in decoded.skipped],
        "max_image_pixels": options.max_image_pixels,  # which images were refused as bombs
        "exif_upright": True,  # image files turned upright by their EXIF orientation (caches before were not)
        "classes_from_all_splits": True,  # split folders: class ids from every split's class folders (same in each)
        "backslash_paths_as_folders": True,  # zips: cat\\1.png is 1.png in the folder cat (was a file at the top)
        "notes": decoded.notes,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
        "build_seconds": round(build_seconds, 3),
    }


def info(
    source: str | os.PathLike,
    *,
    split: str = "train",
    resize: int | None = None,
    resize_mode: str = "center-crop",
    image_mode: str | None = None,
    skip_bad: bool = False,
    cache_dir: Path | None = None,
    progress: bool = True,
    max_image_pixels: int = 2**26,
) -> str:
    """Describe SOURCE and its prepared cache, if any. Never decodes, downloads or builds anything."""
    del progress, max_image_pixels  # accepted so info() takes the same options as prepare()
    options = PrepareOptions(split=split, resize=resize, resize_mode=resize_mode, image_mode=image_mode,
                             skip_bad=skip_bad)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    src = resolve_source(source, split=options.split, cache_root=cache_root, download=False)
    final_dir = src.cache_dir(cache_root, options)
    try:
        data: PreparedData | None = load_prepared(final_dir)
    except CacheInvalid:
        data = None
    current = data is not None and (src.fingerprint is None or data.meta["fingerprint"] == src.fingerprint)
    outdated = _outdated(src, data.meta) if current else None
    if current and outdated is None:
        text = describe(data)
        if src.path is None:
            text += "\n  note:        the downloaded files are gone; the prepared cache is complete without them"
        return text
    lines = describe_source(src, cache_root, skip_bad=options.skip_bad)
    command = prepare_command(src.display, options, cache_dir)
    if current:
        lines.append(f"  STALE: the cache prepared at {data.meta['created']} was written {outdated}; "
                     f"run `{command}` to rebuild {final_dir}")
    elif data is not None:
        lines.append(f"  STALE: source changed since it was prepared at {data.meta['created']} "
                     f"(fingerprint {data.meta['fingerprint']} -> {src.fingerprint}); "
                     f"run `{command}` to rebuild {final_dir}")
    else:
        lines.append(f"  not prepared yet: run `{command}`")
        for other in _other_preparations(src, cache_root, options):  # the same source read with other options
            lines.append(f"  prepared with other options: `{prepare_command(src.display, other, cache_dir)}` "
                         "(`data info` with them describes it)")
    return "\n".join(lines)


def _other_preparations(src: Source, cache_root: Path, options: PrepareOptions) -> list[PrepareOptions]:
    """The reading options of the caches of `src` (its split) prepared with other options than `options`."""
    import json

    found = []
    for meta_path in sorted((cache_root / "prepared").glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if (meta.get("name"), meta.get("source_path"), meta.get("split")) != (src.name, str(src.path), src.split):
            continue
        t = meta.get("transform") or {}
        other = PrepareOptions(split=options.split, resize=t.get("resize"),
                               resize_mode=t.get("resize_mode") or "center-crop", image_mode=t.get("image_mode"),
                               skip_bad=bool(meta.get("skipped")))
        if other.transform_key() != options.transform_key():
            found.append(other)
    return found
