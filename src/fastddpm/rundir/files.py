"""Files that survive crashes, and weights that anyone can load safely.

A write goes temp file -> fsync -> os.replace into place -> fsync the directory, so the final path only ever
holds a complete file: a crash at any point leaves the previous version intact. Weights are written as
safetensors (tensors and JSON metadata, no code), readable by any framework.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message names the file and what to do. `problem` is
    the message without the fix `fix` (its separator included), for a caller that already does what the fix says
    (rundir.checkpoint.load_latest, which takes an earlier checkpoint itself)."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem + fix)
        self.problem = problem


def rank_0_by_env() -> bool:
    """Whether this process is rank 0 by torchrun's RANK (a plain process, or an empty RANK, is): for what is said
    before the process group exists, or outside it (a signal handler)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def warn_on_rank_0(message: str, stacklevel: int = 2) -> None:
    """A warning about a run folder, from rank 0 alone: every rank reads the same folder and finds the same, and N
    copies of one line bury the rest of the log. Read from the environment, since the checkpoint is looked for
    before the process group exists."""
    if rank_0_by_env():
        warnings.warn(message, stacklevel=stacklevel + 1)


def make_writable_dir(path: Path, *, flag: str, fix: str) -> list[Path]:
    """Create the output folder `path` (parents too) before any work that writes there, or a ConfigError naming
    `flag` (e.g. "--out"), the path and the reason (a file on its path, no permission, a read-only disk), then
    `fix`: found after the work, it would be a traceback, and the work lost. Returns the folders it created, the
    outermost first (for remove_if_empty when what follows is refused)."""
    from fastddpm.config import ConfigError

    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: is a file, not a folder: {fix}")
    refuse_dangling_link(path, flag=flag, fix=fix)
    created = [p for p in reversed((path, *path.parents)) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot create the folder ({e.strerror or e}): {fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the folder is not writable here (permissions, or a read-only disk): "
                          f"{fix}")
    return created


def remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders make_writable_dir created, innermost first, while they are empty: a command refused
    after making its output folder leaves no empty folder behind (one that holds anything is kept)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def refuse_dangling_link(path: Path, *, flag: str, fix: str) -> None:
    """A link to nothing, at `path` or above it, exists() as False, yet no folder can be made there."""
    from fastddpm.config import ConfigError

    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            try:
                os.stat(p)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ConfigError(f"{flag} {path}: {p} is a link that leads back to itself (a loop): {fix}") \
                        from None
            raise ConfigError(f"{flag} {path}: {p} is a link to {os.readlink(p)}, which does not exist (make that "
                              f"folder): {fix}")


def check_writable_dir(path: Path, *, flag: str, fix: str) -> None:
    """make_writable_dir's refusals without creating anything: `path` is a writable folder, or its nearest existing
    parent is one it can be made in. For work that may still be refused after this check (its inputs are read
    later), so that a refused run leaves no empty folder behind."""
    from fastddpm.config import ConfigError

    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: is a file, not a folder: {fix}")
    refuse_dangling_link(path, flag=flag, fix=fix)
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: cannot create the folder ({parent} is a file): {fix}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not writable here (permissions, or a read-only disk): {fix}")


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems cannot open a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either its old content or all of `data`, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def save_safetensors(state_dict: dict[str, torch.Tensor], path: Path, metadata: dict[str, Any]) -> Path:
    """Write weights as safetensors, atomically. Metadata values become JSON strings (strings stay as they are)."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    atomic_write_bytes(path, save(tensors, metadata=meta))
    return path


def read_safetensors_metadata(path: Path) -> dict[str, str]:
    """The metadata of a safetensors file (its header only). CheckpointError naming the file if it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors' Rust errors share no base class below Exception
        raise _unreadable(path, e) from None


def load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors on the CPU, metadata) of a safetensors file. CheckpointError naming the file if it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # noqa: BLE001
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    if not Path(path).is_file():
        return CheckpointError(f"{path} does not exist: pass the path of a .safetensors file")
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(
        f"{path} is not a readable safetensors file ({first}): it is truncated or not safetensors. If it is a run's "
        f"ema.safetensors, every checkpoint rewrites it: sample from the run directory or from a "
        f"checkpoints/ckpt_*.pt file instead")
