"""Builders of small, real data files for the fastddpm.data tests (imported by tests/test_data_*.py).

Everything is written the way the real datasets are: IDX with struct + gzip, PNG/JPEG with Pillow,
CIFAR batches as Python 2's cPickle wrote them (numpy.core.multiarray._reconstruct, byte strings).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import http.server
import io
import pickle
import socket
import struct
import tarfile
import threading
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from PIL import Image

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file(),
                                   reason="Debian's dataset-fashion-mnist is not installed")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache root; FASTDDPM_CACHE points there too, so nothing touches ~/.cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FASTDDPM_CACHE", str(root))
    return root


def rng_images(n: int, h: int = 8, w: int = 8, c: int | None = None, seed: int = 0) -> np.ndarray:
    """Random uint8 images: (n, h, w) or (n, h, w, c)."""
    shape = (n, h, w) if c is None else (n, h, w, c)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------- IDX

def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array: magic 0x0000 08 <ndim>, big-endian dims, raw bytes."""
    assert array.dtype == np.uint8
    return struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx(path: Path, array: np.ndarray, *, gz: bool = True) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def make_idx_folder(folder: Path, *, n_train: int = 12, n_test: int = 5, gz: bool = True,
                    seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """An MNIST-layout folder; returns {split: (images (N, 28, 28), labels (N,))} as written."""
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng_images(n, 28, 28, seed=seed + n)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images, gz=gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels, gz=gz)
        out[split] = (images, labels)
    return out


def real_fashion_slice(n: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The first n real Fashion-MNIST images (n, 28, 28) and labels, read straight from the Debian
    gzip files with gzip + numpy only (independent of the code under test)."""
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(FASHION_DIR / f"{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(16 + n * 784)[16:], dtype=np.uint8).reshape(n, 28, 28)
    with gzip.open(FASHION_DIR / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(8 + n)[8:], dtype=np.uint8)
    return images.copy(), labels.copy()


# ------------------------------------------------------------------------------------ image folders

def save_image(path: Path, array: np.ndarray, fmt: str | None = None, **kwargs: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format=fmt, **kwargs)
    return path


def make_class_folder(root: Path, per_class: dict[str, np.ndarray], ext: str = ".png") -> list[tuple[str, int]]:
    """root/<class>/<i>.png for each image; returns [(relative path, class index in given order)]."""
    written = []
    for label, (name, images) in enumerate(per_class.items()):
        for i, im in enumerate(images):
            rel = f"{name}/{i:03d}{ext}"
            save_image(root / rel, im)
            written.append((rel, label))
    return written


def zip_folder(root: Path, zip_path: Path, *, prefix: str = "", extra: dict[str, bytes] | None = None) -> Path:
    """Zip every file under root (members prefixed with `prefix`), plus `extra` raw members."""
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            zf.write(path, prefix + path.relative_to(root).as_posix())
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return zip_path


def truncated(data: bytes) -> bytes:
    """Cut an encoded image in half: the header survives, the pixel data does not."""
    return data[: len(data) // 2]


def encode(array: np.ndarray, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def huge_header_png(width: int = 10_000, height: int = 10_000) -> bytes:
    """A real, valid PNG that claims width x height pixels but is only ~12 KB: 1-bit, all zeros."""
    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ CIFAR

def _short_or_long_string(data: bytes) -> bytes:
    if len(data) < 256:
        return b"U" + bytes([len(data)]) + data  # SHORT_BINSTRING
    return b"T" + struct.pack("<i", len(data)) + data  # BINSTRING


def _int(value: int) -> bytes:
    return b"K" + bytes([value]) if 0 <= value < 256 else b"J" + struct.pack("<i", value)


def _py2_value(value: object) -> bytes:
    if isinstance(value, bytes):
        return _short_or_long_string(value)
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, list):
        return b"](" + b"".join(_py2_value(v) for v in value) + b"e"  # EMPTY_LIST MARK ... APPENDS
    if isinstance(value, np.ndarray):
        assert value.dtype == np.uint8 and value.flags.c_contiguous
        return (
            b"cnumpy.core.multiarray\n_reconstruct\n" + b"cnumpy\nndarray\n" + _int(0) + b"\x85"  # (0,)
            + _short_or_long_string(b"b") + b"\x87R"  # TUPLE3 REDUCE -> empty array
            + b"(" + _int(1) + b"(" + b"".join(_int(d) for d in value.shape) + b"t"  # state: (1, shape,
            + b"cnumpy\ndtype\n" + _short_or_long_string(b"u1") + _int(0) + _int(1) + b"\x87R"  # dtype('u1'),
            + b"(" + _int(3) + _short_or_long_string(b"|") + b"NNN" + _int(-1) + _int(-1) + _int(0) + b"tb"
            + b"\x89" + _short_or_long_string(value.tobytes()) + b"tb"  # False, raw bytes) BUILD
        )
    raise TypeError(type(value))


def py2_pickle(obj: dict[bytes, object]) -> bytes:
    """A protocol-2 pickle of a dict as Python 2 cPickle wrote the CIFAR-10 batches: byte-string keys
    and array data (BINSTRING), numpy.core.multiarray._reconstruct / numpy.ndarray / numpy.dtype."""
    items = b"".join(_py2_value(k) + _py2_value(v) for k, v in obj.items())
    return b"\x80\x02}(" + items + b"u."


CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def cifar_batches(per_batch: int = 3, seed: int = 0) -> dict[str, tuple[np.ndarray, list[int]]]:
    """{batch name: (data uint8 (n, 3072), labels)} for data_batch_1..5 and test_batch."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(x) for x in (np.arange(per_batch) + i) % 10]
        out[name] = (data, labels)
    return out


def cifar_files(batches: dict[str, tuple[np.ndarray, list[int]]], *, py2: bool = True,
                protocol: int = 4) -> dict[str, bytes]:
    """The pickled member files (batch files + batches.meta): as Python 2's cPickle wrote them, or (py2=False) as
    Python 3's pickle.dumps at `protocol` writes the same dicts (2: bytes as _codecs.encode; 5: numpy's arrays as
    numeric._frombuffer of an in-band buffer)."""
    files = {}
    for name, (data, labels) in batches.items():
        obj = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
               b"filenames": [f"img_{i}.png".encode() for i in range(len(labels))]}
        files[name] = py2_pickle(obj) if py2 else pickle.dumps(obj, protocol=protocol)
    meta = {b"label_names": [n.encode() for n in CIFAR_NAMES], b"num_cases_per_batch": 10000, b"num_vis": 3072}
    files["batches.meta"] = py2_pickle(meta) if py2 else pickle.dumps(meta, protocol=protocol)
    return files


def write_cifar_folder(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def write_cifar_tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def cifar_expected(batches: dict[str, tuple[np.ndarray, list[int]]], split: str) -> tuple[np.ndarray, np.ndarray]:
    names = [f"data_batch_{b}" for b in range(1, 6)] if split == "train" else ["test_batch"]
    images = np.concatenate([batches[n][0] for n in names]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([batches[n][1] for n in names]).astype(np.int64)
    return images, labels


# ------------------------------------------------------------------------------------- HTTP mirror

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, format: str, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self.requests.append(self.path)
        super().do_GET()


@contextlib.contextmanager
def serve_directory(directory: Path) -> Iterator[tuple[str, list[str]]]:
    """Serve `directory` on 127.0.0.1 in a thread; yields (base URL ending in '/', requested paths)."""
    requests: list[str] = []
    handler = type("Handler", (_QuietHandler,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens: connections are refused at once (offline stand-in)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def leftovers(cache_root: Path) -> list[str]:
    """Anything a failed build could have left in <cache>/prepared: temp/old dirs and cache dirs."""
    prepared = cache_root / "prepared"
    if not prepared.exists():
        return []
    return sorted(p.name for p in prepared.iterdir() if p.is_dir())
