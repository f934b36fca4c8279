"""CIFAR-10 "python version": pickled dicts of numpy arrays, as a folder or the downloaded tar.gz.

The batches are pickles, and unpickling runs whatever callables the file names. So we unpickle with
an allow-list holding exactly what the real files reference (numpy's array reconstruction), and
refuse everything else before it is called: a poisoned `data_batch_1` cannot run code.
"""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fastddpm.data.decode import ArrayData
from fastddpm.data.errors import DataError

BATCH_DIR = "cifar-10-batches-py"
SPLIT_BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
META_FILE = "batches.meta"
_IMAGE_BYTES = 3 * 32 * 32  # one row of `data`: 1024 red, 1024 green, 1024 blue values, row-major
_MAX_MEMBER_BYTES = 256 * 2**20  # a real batch is ~31 MB; refuse to inflate anything far bigger


def _numpy_reconstruct() -> Callable[..., Any]:
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return _reconstruct


def _numpy_frombuffer() -> Callable[..., Any]:
    try:
        from numpy._core.numeric import _frombuffer  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.numeric import _frombuffer  # type: ignore[no-redef]
    return _frombuffer


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """What Python 3 writes for a bytes object at pickle protocol 2 (which has no bytes opcode):
    _codecs.encode(str, 'latin1'). Only that encoding is accepted: nothing else is a byte string."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not a byte string")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    """Python 3 writes an empty bytes object at protocol 2 as bytes(); bytes(N) would allocate N bytes."""
    if args:
        raise pickle.UnpicklingError("bytes() with arguments is not an empty byte string")
    return b""


# (module, name) -> the object it may resolve to. The real batches (pickled by Python 2 numpy) name
# numpy.core.multiarray._reconstruct, numpy.ndarray and numpy.dtype; files re-pickled under numpy 2
# name numpy._core.multiarray._reconstruct; at protocol 5 (Python 3.14's default) numpy pickles
# contiguous arrays as numeric._frombuffer of an in-band buffer; Python 3 at protocol 2 writes byte
# strings as _codecs.encode(str, 'latin1') (and b'' as bytes()). Lists, dicts, ints and strings need
# no globals at all.
_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _numpy_frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _numpy_frombuffer,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: _latin1_bytes,
    ("__builtin__", "bytes"): lambda: _empty_bytes,
    ("builtins", "bytes"): lambda: _empty_bytes,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only the allow-listed numpy globals; anything else is refused."""

    def __init__(self, file: io.BufferedIOBase, *, source: str) -> None:
        # latin1: the real files were written by Python 2, whose byte strings (including the raw
        # array data) must come back byte-for-byte; numpy accepts latin1 str for array state.
        super().__init__(file, encoding="latin1")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        resolve = _ALLOWED.get((module, name))
        if resolve is None:
            raise DataError(
                f"refusing to unpickle {module}.{name} from {self.source}: CIFAR batches contain only numpy "
                "arrays; this file may be malicious. Fix: delete it and download the official "
                "cifar-10-python.tar.gz again."
            )
        return resolve()

    def persistent_load(self, pid: Any) -> Any:
        raise DataError(f"refusing persistent id {pid!r} in {self.source}: CIFAR batches contain only numpy "
                        "arrays; this file may be malicious")


def load_batch_pickle(data: bytes, *, source: str) -> dict[str, Any]:
    """Unpickle one batch/meta file safely; keys come back as str whichever Python wrote the file."""
    try:
        obj = RestrictedUnpickler(io.BytesIO(data), source=source).load()
    except DataError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, ValueError... from a truncated or foreign file
        raise DataError(f"{source}: not a readable CIFAR-10 pickle ({type(e).__name__}: {e}). "
                        "Fix: download cifar-10-python.tar.gz again.") from None
    if not isinstance(obj, dict):
        raise DataError(f"{source}: expected a pickled dict, found {type(obj).__name__}; not a CIFAR-10 batch")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _batch_arrays(batch: dict[str, Any], *, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)) from one batch dict, after shape checks."""
    data, labels = batch.get("data"), batch.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _IMAGE_BYTES:
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{source}: 'data' should be uint8 (N, {_IMAGE_BYTES}), found {found}; not a CIFAR-10 batch")
    labels_n = np.asarray(labels if labels is not None else [], dtype=np.int64)
    if labels_n.shape != (len(data),):
        raise DataError(f"{source}: {len(data):,} images but labels of shape {labels_n.shape}; the file is damaged")
    # Rows are channel-major (R plane, G plane, B plane), so this reshape is already (C, H, W).
    return data.reshape(-1, 3, 32, 32), labels_n


def _class_names(meta: dict[str, Any] | None, *, source: str, num_labels: int) -> tuple[list[str], list[str]]:
    if meta is None:
        return [str(i) for i in range(num_labels)], [f"no {META_FILE} in {source}: classes named by number"]
    names = meta.get("label_names")
    if not isinstance(names, list):
        raise DataError(f"{source}/{META_FILE}: no 'label_names' list; not a CIFAR-10 meta file")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names], []


def _assemble(batches: dict[str, bytes], meta: bytes | None, *, split: str, source: str) -> ArrayData:
    images, labels = [], []
    for name in SPLIT_BATCHES[split]:
        arr, lab = _batch_arrays(load_batch_pickle(batches[name], source=f"{source}/{name}"),
                                 source=f"{source}/{name}")
        images.append(arr)
        labels.append(lab)
    labels_n = np.concatenate(labels)
    meta_dict = load_batch_pickle(meta, source=f"{source}/{META_FILE}") if meta is not None else None
    class_names, notes = _class_names(meta_dict, source=source, num_labels=int(labels_n.max()) + 1)
    if labels_n.min() < 0 or labels_n.max() >= len(class_names):
        raise DataError(f"{source}: labels range {labels_n.min()}..{labels_n.max()} but there are "
                        f"{len(class_names)} class names; the files do not belong together")
    return ArrayData(images_nchw=np.concatenate(images), labels=labels_n, class_names=class_names, notes=notes)


def check_split(split: str, source: str) -> None:
    if split not in SPLIT_BATCHES:
        raise DataError(f"split={split!r}: CIFAR-10 ({source}) has only train and test splits")


def find_batch_folder(folder: Path) -> Path | None:
    """The folder holding the batch files: `folder` itself or its cifar-10-batches-py/ subfolder."""
    for candidate in (folder, folder / BATCH_DIR):
        if (candidate / "data_batch_1").is_file() or (candidate / "test_batch").is_file():
            return candidate
    return None


def folder_files(folder: Path, split: str) -> list[Path]:
    """The batch files a split needs (plus batches.meta when present), or a DataError naming the missing ones."""
    check_split(split, str(folder))
    needed = [folder / n for n in SPLIT_BATCHES[split]]
    missing = [p.name for p in needed if not p.is_file()]
    if missing:
        raise DataError(f"{folder}: missing {', '.join(missing)} for the {split} split of CIFAR-10. "
                        "Fix: extract the complete cifar-10-python.tar.gz, or pass the .tar.gz itself.")
    meta = folder / META_FILE
    return needed + ([meta] if meta.is_file() else [])


def read_folder(folder: Path, split: str) -> ArrayData:
    files = folder_files(folder, split)
    batches = {p.name: p.read_bytes() for p in files if p.name != META_FILE}
    meta = (folder / META_FILE).read_bytes() if (folder / META_FILE).is_file() else None
    return _assemble(batches, meta, split=split, source=str(folder))


def read_tar(path: Path, split: str) -> ArrayData:
    """Read the batches straight out of cifar-10-python.tar.gz, in one sequential pass, no extraction."""
    check_split(split, str(path))
    wanted = set(SPLIT_BATCHES[split]) | {META_FILE}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if base not in wanted or not member.isfile():
                    continue
                if member.size > _MAX_MEMBER_BYTES:
                    raise DataError(f"{path}: member {member.name} is {member.size:,} bytes, far larger than a "
                                    "CIFAR-10 batch (~31 MB); not the CIFAR-10 python archive")
                found[base] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{path}: unreadable or truncated tar archive ({type(e).__name__}: {e}). "
                        "Fix: delete it and download cifar-10-python.tar.gz again.") from None
    missing = sorted(set(SPLIT_BATCHES[split]) - set(found))
    if missing:
        raise DataError(
            f"{path}: no {BATCH_DIR}/{{{', '.join(missing)}}} members. Only the CIFAR-10 python archive "
            "(cifar-10-python.tar.gz) is read as a tar; for your own images use a folder or a .zip."
        )
    batches = {name: found[name] for name in SPLIT_BATCHES[split]}
    return _assemble(batches, found.get(META_FILE), split=split, source=str(path))
