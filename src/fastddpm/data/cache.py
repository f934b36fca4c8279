"""Decode once: the prepared-dataset cache on disk, and how it is built without ever being half-written.

Layout: <cache_dir>/prepared/<slug>-<key>/{images.npy, labels.npy, meta.json}
  images.npy  uint8 (N, C, H, W), memory-mapped by training: no decode, no per-file I/O, page cache only
  labels.npy  int64 (N,), -1 where the source has no labels
  meta.json   what was read, how, its fingerprint, per-class counts, skipped files (written last)

A build goes into a temp directory beside the final one and is renamed into place only when complete
and fsynced, so a crash, Ctrl-C or full disk leaves either the old cache or nothing, never a mixture.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from fastddpm.data.errors import DataError
from fastddpm.rundir.flock import NO_LOCK_ERRNOS, is_the_file_at

CACHE_FORMAT_VERSION = 1  # bump when the layout or meaning of a cache changes; old caches then rebuild
IMAGES_FILE = "images.npy"
LABELS_FILE = "labels.npy"
META_FILE = "meta.json"
# A fixed-size .npy header (a multiple of 64 so the pixel data stays aligned for mmap). Fixed size lets
# us write the header before knowing how many images survive, and patch N in place at the end.
_NPY_HEADER_BYTES = 128


def default_cache_dir() -> Path:
    """$FASTDDPM_CACHE if set, else ~/.cache/fastddpm."""
    env = os.environ.get("FASTDDPM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastddpm"


@dataclass(kw_only=True)
class PreparedData:
    """A prepared dataset: uint8 pixels memory-mapped from the cache, labels in RAM."""

    images: np.ndarray = field(repr=False)  # uint8 (N, C, H, W), read-only np.memmap of images.npy
    labels: np.ndarray = field(repr=False)  # int64 (N,); -1 where the source has no labels
    class_names: list[str]  # label -> name; empty for an unlabeled set
    meta: dict = field(repr=False)  # the contents of meta.json
    cache_path: Path  # the cache directory

    @property
    def num_images(self) -> int:
        return int(self.images.shape[0])

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def height(self) -> int:
        return int(self.images.shape[2])

    @property
    def width(self) -> int:
        return int(self.images.shape[3])

    def identity(self, samples: int = 1024) -> dict:
        """What a resumed run must train on again: the image count and shape, the class names, a SHA-256 of the
        pixels and labels of up to `samples` images spread evenly over the set (sample_sha256), and of the pixels
        alone (pixels_sha256: what an unconditional model reads). The same for the same images read from anywhere
        (a moved folder, another cache); another dataset, another resize or image mode differ. The samples bound
        the bytes read (1,024 images: 0.8 MB at 28x28, 200 MB at 256x256 RGB, read once at start-up)."""
        index = np.unique(np.linspace(0, self.num_images - 1, min(samples, self.num_images)).round().astype(np.int64))
        pixels = hashlib.sha256(np.ascontiguousarray(self.images[index]).tobytes())
        with_labels = pixels.copy()  # the pixels are read and hashed once
        with_labels.update(np.ascontiguousarray(self.labels[index], dtype=np.int64).tobytes())
        return {"num_images": self.num_images, "image_shape": [self.channels, self.height, self.width],
                "class_names": list(self.class_names), "sample_sha256": with_labels.hexdigest()[:16],
                "pixels_sha256": pixels.hexdigest()[:16]}

    @property
    def built(self) -> str | None:
        """When these pixels were first written (meta.json's `pixels_built`; `created` for a cache written before
        that was recorded): a rebuild under the same directory name (prepare --rebuild, a format upgrade) keeps the
        name and the source's fingerprint but may change the pixels, so whatever was computed from the pixels
        records this and is recomputed when it differs. A rebuild that writes the same images, labels and class
        names keeps it: a feature network retrained for identical pixels would move every FID measured after it."""
        return built_of(self.meta)

    def computed_from_this_build(self, recorded: str | None, derived: Path) -> bool:
        """Whether a file computed from these pixels (`recorded`: the `built` it stored, None for a file written
        before that was stored) still matches them. Without a record, a file older than this build cannot be of it."""
        if self.built is None:
            return True
        if recorded is not None:
            return recorded == self.built
        import datetime

        built_s = datetime.datetime.fromisoformat(self.built).timestamp()
        return derived.stat().st_mtime >= built_s


def same_images(saved: dict, now: dict, *, labels: bool) -> bool:
    """Whether two PreparedData.identity() records are the same data: with their labels and class names where
    `labels` (a conditional model reads them), else the pixels alone. A record written before pixels_sha256 was
    kept is compared whole."""
    keys = ["num_images", "image_shape"]
    keys += ["pixels_sha256"] if not labels and "pixels_sha256" in saved else ["class_names", "sample_sha256"]
    return all(saved.get(k) == now.get(k) for k in keys)


def describe_identity(identity: dict) -> str:
    """A PreparedData.identity() as a reader compares two: "60,000 images (1, 28, 28), classes a, b, c, d, ..."."""
    classes = identity.get("class_names") or []
    return (f"{identity.get('num_images', 0):,} images {tuple(identity.get('image_shape') or ())}"
            + (f", classes {', '.join(classes[:4])}{', ...' if len(classes) > 4 else ''}" if classes else ""))


def cache_dir_name(*, slug: str, identity: dict, split: str | None, transform: dict) -> str:
    """<slug>-<16 hex>: readable in `ls`, unique per (source identity, split, pixel-changing options)."""
    blob = json.dumps({"source": identity, "split": split, "transform": transform}, sort_keys=True)
    key = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", slug).strip("-.")[:48] or "data"
    return f"{slug}-{key}"


def built_of(meta: dict) -> str | None:
    """A cache's `built` (PreparedData.built) from its meta.json."""
    return meta.get("pixels_built") or meta.get("created")


class CacheInvalid(Exception):
    """A cache directory that cannot be used as it is; the message says why (shown by `info`)."""


class CacheNotWritable(DataError):
    """The cache folder cannot be written (a read-only mount, no permission): nothing can be built there, but a
    complete cache in it can still be read."""


_NOT_WRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def _not_writable(folder: Path, e: OSError) -> CacheNotWritable:
    return CacheNotWritable(
        f"cannot write in the cache folder {folder} ({e.strerror or e}). Fix: pass --cache-dir DIR or set "
        f"FASTDDPM_CACHE to a folder you can write, or make {folder} writable."
    )


def load_prepared(path: Path) -> PreparedData:
    """Open a complete cache directory, checking that its files agree with meta.json."""
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CacheInvalid(f"no {META_FILE} in {path}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CacheInvalid(f"unreadable {meta_path} ({e})") from None
    if meta.get("format_version") != CACHE_FORMAT_VERSION:
        raise CacheInvalid(f"{path} was written by cache format {meta.get('format_version')!r}, "
                           f"this version uses {CACHE_FORMAT_VERSION}")
    try:
        images = np.load(path / IMAGES_FILE, mmap_mode="r", allow_pickle=False)
        labels = np.load(path / LABELS_FILE, allow_pickle=False)
    except (OSError, ValueError) as e:  # missing file, truncated file (mmap longer than the file)
        raise CacheInvalid(f"unreadable cache arrays in {path} ({e})") from None
    expected = (meta["num_images"], meta["channels"], meta["height"], meta["width"])
    if images.dtype != np.uint8 or images.shape != expected:
        raise CacheInvalid(f"{path / IMAGES_FILE} is {images.dtype} {images.shape}, meta.json says uint8 {expected}")
    if labels.dtype != np.int64 or labels.shape != (expected[0],):
        raise CacheInvalid(f"{path / LABELS_FILE} is {labels.dtype} {labels.shape}, expected int64 ({expected[0]},)")
    return PreparedData(images=images, labels=labels, class_names=list(meta["class_names"]), meta=meta,
                        cache_path=path)


@contextlib.contextmanager
def build_lock(final_dir: Path, *, say: Callable[[str], None]) -> Iterator[None]:
    """One builder per cache directory across processes (e.g. every rank of a DDP job calling prepare).

    POSIX only (fcntl); elsewhere concurrent builders each finish and the last rename wins, which is
    wasteful but still never leaves a partial cache. Raises CacheNotWritable, before anything is held,
    when the cache folder cannot be written.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        fcntl = None
    lock_path = final_dir.parent / f".{final_dir.name}.lock"
    while True:
        try:
            final_dir.parent.mkdir(parents=True, exist_ok=True)
            lock_file = None if fcntl is None else open(lock_path, "a+b")
        except OSError as e:
            if e.errno in _NOT_WRITABLE_ERRNOS:
                raise _not_writable(final_dir.parent, e) from None
            raise
        if lock_file is None:
            yield
            return
        with lock_file:
            locked = True
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"waiting for another process that is preparing {final_dir.name} ...")
                fcntl.flock(lock_file, fcntl.LOCK_EX)
            except OSError as e:
                # Lustre mounted without -o flock answers ENOSYS, some NFS set-ups ENOLCK: build unlocked, as
                # where there is no fcntl (the rename still never shows a partial cache).
                if e.errno not in NO_LOCK_ERRNOS:
                    raise
                say(f"the file system of {final_dir.parent} has no file locks ({e.strerror or e}): preparing "
                    f"without one (another process preparing {final_dir.name} at the same time would redo the work)")
                locked = False
            if locked and not is_the_file_at(lock_file, lock_path):
                # the holder we waited for failed and removed the lock file: a lock on the removed file excludes
                # no one who opens the path now, so lock the file that is there
                fcntl.flock(lock_file, fcntl.LOCK_UN)
                continue
            try:
                yield
            except BaseException:
                # a refused or failed build leaves no cache, so no lock file either (while still holding it:
                # processes waiting on it see it gone and lock a new one)
                lock_path.unlink(missing_ok=True)
                raise
            finally:
                if locked:
                    fcntl.flock(lock_file, fcntl.LOCK_UN)
            return


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (the directory entry makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def npy_header(shape: tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header for uint8 C-order data, padded to exactly _NPY_HEADER_BYTES."""
    text = "{'descr': '|u1', 'fortran_order': False, 'shape': %r, }" % (tuple(int(d) for d in shape),)
    body_bytes = _NPY_HEADER_BYTES - 10  # magic (6) + version (2) + header length (2)
    if len(text) >= body_bytes:
        raise AssertionError(f"npy header for shape {shape} does not fit in {_NPY_HEADER_BYTES} bytes")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", body_bytes) + (text.ljust(body_bytes - 1) + "\n").encode()


class ImageRowWriter:
    """Streams uint8 (C, H, W) rows into images.npy; N in the header is fixed up when fewer arrive.

    Plain sequential writes rather than a memmap: a full disk then raises OSError(ENOSPC), which we
    can clean up after, instead of SIGBUS on a page fault into a sparse file.
    """

    def __init__(self, path: Path, shape_nchw: tuple[int, int, int, int]) -> None:
        self.path = path
        self.shape_nchw = tuple(int(d) for d in shape_nchw)
        self.rows_written = 0
        self._file = open(path, "wb")
        self._file.write(npy_header(self.shape_nchw))

    def write(self, rows_nchw: np.ndarray) -> None:
        assert rows_nchw.dtype == np.uint8 and rows_nchw.shape[1:] == self.shape_nchw[1:], rows_nchw.shape
        assert self.rows_written + len(rows_nchw) <= self.shape_nchw[0], "more rows than planned"
        self._file.write(memoryview(np.ascontiguousarray(rows_nchw)).cast("B"))
        self.rows_written += len(rows_nchw)

    def close(self) -> None:
        """Fix N if some rows were skipped during decoding, then flush and fsync."""
        if self.rows_written != self.shape_nchw[0]:
            self._file.seek(0)
            self._file.write(npy_header((self.rows_written, *self.shape_nchw[1:])))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed


def _write_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _remove_leftovers(final_dir: Path) -> None:
    """Temp/old directories of this cache left by a killed build. Only call while holding build_lock."""
    for pattern in (f".tmp-{final_dir.name}-*", f".old-{final_dir.name}-*"):
        for leftover in final_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _pixels_built_before(final_dir: Path, temp_dir: Path, meta: dict) -> str | None:
    """The `built` of the cache at `final_dir` when the new build in `temp_dir` holds the same images, labels and
    class names, byte for byte; else None."""
    try:
        old = json.loads((final_dir / META_FILE).read_text(encoding="utf-8"))
        if old.get("class_names") != meta.get("class_names"):
            return None
        files = (IMAGES_FILE, LABELS_FILE)
        if not all(filecmp.cmp(final_dir / name, temp_dir / name, shallow=False) for name in files):
            return None
    except (OSError, ValueError):  # no complete cache there before
        return None
    return built_of(old)


class CacheBuilder:
    """Builds one cache directory in a temp dir beside `final_dir`; `commit` swaps it in atomically.

    Use as a context manager: leaving it without commit (any exception, KeyboardInterrupt included)
    deletes the temp dir and leaves an existing cache at `final_dir` untouched.
    """

    def __init__(self, final_dir: Path) -> None:
        self.final_dir = final_dir
        self.temp_dir = final_dir.parent / f".tmp-{final_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
        self._writer: ImageRowWriter | None = None
        self._committed = False

    def __enter__(self) -> CacheBuilder:
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(self.final_dir)
        self.temp_dir.mkdir()
        return self

    def open_images(self, shape_nchw: tuple[int, int, int, int]) -> ImageRowWriter:
        assert self._writer is None, "open_images called twice"
        self._writer = ImageRowWriter(self.temp_dir / IMAGES_FILE, shape_nchw)
        return self._writer

    def commit(self, *, labels: np.ndarray, meta: dict) -> None:
        """Write labels and meta (last: its presence marks a complete cache), fsync, rename into place."""
        assert self._writer is not None and self._writer.closed, "images must be written and closed first"
        _write_npy(self.temp_dir / LABELS_FILE, labels.astype(np.int64, copy=False))
        meta = {**meta, "pixels_built": _pixels_built_before(self.final_dir, self.temp_dir, meta) or meta["created"]}
        _write_json(self.temp_dir / META_FILE, meta)
        _fsync_path(self.temp_dir)
        if self.final_dir.exists():
            # rename() cannot replace a non-empty directory, so move the old one aside first; the old
            # cache is only gone once the new one is complete and in place.
            old = self.final_dir.parent / f".old-{self.final_dir.name}-{secrets.token_hex(4)}"
            os.replace(self.final_dir, old)
            os.replace(self.temp_dir, self.final_dir)
            _fsync_path(self.final_dir.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.temp_dir, self.final_dir)
            _fsync_path(self.final_dir.parent)
        self._committed = True

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if self._writer is not None and not self._writer.closed:
            self._writer.abort()
        if not self._committed:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            # a full disk or quota, or a file larger than the file system or `ulimit -f` allows
            fix = ("raise the file size limit (`ulimit -f`), or pass --cache-dir / set FASTDDPM_CACHE to a file "
                   "system that takes larger files (FAT32 stops at 4 GiB)" if exc.errno == errno.EFBIG else
                   "free some space, or pass --cache-dir / set FASTDDPM_CACHE to a bigger disk")
            raise DataError(
                f"{(exc.strerror or 'no space left on the device').lower()} while writing the cache in "
                f"{self.final_dir.parent}; nothing was kept. Fix: {fix}."
            ) from exc
        return False
