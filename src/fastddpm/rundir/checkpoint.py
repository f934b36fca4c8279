"""The .pt checkpoint format: `checkpoints/ckpt_<step>.pt` (torch.save of plain dicts and tensors) and a `.sha256`
beside it.

Writing goes: digest file, then the checkpoint, each atomically (fastddpm.rundir.files), so the final path only
ever holds a complete file and a crash at any point leaves the previous checkpoint intact. Loading uses
torch.load(weights_only=True), which refuses pickled code, and checks the digest: a truncated or bit-flipped file
is detected, and `--resume latest` falls back to the newest checkpoint that verifies. What a checkpoint holds is
the Checkpointer's business (fastddpm.rundir.checkpointer); this module only stores and verifies it.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from fastddpm.rundir.files import CheckpointError, atomic_write_bytes, warn_on_rank_0

CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt_{step:09d}.pt"


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint files in `ckpt_dir`, oldest first (by step number in the name)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(ckpt_dir: Path, step: int, state: dict[str, Any], *, keep: int) -> Path:
    """Serialise `state` to ckpt_<step>.pt atomically, then delete all but the newest `keep` checkpoints. Temp files
    of an earlier save that was killed midway are removed here, by the one process that writes checkpoints: a
    reader (sample, eval, export on a run still training) must not, or it could delete the save in flight."""
    if ckpt_dir.is_dir():
        for leftover in sorted(ckpt_dir.glob(".ckpt_*.tmp.*")):
            warnings.warn(f"removing {leftover}: an incomplete checkpoint from an interrupted save", stacklevel=2)
            leftover.unlink(missing_ok=True)
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **state}, buf)
    data = buf.getvalue()
    path = checkpoint_path(ckpt_dir, step)
    digest = path.with_suffix(".sha256")
    # The digest goes in first: a checkpoint without its digest is never at the final path.
    old_digest = digest.read_bytes() if digest.is_file() else None  # this step saved before (a resume at the end)
    atomic_write_bytes(digest, hashlib.sha256(data).hexdigest().encode())
    try:
        atomic_write_bytes(path, data)
    except BaseException:
        # The checkpoint is the large write, where a full disk strikes. Left in place, the new digest would be a
        # digest of no file, or would fail this step's earlier checkpoint (still whole) as corrupted.
        if old_digest is None:
            digest.unlink(missing_ok=True)
        else:
            atomic_write_bytes(digest, old_digest)
        raise
    prune_checkpoints(ckpt_dir, keep=keep)
    return path


def prune_checkpoints(ckpt_dir: Path, *, keep: int) -> None:
    """Keep the newest `keep` checkpoints. A failed delete is a warning, never a stopped run."""
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        for p in (old, old.with_suffix(".sha256")):
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                warnings.warn(f"could not delete old checkpoint {p}: {e}", stacklevel=2)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and verify one checkpoint. Raises CheckpointError naming the file on any problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    digest_file = path.with_suffix(".sha256")
    if digest_file.is_file():
        expected = digest_file.read_text().strip()
        if hashlib.sha256(data).hexdigest() != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupted (its SHA-256 does not match {digest_file.name})",
                "; use an earlier checkpoint of the same folder, or pass the run directory (to train on: --resume "
                "latest), which takes the newest one that verifies")
    # torch.save writes a zip archive (the legacy format a pickle); anything else is some other file, which
    # torch.load would report as an unpickling error about load keys.
    if not (data.startswith(b"PK\x03\x04") or data.startswith(b"\x80")):
        kind = "empty" if not data else f"it starts with {data[:8]!r}"
        raise CheckpointError(f"{path} is not a PyTorch checkpoint file ({kind}; torch.save writes a zip archive), so "
                              f"not a fastddpm checkpoint", NOT_A_CHECKPOINT_FIX)
    foreign = _foreign_zip(data)
    if foreign:
        raise CheckpointError(f"{path} is a zip archive ({foreign}), not a fastddpm checkpoint: torch.save's archive "
                              "holds a data.pkl", NOT_A_CHECKPOINT_FIX)
    try:
        with warnings.catch_warnings():  # torch's advice about pickle protocols is about its reader, not the file
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's weights-only reader: its message is advice about torch.load's own defaults; what the user needs is
        # the code the file names, where it names some, and otherwise that this is no checkpoint
        code = re.search(r"GLOBAL (\S+)", str(e))
        if code:
            raise CheckpointError(
                f"could not load checkpoint {path}: it names code ({code.group(1)}), which a fastddpm checkpoint never "
                "holds", ". fastddpm loads with weights_only=True and refuses files that carry code; pass a run folder "
                "or a .pt written by `fastddpm train`") from None
        raise CheckpointError(f"{path} is not a fastddpm checkpoint: it is a pickle of something other than tensors "
                              "and settings, or cut short", NOT_A_CHECKPOINT_FIX
                              + "; if it was one, cut short, use an earlier checkpoint") from None
    except Exception as e:
        text = str(e)
        if "magic number" in text:  # a pickle, but not one torch.save wrote
            raise CheckpointError(f"{path} is not a fastddpm checkpoint: it is a pickle that torch.save did not "
                                  "write", NOT_A_CHECKPOINT_FIX) from None
        if "PytorchStreamReader" in text:  # torch's zip reader: the archive ends before its directory, or is damaged
            said = "its zip archive cannot be read (cut short or damaged)"
        else:  # the first line of the reader's message, without the C++ source location torch puts before some
            first = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text.splitlines()[0] if text else "")
            said = f"{type(e).__name__}: {first.rstrip(' .')}"
        raise CheckpointError(
            f"could not load checkpoint {path}: {said}",
            ". fastddpm loads with weights_only=True and refuses files that carry code; if the file is truncated, "
            "use an earlier checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a fastddpm checkpoint (format {CHECKPOINT_FORMAT})", NOT_A_CHECKPOINT_FIX)
    return state


# what a path that is no checkpoint should have been
NOT_A_CHECKPOINT_FIX = (". Pass a run folder, or a .pt written by `fastddpm train` (RUN/checkpoints/ckpt_*.pt) or its "
                        "ema.safetensors export")


def _foreign_zip(data: bytes) -> str | None:
    """Its members ("2 members: a.txt, b.txt") when `data` is a readable zip archive that torch.save did not write
    (it writes one folder holding data.pkl); None for torch's archive, or one too damaged to list, which torch.load
    reports as cut short."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    if any(n.endswith("data.pkl") for n in names):
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} member{'s' if len(names) != 1 else ''}: {shown}" if names else "empty"


def load_latest(ckpt_dir: Path, map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies; broken newer ones are skipped with a warning naming them.
    Temp files are never read (they never reach a final path) and never deleted here: one may be a save in flight
    (the next save_checkpoint removes a killed one's)."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            warn_on_rank_0(f"skipping unusable checkpoint: {e.problem}")  # its fix is what happens next
    return None


def step_of(path: Path) -> int:
    """The step in a checkpoint's name: ckpt_000000042.pt or ckpt_000000042.dcp -> 42."""
    return int(path.name.split("_")[1].split(".")[0])
