"""Images already decoded into a .npy / .npz file (uint8), e.g. a dataset someone exported with numpy.

Always `allow_pickle=False`: an object array in a .npy is a pickle and could run code when loaded.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from fastddpm.data.decode import ArrayData
from fastddpm.data.errors import DataError

IMAGE_KEYS = ("images", "x", "arr_0")
LABEL_KEYS = ("labels", "y")
CLASS_NAMES_KEY = "class_names"  # optional str array in an .npz
LAYOUTS = "(N, H, W), (N, H, W, C) with C in 1/3/4, or (N, C, H, W) with C in 1/3"


def dtype_problem(dtype: np.dtype, *, source: str) -> str | None:
    """Why prepare refuses images of this dtype, with the fix; None for uint8. `data info` says it from the
    array's header alone, before anyone waits for a prepare."""
    if dtype == np.uint8:
        return None
    hint = ("if the values are in [0, 1], save (x * 255).round().astype(np.uint8); "
            "if they are in [-1, 1], save ((x + 1) * 127.5).round().astype(np.uint8)"
            if dtype.kind == "f" else "save x.astype(np.uint8) if the values are already 0..255")
    return f"{source}: images are {dtype}, but a prepared dataset stores uint8 pixels. Fix: {hint}."


def image_key(keys: list[str], split: str) -> str | None:
    """The member of an .npz that holds the images of `split` (None: none; a missing x_<split> is the reader's
    to explain)."""
    split_keys = npz_split_keys(keys, split)
    if split_keys is not None:
        return split_keys[0]
    return next((k for k in IMAGE_KEYS if k in keys), None)


def to_nchw(images: np.ndarray, *, source: str) -> np.ndarray:
    """Bring a uint8 image array to (N, C, H, W); channels-last wins when the last dim could be channels."""
    problem = dtype_problem(images.dtype, source=source)
    if problem is not None:
        raise DataError(problem)
    if images.ndim == 3:
        return images[:, None]
    if images.ndim == 4 and images.shape[3] in (1, 3, 4):
        return images.transpose(0, 3, 1, 2)
    if images.ndim == 4 and images.shape[1] in (1, 3):
        return images
    raise DataError(f"{source}: images have shape {images.shape}; expected {LAYOUTS}.")


def _labels(labels: np.ndarray | None, n: int, *, source: str) -> tuple[np.ndarray, list[str]]:
    if labels is None:
        return np.full(n, -1, dtype=np.int64), []
    if labels.shape == (n, 1):
        labels = labels[:, 0]  # Keras' layout: keras.datasets.cifar10.load_data() gives y of shape (N, 1)
    if labels.dtype.kind not in "iu" or labels.shape != (n,):
        raise DataError(f"{source}: labels are {labels.dtype} {labels.shape}; expected integers of shape ({n},)")
    labels = labels.astype(np.int64)
    if n and labels.min() < 0:
        raise DataError(f"{source}: labels must be class indices >= 0, found {labels.min()}")
    return labels, [str(i) for i in range((int(labels.max()) + 1) if n else 0)]


def _load(path: Path, **kwargs: object) -> object:
    try:
        return np.load(path, allow_pickle=False, **kwargs)
    except ValueError as e:  # "Object arrays cannot be loaded when allow_pickle=False"
        raise DataError(f"{path}: cannot load without pickle ({e}). Fix: save plain numeric arrays "
                        "(np.save/np.savez of uint8 images and integer labels).") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: unreadable numpy file ({type(e).__name__}: {e})") from None


def _member(npz: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    """One array of an .npz. Members load lazily, so their failures come here, not from np.load."""
    try:
        return npz[key]
    except ValueError as e:  # "Object arrays cannot be loaded when allow_pickle=False"
        raise DataError(f"{path}[{key}]: cannot load without pickle ({e}). Fix: save plain numeric arrays "
                        "(uint8 images, integer labels, class_names as a str array).") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # a damaged member (bad CRC, truncated)
        raise DataError(f"{path}[{key}]: unreadable array ({type(e).__name__}: {e})") from None


def _name(value: object) -> str:
    """A class name from an .npz's class_names: str, or bytes (an 'S' array) decoded as UTF-8."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def read_npy(path: Path) -> ArrayData:
    # mmap: a large .npy is copied into the cache chunk by chunk instead of being loaded whole.
    images = _load(path, mmap_mode="r")
    images_nchw = to_nchw(images, source=str(path))
    labels, names = _labels(None, len(images_nchw), source=str(path))
    return ArrayData(images_nchw=images_nchw, labels=labels, class_names=names,
                     notes=["a .npy holds no labels: labels -1"])


def npz_split_keys(keys: list[str], split: str) -> tuple[str, str | None] | None:
    """Keras-style x_train/y_train/x_test/y_test keys for a split, or None if the file has none."""
    if f"x_{split}" in keys:
        return f"x_{split}", (f"y_{split}" if f"y_{split}" in keys else None)
    return None


def read_npz(path: Path, split: str) -> ArrayData:
    with _load(path) as npz:
        keys = list(npz.files)
        split_keys = npz_split_keys(keys, split)
        if split_keys is not None:
            image_key, label_key = split_keys
        else:
            if any(k.startswith("x_") for k in keys):
                have = sorted(k[2:] for k in keys if k.startswith("x_"))
                raise DataError(f"{path}: no x_{split} array for split {split!r}; it has {have}. "
                                f"Fix: pass --split {' or --split '.join(have)}.")
            image_key = next((k for k in IMAGE_KEYS if k in keys), None)
            label_key = next((k for k in LABEL_KEYS if k in keys), None)
        if image_key is None:
            raise DataError(f"{path}: no images array; looked for keys {', '.join(IMAGE_KEYS)} but found "
                            f"{', '.join(keys) or 'none'}. Fix: np.savez(path, images=x, labels=y).")
        images_nchw = to_nchw(_member(npz, image_key, path), source=f"{path}[{image_key}]")
        labels, names = _labels(_member(npz, label_key, path) if label_key else None, len(images_nchw),
                                source=f"{path}[{label_key}]")
        notes = [] if label_key else [f"no labels array ({', '.join(LABEL_KEYS)}) in the .npz: labels -1"]
        if CLASS_NAMES_KEY in keys and label_key:
            given = [_name(s) for s in np.ravel(_member(npz, CLASS_NAMES_KEY, path)).tolist()]
            if len(given) < len(names):
                raise DataError(f"{path}: {len(given)} class_names for labels up to {len(names) - 1}")
            names = given
    return ArrayData(images_nchw=images_nchw, labels=labels, class_names=names, notes=notes)
