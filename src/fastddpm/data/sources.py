"""What SOURCE is: a named dataset or a path, the kind of data behind it, and its cheap fingerprint.

Resolving reads only names, sizes and headers (never pixels), so `info` can use it for free and
`prepare` can decide whether an existing cache is still current before decoding anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from fastddpm.data import arrays, cifar, idx, imagefolder, named
from fastddpm.data.cache import cache_dir_name
from fastddpm.data.decode import ArrayData, ImageListing
from fastddpm.data.errors import DataError
from fastddpm.data.images import IMAGE_EXTENSIONS
from fastddpm.data.options import PrepareOptions

SOURCE_HELP = (
    "SOURCE is one of " + ", ".join(named.NAMED_DATASETS) + ", or a path to: an MNIST-style IDX folder or file, "
    "an image folder (ROOT/<label>/*.png), a .zip of one, cifar-10-batches-py/ or cifar-10-python.tar.gz, "
    "or a uint8 .npy/.npz"
)
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar")
IMAGE_FILE_KINDS = ("image-folder", "zip")  # the sources whose images are decoded from files (the others: arrays)


@dataclass(kw_only=True, frozen=True)
class Source:
    """A resolved SOURCE: enough to key the cache, fingerprint it, and read it later."""

    kind: str  # "idx" | "image-folder" | "zip" | "cifar10" | "npy" | "npz"
    display: str  # what the user passed, for messages and meta.json
    path: Path | None  # the resolved local path; None for a named dataset not downloaded yet
    name: str | None = None  # the named dataset, if SOURCE was one
    split: str | None = None  # canonical split when the source has splits, else None
    files: tuple[Path, ...] = ()  # the files that will be read (all kinds but image folders)
    tree: tuple[imagefolder.FileStat, ...] = ()  # image folders: every image file
    others: tuple[str, ...] = ()  # image folders: every other file, then the folders without images (x/), for notes
    backslash_paths: bool = False  # zips: member paths separated by backslashes (Windows tools), read as folders
    fingerprint: str | None = None  # changes when any file read changes; None when not local

    @property
    def label(self) -> str:
        """The kind, as messages name it: a tar is read only as CIFAR-10's python archive, but one named otherwise
        is more likely the user's own images, and calling it "cifar10" would blame the wrong thing."""
        if self.kind == "cifar10" and self.path is not None and self.path.is_file() and not self.name \
                and "cifar" not in self.path.name.lower():
            return "tar archive"
        return self.kind

    def cache_dir(self, cache_root: Path, options: PrepareOptions) -> Path:
        identity = {"name": self.name} if self.name else {"kind": self.kind, "path": str(self.path)}
        if self.name:
            slug = self.name
        else:
            slug = self.path.name
            for suffix in (".gz", ".zip", ".npz", ".npy", ".tgz", ".tar"):
                slug = slug.removesuffix(suffix)
        if self.split:
            slug += f"-{self.split}"
        if options.resize:
            slug += f"-{options.resize}px"
        name = cache_dir_name(slug=slug, identity=identity, split=self.split, transform=options.transform_key())
        return cache_root / "prepared" / name


def _fingerprint_files(files: tuple[Path, ...]) -> str:
    """(path, size, mtime_ns) of each file: catches replaced or re-downloaded files without reading them."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _fingerprint_tree(tree: tuple[imagefolder.FileStat, ...]) -> str:
    """A hash of the sorted (relative path, size, mtime_ns) listing: any added, removed or edited image."""
    h = hashlib.sha256()
    for s in tree:
        h.update(f"{s.rel}\0{s.size}\0{s.mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _file_source(kind: str, display: str, path: Path, files: tuple[Path, ...], *, split: str | None,
                 name: str | None = None) -> Source:
    return Source(kind=kind, display=display, path=path, name=name, split=split, files=files,
                  fingerprint=_fingerprint_files(files))


def _npz_has_splits(path: Path) -> bool:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return any(k.startswith("x_") for k in npz.files)
    except Exception as e:  # a broken file: let the reader report it with the full story
        raise DataError(f"{path}: unreadable .npz ({type(e).__name__}: {e})") from None


def _resolve_folder(path: Path, display: str, split: str, name: str | None) -> Source:
    if idx.folder_has_idx(path):
        found = idx.find_split_files(path, split)
        if found is None:
            prefix = "train" if split == "train" else "t10k"
            raise DataError(f"{path} holds IDX files but no {prefix}-images-idx3-ubyte[.gz] for split {split!r}. "
                            "Fix: pass the other --split, or add the missing file.")
        files = tuple(p for p in found if p is not None)
        return _file_source("idx", display, path, files, split=split, name=name)
    if (path / named.CIFAR10_ARCHIVE).is_file() and cifar.find_batch_folder(path) is None:
        return _resolve_file(path / named.CIFAR10_ARCHIVE, display, split, name)
    batches = cifar.find_batch_folder(path)
    if batches is not None:
        return _file_source("cifar10", display, batches, tuple(cifar.folder_files(batches, split)), split=split,
                            name=name)
    tree, others = imagefolder.walk_folder(path)
    if not tree:
        raise imagefolder.no_images_error(str(path), others)
    layout = imagefolder.plan_layout([s.rel for s in tree], split=split, where=str(path), strip_top=False)
    return Source(kind="image-folder", display=display, path=path, name=name, split=layout.split,
                  tree=tuple(tree), others=tuple(others), fingerprint=_fingerprint_tree(tuple(tree)))


def _resolve_file(path: Path, display: str, split: str, name: str | None) -> Source:
    lower = path.name.lower()
    if lower.endswith(".zip"):
        with imagefolder.open_zip(path) as zf:  # checks member names for traversal first
            members, others = imagefolder.zip_image_members(zf)
            if not members:
                raise imagefolder.no_images_error(str(path), others)
            layout = imagefolder.plan_layout([imagefolder.member_path(m) for m in members], split=split,
                                             where=str(path), strip_top=True)
        return dataclasses.replace(_file_source("zip", display, path, (path,), split=layout.split, name=name),
                                   backslash_paths=any("\\" in m.filename for m in members))
    if lower.endswith(".npy"):
        return _file_source("npy", display, path, (path,), split=None, name=name)
    if lower.endswith(".npz"):
        return _file_source("npz", display, path, (path,), split=split if _npz_has_splits(path) else None,
                            name=name)
    if lower.endswith(_TAR_SUFFIXES):
        cifar.check_split(split, str(path))
        return _file_source("cifar10", display, path, (path,), split=split, name=name)
    if idx.is_idx_name(lower):
        if "-labels" in lower or ".labels" in lower or "idx1" in lower:
            raise DataError(f"{path} is an IDX labels file; pass the images file (…-images-idx3-ubyte) "
                            "or the folder holding both.")
        labels = idx.labels_path_for(path)
        return _file_source("idx", display, path, (path, labels) if labels else (path,), split=None, name=name)
    if lower.endswith(IMAGE_EXTENSIONS):
        raise DataError(f"{path} is a single image; pass the folder that holds the images. {SOURCE_HELP}.")
    raise DataError(f"don't know how to read {path}. {SOURCE_HELP}.")


def resolve_source(source: str | os.PathLike, *, split: str, cache_root: Path, download: bool,
                   progress: bool = True) -> Source:
    """Work out what SOURCE is. Named datasets are downloaded only when `download` is True."""
    display = os.fspath(source)
    name = named.canonical_name(display) if isinstance(source, str) and not any(
        sep in display for sep in ("/", "\\")) else None
    if name is not None:
        ds = named.DATASETS[name]
        local = named.find_local(ds, split, cache_root)
        if local is None and download:
            local = named.download(ds, split, cache_root, progress=progress)
        if local is None:
            ds.files_for(split)
            return Source(kind=ds.kind, display=name, path=None, name=name, split=split)
        return _resolve_folder(local, name, split, name) if local.is_dir() else _resolve_file(local, name, split, name)

    path = Path(display).expanduser()
    if not path.exists():
        raise DataError(f"{display}: no such file or folder. {SOURCE_HELP}.")
    path = path.resolve()
    src = _resolve_folder(path, display, split, None) if path.is_dir() else _resolve_file(path, display, split, None)
    if src.split is None and split != "train":
        raise DataError(f"split={split!r}, but {display} ({src.label}) has no splits. Fix: leave --split out, or "
                        "point SOURCE at the file or folder that holds that split.")
    return src


def refuse_output_among_images(source: str | os.PathLike, out: str | os.PathLike, *, flag: str, what: str,
                               given: bool = True) -> None:
    """A DataError where `out` is, or is under, the image folder `source` names: `what` is written there (a run's
    sample grids, an export's PNGs), and the next prepare of the folder reads every image file under it, split
    folders or not: a class of their own (trained on without a word under --resize), or bad files of another size
    that stop the run's resume. A named dataset, a file (zip, .npz, IDX, tar) or an IDX or CIFAR-10 folder reads
    only the files it names. `given`: False where `out` is `flag`'s default, which the message then says."""
    display = os.fspath(source)
    if isinstance(source, str) and not any(sep in display for sep in ("/", "\\")) and named.canonical_name(display):
        return
    folder = Path(display).expanduser()
    if not folder.is_dir() or idx.folder_has_idx(folder) or (folder / named.CIFAR10_ARCHIVE).is_file() \
            or cifar.find_batch_folder(folder) is not None:
        return
    folder, target = folder.resolve(), Path(out).expanduser().resolve()
    if target == folder or folder in target.parents:
        where = "is" if target == folder else "is inside"
        said = f"{flag} {out}" if given else f"{flag} was not given, and its default, {out},"
        raise DataError(f"{said} {where} the image folder the data is read from ({folder}): {what} would be "
                        "read as images of the dataset the next time it is prepared (a class of their own, or bad "
                        f"files of another size). Fix: give {flag} a folder outside {folder}.")


@contextlib.contextmanager
def read_source(src: Source, options: PrepareOptions) -> Iterator[ArrayData | ImageListing]:
    """Open the resolved source for decoding (zips stay open for the duration)."""
    assert src.path is not None, "resolve with download=True before reading"
    if src.kind == "idx":
        data = idx.read_idx_pair(src.files[0], src.files[1] if len(src.files) > 1 else None)
        ds = named.DATASETS.get(src.name or "")
        if ds is not None and ds.class_names is not None and data.class_names:
            data.class_names = list(ds.class_names)
        yield data
    elif src.kind == "cifar10":
        yield cifar.read_tar(src.path, src.split) if src.path.is_file() else cifar.read_folder(src.path, src.split)
    elif src.kind == "npy":
        yield arrays.read_npy(src.path)
    elif src.kind == "npz":
        yield arrays.read_npz(src.path, src.split or "train")
    elif src.kind == "image-folder":
        yield imagefolder.list_folder(src.path, list(src.tree), split=options.split, others=list(src.others))
    elif src.kind == "zip":
        with imagefolder.list_zip(src.path, split=options.split, max_image_pixels=options.max_image_pixels) as listing:
            yield listing
    else:
        raise AssertionError(f"unknown source kind {src.kind}")
