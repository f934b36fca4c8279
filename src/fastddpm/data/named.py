"""Named datasets (mnist, fashion-mnist, cifar10): find a local copy, else download and verify it.

Where we look, in order: <cache_dir>/downloads/<name>/, then copies installed by the OS (Debian's
`dataset-fashion-mnist` puts Fashion-MNIST in /usr/share/datasets/fashion-mnist). Downloads go to a
temp file that is renamed into place only after its md5 matches the official one (the same table
torchvision uses), so an interrupted or tampered download never looks like a dataset.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fastddpm.data import cifar, idx
from fastddpm.data.errors import DataError
from fastddpm.progress import progress_bar

DOWNLOAD_TIMEOUT_S = 30  # per socket operation, not for the whole file
_USER_AGENT = "fastddpm-data/1 (python urllib)"

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_IDX_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"

# Official md5 of each downloadable file. Tests monkeypatch entries to checksum their own files.
CHECKSUMS: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12e480ee83cd310",
    },
    "cifar10": {CIFAR10_ARCHIVE: "c58f30108f718f92721af3b95e74349a"},
}


@dataclass(kw_only=True, frozen=True)
class NamedDataset:
    name: str
    kind: str  # "idx" or "cifar10": which reader the local copy needs
    mirrors: tuple[str, ...]  # base URLs, tried in order
    mirror_env: str  # comma-separated base URLs that replace `mirrors` (tests, private mirrors)
    class_names: tuple[str, ...] | None  # None: read from the files (CIFAR's batches.meta)
    system_dirs: tuple[Path, ...] = ()  # where OS packages install a copy
    system_hint: str = ""  # how to get such a copy

    def files_for(self, split: str) -> tuple[str, ...]:
        if split not in ("train", "test"):
            raise DataError(f"split={split!r}: {self.name} has only train and test splits")
        return _IDX_SPLIT_FILES[split] if self.kind == "idx" else (CIFAR10_ARCHIVE,)


DATASETS: dict[str, NamedDataset] = {
    "mnist": NamedDataset(
        name="mnist", kind="idx",
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        mirror_env="FASTDDPM_MIRROR_MNIST", class_names=tuple(str(d) for d in range(10))),
    "fashion-mnist": NamedDataset(
        name="fashion-mnist", kind="idx",
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        mirror_env="FASTDDPM_MIRROR_FASHION_MNIST", class_names=FASHION_MNIST_CLASSES,
        system_dirs=(Path("/usr/share/datasets/fashion-mnist"),),
        system_hint="`apt-get install dataset-fashion-mnist` (Debian/Ubuntu) installs it in "
                    "/usr/share/datasets/fashion-mnist"),
    "cifar10": NamedDataset(
        name="cifar10", kind="cifar10", mirrors=("https://www.cs.toronto.edu/~kriz/",),
        mirror_env="FASTDDPM_MIRROR_CIFAR10", class_names=None),
}
NAMED_DATASETS: tuple[str, ...] = tuple(DATASETS)
_ALIASES = {"fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "cifar-10": "cifar10",
            "cifar_10": "cifar10"}


def canonical_name(source: str) -> str | None:
    """'MNIST', 'fashion_mnist', 'cifar-10' -> the named dataset, or None if `source` is not one."""
    key = source.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in DATASETS else None


def download_dir(cache_root: Path, name: str) -> Path:
    return cache_root / "downloads" / name


def search_dirs(ds: NamedDataset, cache_root: Path) -> list[Path]:
    return [download_dir(cache_root, ds.name), *ds.system_dirs]


def mirrors(ds: NamedDataset) -> list[str]:
    env = os.environ.get(ds.mirror_env, "").strip()
    bases = [b.strip() for b in env.split(",") if b.strip()] if env else list(ds.mirrors)
    return [b if b.endswith("/") else b + "/" for b in bases]


def find_local(ds: NamedDataset, split: str, cache_root: Path) -> Path | None:
    """The folder (IDX), archive or batch folder (CIFAR) holding `split`, or None. Does not download."""
    ds.files_for(split)  # validates the split
    for folder in search_dirs(ds, cache_root):
        if not folder.is_dir():
            continue
        if ds.kind == "idx":
            found = idx.find_split_files(folder, split)
            if found is not None and found[1] is not None:
                return folder
        else:
            if (folder / CIFAR10_ARCHIVE).is_file():
                return folder / CIFAR10_ARCHIVE
            batches = cifar.find_batch_folder(folder)
            if batches is not None:
                return batches
    return None


class _FetchFailed(Exception):
    """One URL did not yield a verified file; the message is the reason shown to the user."""


def _fetch(url: str, dest: Path, *, expected_md5: str, progress: bool) -> None:
    """Download url -> dest via a temp file, renamed only once its md5 matches."""
    temp = dest.with_name(f".{dest.name}.part-{secrets.token_hex(4)}")
    try:
        request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
        md5 = hashlib.md5()
        try:
            with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as response, open(temp, "wb") as f:
                total = int(response.headers.get("Content-Length") or 0) or None
                with progress_bar(total, desc=dest.name, unit="B", unit_scale=True, disable=not progress) as bar:
                    while chunk := response.read(1 << 20):
                        f.write(chunk)
                        md5.update(chunk)
                        bar.update(len(chunk))
                f.flush()
                os.fsync(f.fileno())
        # ValueError: a malformed URL in the mirror variable; HTTPException: a bad port (InvalidURL), a response cut
        # short (IncompleteRead), a server that answers no HTTP (BadStatusLine): none of them is an OSError
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
            raise _FetchFailed(f"download failed ({getattr(e, 'reason', None) or e})") from None
        actual = md5.hexdigest()
        if actual != expected_md5:
            raise _FetchFailed(f"md5 mismatch: expected {expected_md5}, got {actual}; the download was deleted")
        os.replace(temp, dest)
    finally:
        temp.unlink(missing_ok=True)


def download(ds: NamedDataset, split: str, cache_root: Path, *, progress: bool) -> Path:
    """Fetch the files `split` needs into <cache_root>/downloads/<name>/ and return the local copy."""
    target = download_dir(cache_root, ds.name)
    target.mkdir(parents=True, exist_ok=True)
    for filename in ds.files_for(split):
        dest = target / filename
        if dest.is_file():
            continue  # verified when it was downloaded (renamed only after the md5 matched)
        failures = []
        for base in mirrors(ds):
            url = base + filename
            try:
                _fetch(url, dest, expected_md5=CHECKSUMS[ds.name][filename], progress=progress)
                break
            except _FetchFailed as e:
                failures.append(f"  {url}: {e}")
        else:
            raise DataError(_download_error(ds, split, cache_root, failures))
    found = find_local(ds, split, cache_root)
    assert found is not None, f"downloaded {ds.name} but find_local does not see it in {target}"
    return found


def _download_error(ds: NamedDataset, split: str, cache_root: Path, failures: list[str]) -> str:
    looked = "\n".join(f"  {d}" for d in search_dirs(ds, cache_root))
    files = ", ".join(ds.files_for(split))
    fixes = [f"put {files} in {download_dir(cache_root, ds.name)}"]
    if ds.system_hint:
        fixes.append(ds.system_hint)
    fixes.append(f"or pass a path to a local copy instead of {ds.name!r}")
    return (f"could not download {ds.name} ({split}):\n" + "\n".join(failures)
            + f"\nNo local copy in:\n{looked}\nFix: " + "; ".join(fixes) + ".")
