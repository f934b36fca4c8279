"""IDX files (MNIST, Fashion-MNIST): a big-endian header, then raw uint8 pixels or labels.

Format (http://yann.lecun.com/exdb/mnist/): 4-byte magic 0x000008TD where T=0x08 is unsigned byte
and D the number of dimensions, then D uint32 sizes, then the data. We check the magic, the
dimensions and that the byte count matches the header exactly, because a truncated download is the
common failure and would otherwise show up as garbage images or a reshape error much later.
"""

from __future__ import annotations

import gzip
import re
import struct
import zlib
from pathlib import Path

import numpy as np

from fastddpm.data.errors import DataError
from fastddpm.data.decode import ArrayData

IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dims (N, rows, cols)
LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dim (N,)
_KNOWN_MAGICS = {IMAGES_MAGIC: "IDX images (uint8, 3 dims)", LABELS_MAGIC: "IDX labels (uint8, 1 dim)"}

# train-images-idx3-ubyte(.gz) as distributed, and train-images.idx3-ubyte as some re-uploads spell it.
_IMAGES_NAME = re.compile(r"^(?P<prefix>.*)-images[-.]idx3-ubyte(\.gz)?$")
_SPLIT_PREFIX = {"train": "train", "test": "t10k"}


def is_idx_name(name: str) -> bool:
    return bool(re.search(r"[-.]idx[13]-ubyte(\.gz)?$", name))


def find_split_files(folder: Path, split: str) -> tuple[Path, Path | None] | None:
    """(images, labels or None) for a split in an MNIST-layout folder, or None if it holds no IDX files.

    Raw files are preferred over .gz when both exist: same bytes, no decompression.
    """
    if split not in _SPLIT_PREFIX:
        raise DataError(f"split={split!r}: IDX datasets in {folder} have only train and test (t10k) splits")
    prefix = _SPLIT_PREFIX[split]
    images = _first_existing(folder, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"])
    if images is None:
        return None
    labels = _first_existing(folder, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"])
    return images, labels


def folder_has_idx(folder: Path) -> bool:
    return any(is_idx_name(p.name) for p in folder.iterdir() if p.is_file())


def labels_path_for(images: Path) -> Path | None:
    """The labels file that sits next to a single IDX images file, if any."""
    match = _IMAGES_NAME.match(images.name)
    if match is None:
        return None
    prefix = match.group("prefix")
    return _first_existing(images.parent, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"])


def _first_existing(folder: Path, stems: list[str]) -> Path | None:
    for stem in stems:
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def _read_maybe_gzip(path: Path) -> bytes:
    """The decompressed bytes, detecting gzip by its magic bytes, not the name: browsers sometimes
    save an already-decompressed file under its .gz name."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except EOFError:
        raise DataError(
            f"{path}: the gzip stream ends early (truncated download?). Fix: delete it and download it again."
        ) from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data ({e}). Fix: delete it and download it again.") from None


def read_idx(path: Path, *, magic: int) -> np.ndarray:
    """One IDX file as a uint8 array of its header's shape, after checking magic and length."""
    data = _read_maybe_gzip(path)
    what = _KNOWN_MAGICS[magic]
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes is too short for an IDX file (expected {what}); truncated?")
    (found,) = struct.unpack(">I", data[:4])
    if found != magic:
        looks_like = _KNOWN_MAGICS.get(found) or ("HTML" if data[:1] == b"<" else "not IDX")
        raise DataError(
            f"{path}: expected {what} with magic 0x{magic:08X}, found 0x{found:08X} ({looks_like}). "
            "Fix: check that this is the right file (images vs labels) and that it downloaded completely."
        )
    ndim = magic & 0xFF
    header_bytes = 4 + 4 * ndim
    if len(data) < header_bytes:
        raise DataError(f"{path}: the IDX header needs {header_bytes} bytes but the file has {len(data)}; truncated?")
    shape = struct.unpack(f">{ndim}I", data[4:header_bytes])
    expected_bytes = header_bytes + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected_bytes:
        problem = "truncated" if len(data) < expected_bytes else "has trailing bytes"
        raise DataError(
            f"{path}: header says shape {tuple(shape)} = {expected_bytes:,} bytes, but the (decompressed) file has "
            f"{len(data):,} bytes ({problem}). Fix: delete it and download it again."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_bytes).reshape(shape)


def read_idx_pair(images_path: Path, labels_path: Path | None) -> ArrayData:
    """Images (N, 1, H, W) and labels (N,) from an IDX pair; labels -1 when there is no labels file."""
    images_nhw = read_idx(images_path, magic=IMAGES_MAGIC)
    notes: list[str] = []
    if labels_path is None:
        labels = np.full(len(images_nhw), -1, dtype=np.int64)
        class_names: list[str] = []
        notes.append(f"no labels file next to {images_path.name}: images are unlabeled (labels -1)")
    else:
        labels_u8 = read_idx(labels_path, magic=LABELS_MAGIC)
        if len(labels_u8) != len(images_nhw):
            raise DataError(
                f"{images_path} holds {len(images_nhw):,} images but {labels_path} holds {len(labels_u8):,} labels. "
                "Fix: use an images file and the labels file of the same split."
            )
        labels = labels_u8.astype(np.int64)
        class_names = [str(i) for i in range(int(labels.max()) + 1)] if len(labels) else []
    return ArrayData(images_nchw=images_nhw[:, None], labels=labels, class_names=class_names, notes=notes)
