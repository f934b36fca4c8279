"""Image folders and zips of them: root/<label>/*.png (labels from folder names) or images directly
in root (one unlabeled set). Zips are read member by member, never extracted: one archive, not
60,000 small files on a slow (network) disk.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fastddpm.data.decode import ImageEntry, ImageListing
from fastddpm.data.errors import BadFile, DataError
from fastddpm.data.images import IMAGE_EXTENSIONS, BadImage
from fastddpm.data.options import SPLIT_ALIASES

EXPECTED_LAYOUT = (
    "expected ROOT/<label>/*.png (also .jpg, .jpeg, .bmp, .webp), e.g. mnist/0/00001.png, "
    "or image files directly in ROOT for an unlabeled set"
)


@dataclass(kw_only=True, frozen=True)
class FileStat:
    """An image file of a folder: the listing that both the fingerprint and the reader use."""

    rel: str  # POSIX path relative to the root
    size: int  # bytes; -1 if it could not be stat'ed (e.g. a broken symlink)
    mtime_ns: int


def skip_name(name: str) -> bool:
    """Dot-files (.DS_Store, ._x.png AppleDouble) and macOS zip metadata are never data."""
    return name.startswith(".") or name == "__MACOSX"


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def walk_folder(root: Path) -> tuple[list[FileStat], list[str]]:
    """Every image file under `root` in sorted order, and the relative paths of the other files, followed by the
    folders of the first two levels (class folders, and class folders inside split folders) that hold no image
    file, as `name/` (an empty class folder is no class: see `image_less_folders_note`).

    Symlinked files and directories are followed (class folders are often links to another disk), except
    a directory link back to one of its own ancestors, which would loop forever. A directory that cannot
    be listed is a DataError: skipping it would silently drop a class.
    """
    images: list[FileStat] = []
    others: list[str] = []

    def unreadable(e: OSError) -> None:
        where = Path(e.filename).relative_to(root).as_posix() if e.filename else "?"
        raise DataError(f"{root}: cannot list the folder {where} ({e.strerror or e}). Fix: make it readable, "
                        "or move it out of the dataset folder.")

    # The real directories on the path from the root to each directory walked: a link to one of them is a loop.
    ancestors: dict[str, frozenset[tuple[int, int]]] = {}
    shallow_dirs: list[str] = []  # relative paths of the folders one and two levels down
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
        st = os.stat(dirpath)
        parent = ancestors.get(os.path.dirname(dirpath), frozenset()) if dirpath != str(root) else frozenset()
        chain = ancestors[dirpath] = parent | {(st.st_dev, st.st_ino)}
        kept = []
        for d in sorted(dirnames):
            if skip_name(d):
                continue
            try:
                dst = os.stat(os.path.join(dirpath, d))
            except OSError:
                continue  # a broken link: not a folder of images
            if (dst.st_dev, dst.st_ino) not in chain:
                kept.append(d)
        dirnames[:] = kept
        # Plain strings, not Path objects: this loop runs once per file (60,000 for MNIST).
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        if rel_dir != "." and rel_dir.count("/") < 2:
            shallow_dirs.append(rel_dir)
        for name in sorted(filenames):
            if skip_name(name):
                continue
            rel = prefix + name
            if not is_image_name(name):
                others.append(rel)
                continue
            try:
                st = os.stat(os.path.join(dirpath, name))
                images.append(FileStat(rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns))
            except OSError:
                images.append(FileStat(rel=rel, size=-1, mtime_ns=0))  # reported as unreadable later
    images.sort(key=lambda s: s.rel)
    holding = {"/".join(parts[:k]) for parts in (s.rel.split("/") for s in images) for k in (1, 2)}
    return images, others + [f"{d}/" for d in sorted(shallow_dirs) if d not in holding]


def image_less_folders_note(others: list[str], layout: Layout) -> list[str]:
    """A note naming the folders `walk_folder` found without images where class folders sit (in the split folder
    read, under split folders) whose names are no class: a class folder left empty (an interrupted copy) changes
    the class count and the ids after it, and torchvision's ImageFolder refuses one. A folder of images in a
    format not read is left to `unread_images_note`, which says what to do with them."""
    where = "" if layout.split_dir is None else f"{layout.split_dir}/"
    classes = set(layout.class_names)
    unread = _unread_images(others)
    empty = [o for o in others if o.endswith("/") and o.startswith(where) and o.count("/") == where.count("/") + 1
             and o.split("/")[-2] not in classes and not any(u.startswith(o) for u in unread)]
    if not empty:
        return []
    return [f"{len(empty)} folder(s) hold no image read, so they are not classes: {', '.join(empty[:10])}"
            f"{', ...' if len(empty) > 10 else ''} (if one should be a class, add its images)"]


@dataclass(kw_only=True)
class Layout:
    """How relative image paths map to (split, class, label)."""

    split: str | None  # the split read; None when the source has no split folders
    split_dir: str | None  # the split folder read (e.g. testing/ for split test)
    class_names: list[str]
    labeled: bool
    items: list[tuple[str, int]]  # (original relative path, label) in training order
    stray: list[str]  # images beside class folders: reported as bad files
    notes: list[str]


def class_order(names: set[str]) -> list[str]:
    """Numeric order when every class folder is an integer (so '10' follows '9'), else sorted names."""
    if all(re.fullmatch(r"\d+", n, re.ASCII) for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def plan_layout(rel_paths: list[str], *, split: str, where: str, strip_top: bool) -> Layout:
    """Classes from folder names, with two tolerances for how datasets get packed:

    - strip_top (zips): one common top folder is ignored (`mnist_train/0/1.png` reads as `0/1.png`, and
      `faces/1.png`, a zipped folder of unlabeled images, as `1.png`, unlabeled as the folder itself reads; a
      lone split folder, `train/1.png`, is kept as the split it is);
    - split folders: if every top folder is a split name (train/, test/, training/, testing/, val/),
      the one matching `split` is read, e.g. the Kaggle `mnist_png/{training,testing}/<digit>/` layout.
    """
    parts = {p: p.split("/") for p in rel_paths}
    notes: list[str] = []
    firsts = {ps[0] for ps in parts.values()}
    if strip_top and len(firsts) == 1 and all(len(ps) >= 2 for ps in parts.values()) and (
            any(len(ps) >= 3 for ps in parts.values()) or next(iter(firsts)).lower() not in SPLIT_ALIASES):
        top = firsts.pop()
        parts = {p: ps[1:] for p, ps in parts.items()}
        notes.append(f"ignored the common top-level folder {top}/")

    chosen_split = chosen_dir = None
    split_classes: set[str] = set()  # class folders of every split: one class list, the same ids in each split
    top_dirs = {ps[0] for ps in parts.values() if len(ps) >= 2}
    if top_dirs and all(d.lower() in SPLIT_ALIASES for d in top_dirs):
        wanted = sorted(d for d in top_dirs if SPLIT_ALIASES[d.lower()] == split)
        if len(wanted) != 1:
            problem = (f"several folders for split {split!r}: {wanted}" if wanted
                       else f"no folder for split {split!r}")
            available = sorted({SPLIT_ALIASES[d.lower()] for d in top_dirs})
            raise DataError(f"{where} has split folders {sorted(top_dirs)} but {problem}. "
                            f"Fix: pass --split {' or --split '.join(available)}.")
        chosen_split, chosen_dir = split, wanted[0]
        split_classes = {ps[1] for ps in parts.values() if len(ps) >= 3}
        ignored = sum(1 for ps in parts.values() if len(ps) < 2 or ps[0] != wanted[0])
        parts = {p: ps[1:] for p, ps in parts.items() if len(ps) >= 2 and ps[0] == wanted[0]}
        notes.append(f"read the {wanted[0]}/ folder for split {split}"
                     + (f" ({ignored:,} images elsewhere ignored)" if ignored else ""))

    class_dirs = {ps[0] for ps in parts.values() if len(ps) >= 2}
    if not class_dirs:
        items = [(p, -1) for p in sorted(parts)]
        notes.append(f"no class folders: the {len(items):,} images are one unlabeled set (labels -1)")
        return Layout(split=chosen_split, split_dir=chosen_dir, class_names=[], labeled=False, items=items, stray=[],
                      notes=notes)
    # A class that only the other splits have images of still takes its place: label k is the same class in
    # train/ and test/ (a model trained on one is evaluated on the other).
    missing = sorted(split_classes - class_dirs)
    if missing:
        notes.append(f"{len(missing)} class(es) have images only in the other splits: "
                     f"{', '.join(missing[:10])}{', ...' if len(missing) > 10 else ''} (0 images here)")
    notes += _nested_classes_note(parts)
    class_names = class_order(class_dirs | split_classes)
    label_of = {name: i for i, name in enumerate(class_names)}
    items = sorted(((p, label_of[ps[0]]) for p, ps in parts.items() if len(ps) >= 2), key=lambda t: (t[1], t[0]))
    stray = sorted(p for p, ps in parts.items() if len(ps) == 1)
    return Layout(split=chosen_split, split_dir=chosen_dir, class_names=class_names, labeled=True, items=items,
                  stray=stray, notes=notes)


def _nested_classes_note(parts: dict[str, list[str]]) -> list[str]:
    """A note naming the class folders whose images all sit in two or more subfolders (`animals/cat/`,
    `animals/dog/`): each is read as one class, as torchvision's ImageFolder reads it, where the subfolders may have
    been meant as the classes."""
    subfolders: dict[str, set[str | None]] = {}
    for ps in parts.values():
        if len(ps) >= 2:
            subfolders.setdefault(ps[0], set()).add(ps[1] if len(ps) >= 3 else None)
    nested = sorted(c for c, subs in subfolders.items() if None not in subs and len(subs) >= 2)
    if not nested:
        return []
    shown = "; ".join(f"{c}/ ({', '.join(sorted(subfolders[c])[:3])}{', ...' if len(subfolders[c]) > 3 else ''})"
                      for c in nested[:3]) + ("; ..." if len(nested) > 3 else "")
    return [f"{len(nested)} class folder(s) hold their images only in subfolders, each read as one class: {shown}; "
            f"to train on the subfolders as the classes, give the class folder itself as the source (e.g. "
            f"{nested[0]}/ under the folder given)"]


def _stray_bad(stray: list[str]) -> list[BadFile]:
    return [BadFile(path=p, reason="image beside the class folders, so it has no label: move it into a class "
                                   "folder or delete it", kind="layout") for p in stray]


def no_images_error(where: str, others: list[str]) -> DataError:
    files = [o for o in others if not o.endswith("/")]
    folders = [o for o in others if o.endswith("/")]  # walk_folder's folders without images
    seen = ", ".join(([f"{len(files):,} other files, e.g. {', '.join(files[:3])}"] if files else [])
                     + ([f"{len(folders):,} folders without images, e.g. {', '.join(folders[:3])}"]
                        if folders else []))
    seen = f" (found {seen})" if seen else ""
    return DataError(f"no images found in {where}{seen}: {EXPECTED_LAYOUT}.")


def _unread_images(others: list[str]) -> list[str]:
    """The files among `others` whose format Pillow opens (.gif, .tif ...), sorted."""
    from PIL import Image

    Image.init()
    opened = {ext for ext, fmt in Image.EXTENSION.items() if fmt in Image.OPEN}
    return sorted(o for o in others if os.path.splitext(o)[1].lower() in opened)


def unread_images_note(others: list[str]) -> list[str]:
    """A note naming the files of an image format Pillow opens but the reader skips (.gif, .tif ...): without it
    they were left out of the dataset without a word."""
    unread = _unread_images(others)
    if not unread:
        return []
    kinds = sorted({os.path.splitext(o)[1].lower() for o in unread})
    return [f"left out {len(unread):,} image file(s) of a format not read ({', '.join(kinds)}), e.g. "
            f"{', '.join(unread[:3])}: convert them to {'/'.join(IMAGE_EXTENSIONS)} to train on them"]


def list_folder(root: Path, stats: list[FileStat], *, split: str, others: list[str] = ()) -> ImageListing:
    """The image files of `root` (from `walk_folder`), ordered by class then path; `others` are the other files."""
    layout = plan_layout([s.rel for s in stats], split=split, where=str(root), strip_top=False)
    size_of = {s.rel: s.size for s in stats}
    root_str = str(root)
    entries = [ImageEntry(path=rel, label=label, size_bytes=size_of[rel],
                          open=functools.partial(open, os.path.join(root_str, rel), "rb"))
               for rel, label in layout.items]
    return ImageListing(where=str(root), entries=entries, class_names=layout.class_names, labeled=layout.labeled,
                        layout_bad=_stray_bad(layout.stray),
                        notes=layout.notes + unread_images_note(list(others)) + image_less_folders_note(list(others),
                                                                                                      layout))


# ---------------------------------------------------------------------------------------------- zips

def unsafe_member_names(names: list[str]) -> list[str]:
    """Absolute paths and '..' components: harmless to us (we never extract) but a sign of a malicious
    archive, and a trap for anyone who unzips it later. Backslashes count as separators (Windows zips)."""
    bad = []
    for name in names:
        pieces = re.split(r"[/\\]", name)
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in pieces:
            bad.append(name)
    return bad


def open_zip(path: Path) -> zipfile.ZipFile:
    """Open and check member names before reading any member's data."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"{path}: not a readable zip archive ({e}). Fix: re-download or re-create it.") from None
    unsafe = unsafe_member_names(zf.namelist())
    if unsafe:
        zf.close()
        listed = "\n".join(f"  {n}" for n in unsafe)
        raise DataError(
            f"{path}: refusing to read a zip with absolute or '..' member paths (a path-traversal archive):\n"
            f"{listed}\nFix: re-create the zip from inside the dataset folder, e.g. `cd ROOT && zip -r ../data.zip .`."
        )
    return zf


def member_path(info: zipfile.ZipInfo) -> str:
    """A member's path with '/' separators. Zips written on Windows by PowerShell 5's Compress-Archive (and .NET
    before 4.6.1) separate with backslashes, against the zip spec; read as they are, `cat\\1.png` is a file at the
    top, and a whole labeled dataset came out as one unlabeled set. A name without the zip's UTF-8 flag is read as
    code page 437 (the spec's default), but Info-ZIP's `zip` on Linux writes its UTF-8 bytes without the flag: a
    name whose bytes are valid UTF-8 is read as UTF-8 (`ç/`, not `├º/`, the class the unzipped folder has)."""
    name = info.filename
    if not info.flag_bits & 0x800:
        try:
            name = name.encode("cp437").decode("utf-8")
        except UnicodeError:  # not UTF-8: a name in code page 437 after all
            pass
    return name.replace("\\", "/")


def zip_image_members(zf: zipfile.ZipFile) -> tuple[list[zipfile.ZipInfo], list[str]]:
    """Image members (sorted by path) and other member paths, skipping folders, dot-files and __MACOSX/."""
    images, others = [], []
    for info in zf.infolist():
        path = member_path(info)
        if info.is_dir() or path.endswith("/") or any(skip_name(part) for part in path.split("/")):
            continue
        (images if is_image_name(path) else others).append(info)
    images.sort(key=member_path)
    return images, [member_path(o) for o in others]


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, lock: threading.Lock, max_bytes: int) -> io.BytesIO:
    if info.file_size > max_bytes:
        # The declared size bounds what zipfile will inflate, so checking it stops a zip bomb early.
        raise BadImage(f"zip member claims {info.file_size:,} bytes uncompressed, over the {max_bytes:,}-byte "
                       "limit for one image; refused as a possible zip bomb", "bomb")
    with lock:  # ZipFile bookkeeping is not documented as thread-safe; decoding happens outside the lock
        return io.BytesIO(zf.read(info))


@contextlib.contextmanager
def list_zip(path: Path, *, split: str, max_image_pixels: int) -> Iterator[ImageListing]:
    """The image members of a zip as an ImageListing; the archive stays open while the listing is used."""
    zf = open_zip(path)
    with zf:
        members, others = zip_image_members(zf)
        if not members:
            raise no_images_error(str(path), others)
        by_name = {member_path(m): m for m in members}
        layout = plan_layout(list(by_name), split=split, where=str(path), strip_top=True)
        lock = threading.Lock()
        # An image file can hardly be larger than 4 bytes/pixel (RGBA BMP) plus metadata.
        max_bytes = 4 * max_image_pixels + 2**20
        entries = [ImageEntry(path=name, label=label, size_bytes=by_name[name].file_size,
                              open=functools.partial(_read_member, zf, by_name[name], lock, max_bytes))
                   for name, label in layout.items]
        yield ImageListing(where=str(path), entries=entries, class_names=layout.class_names,
                           labeled=layout.labeled, layout_bad=_stray_bad(layout.stray),
                           notes=layout.notes + unread_images_note(others))
