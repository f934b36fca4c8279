"""Checkpoints that survive crashes, and weights that anyone can load safely.

A checkpoint is `checkpoints/ckpt_<step>.pt` (torch.save of plain dicts and tensors) plus a `.sha256` beside it.
Writing goes: temp file -> fsync -> digest file -> os.replace into place -> fsync the directory, so the final
path only ever holds a complete file, and a crash at any point leaves the previous checkpoint intact.
Loading uses torch.load(weights_only=True), which refuses pickled code, and checks the digest: a truncated or
bit-flipped file is detected, and `--resume latest` falls back to the newest checkpoint that verifies.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def _fsync_dir(path: Path) -> None:
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
    _fsync_dir(path.parent)


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt_{step:09d}.pt"


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint files in `ckpt_dir`, oldest first (by step number in the name)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(ckpt_dir: Path, step: int, state: dict[str, Any], *, keep: int) -> Path:
    """Serialise `state` to ckpt_<step>.pt atomically, then delete all but the newest `keep` checkpoints."""
    buf = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **state}, buf)
    data = buf.getvalue()
    path = checkpoint_path(ckpt_dir, step)
    # The digest goes in first: a checkpoint without its digest is never at the final path.
    atomic_write_bytes(path.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
    atomic_write_bytes(path, data)
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
                f"checkpoint {path} is corrupted (its SHA-256 does not match {digest_file.name}); "
                "resume from an earlier checkpoint in the same folder, or with --resume latest"
            )
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"could not load checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "fastddpm loads with weights_only=True and refuses files that carry code; if the file is truncated, "
            "resume from an earlier checkpoint"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a fastddpm checkpoint (format {CHECKPOINT_FORMAT})")
    return state


def load_latest(ckpt_dir: Path, map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies; broken newer ones are skipped with a warning naming them.
    Temp files of a save that was killed midway are reported and removed (they never reach a final path)."""
    if ckpt_dir.is_dir():
        for leftover in sorted(ckpt_dir.glob(".ckpt_*.tmp.*")):
            warnings.warn(f"ignoring {leftover}: an incomplete checkpoint from an interrupted save; removing it",
                          stacklevel=2)
            leftover.unlink(missing_ok=True)
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            warnings.warn(f"skipping unusable checkpoint: {e}", stacklevel=2)
    return None


def export_safetensors(state_dict: dict[str, torch.Tensor], path: Path, metadata: dict[str, Any]) -> Path:
    """Write weights as safetensors (no code, loadable anywhere), atomically. Metadata values become JSON strings."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    atomic_write_bytes(path, save(tensors, metadata=meta))
    return path


def load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    return tensors, meta


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (torch.compile's `_orig_mod.`, DDP's `module.`) so every model's keys agree."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside torch.compile's OptimizedModule and DDP's wrapper (in any nesting)."""
    while True:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
            module = module._orig_mod  # torch.compile(module)
        else:
            return module


def load_model_state(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, what: str = "the state dict"
                     ) -> None:
    """Load a state dict saved from a plain, compiled or DDP-wrapped model into a plain, compiled or DDP-wrapped
    one: the prefixes are stripped on both sides. A key mismatch names the keys (an architecture change)."""
    target = unwrap_model(module)
    state_dict = clean_state_dict(state_dict)
    expected = target.state_dict().keys()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{what} does not fit this {type(target).__name__}: "
            + (f"missing {len(missing)} key(s) ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
               if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {len(unexpected)} key(s) ({', '.join(unexpected[:4])}"
               f"{', ...' if len(unexpected) > 4 else ''})" if unexpected else "")
            + ". It was saved from a different architecture: build the model from the config saved with it")
    target.load_state_dict(state_dict)


def portable_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict with tensor learning rates as floats, so any device or path can load it."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])  # note: sync, at checkpoint time only
    return state


def with_current_optimizer_flags(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A saved optimizer state whose param groups carry this run's implementation flags (fused, foreach,
    capturable) and lr representation, so a checkpoint from any device or path resumes on this one."""
    saved = {**saved, "param_groups": [dict(g) for g in saved["param_groups"]]}
    for group, current in zip(saved["param_groups"], optimizer.param_groups):
        for key in ("fused", "foreach", "capturable", "differentiable", "lr"):
            if key in current:
                group[key] = current[key]
    return saved


def step_of(path: Path) -> int:
    """The step in a checkpoint's name: ckpt_000000042.pt or ckpt_000000042.dcp -> 42."""
    return int(path.name.split("_")[1].split(".")[0])


def newest_checkpoint(ckpt_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest usable checkpoint in `ckpt_dir`: a verified .pt file with its state, or an FSDP run's sharded
    .dcp directory with its metadata only (the shards are read once the model is sharded)."""
    from fastddpm.train.fsdp import latest_sharded

    found = [f for f in (load_latest(ckpt_dir), latest_sharded(ckpt_dir)) if f is not None]
    return max(found, key=lambda f: int(f[1]["step"])) if found else None


class Checkpointer:
    """A run's checkpoints, in one place: where they live (RUN_DIR/checkpoints), which format this run writes (a
    verified .pt file; under FSDP a sharded .dcp directory), which one a resume means, and what a save writes
    (the checkpoint, then RUN_DIR/ema.safetensors for sampling anywhere)."""

    def __init__(self, run_dir: str | Path, *, sharded: bool = False, keep: int = 3, is_main: bool = True):
        self.dir = Path(run_dir) / "checkpoints"
        self.ema_export = Path(run_dir) / "ema.safetensors"
        self.sharded, self.keep, self.is_main = sharded, keep, is_main

    def saved(self) -> list[Path]:
        """Every complete checkpoint, .pt files and .dcp directories, oldest first."""
        from fastddpm.train.fsdp import list_sharded

        return sorted(list_checkpoints(self.dir) + list_sharded(self.dir), key=step_of)

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        return newest_checkpoint(self.dir)

    def resolve(self, resume: str | Path | tuple | None) -> tuple[Path, dict[str, Any]] | None:
        """What to resume from: None (a new run); "latest" (the newest checkpoint that verifies, None if there is
        none yet); a run directory (its newest); a .pt file or a .dcp directory; or an already loaded
        (path, state) pair, returned as it is."""
        if resume is None or isinstance(resume, tuple):
            return resume
        if resume == "latest":
            return self.latest()
        path = Path(resume)
        if path.is_dir() and path.suffix == ".dcp":  # one sharded (FSDP) checkpoint
            from fastddpm.train.fsdp import read_meta

            return path, read_meta(path)
        if path.is_dir():  # a run directory
            found = newest_checkpoint(path / "checkpoints")
            if found is None:
                raise CheckpointError(f"no usable checkpoint in {path / 'checkpoints'}")
            return found
        return path, load_checkpoint(path)

    def check_format(self, found: tuple[Path, dict[str, Any]]) -> None:
        """A run resumes the format it writes: a sharded checkpoint under FSDP, a .pt file otherwise."""
        path, state = found
        if self.sharded and not state.get("sharded"):
            raise CheckpointError(
                f"{path} is a .pt checkpoint of a single-process or DDP run, and --parallel fsdp reads sharded "
                "checkpoints: resume it with --parallel ddp, or start the FSDP run in a new directory")
        if not self.sharded and state.get("sharded"):
            raise CheckpointError(
                f"{path} is a sharded checkpoint of an FSDP run: resume it under torchrun with --parallel fsdp "
                "(any number of processes, 1 included), or sample from the run's ema.safetensors")

    def save(self, step: int, *, model: torch.nn.Module, ema_model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, meta: dict[str, Any], export_meta: dict[str, Any]) -> Path | None:
        """Write the checkpoint of `step` (weights, EMA, optimizer, and `meta`: step, RNG, config, ...) and the EMA
        export. A .pt run: rank 0 writes, the other ranks return None at once (their state is the same).
        Sharded: every rank writes its shards and returns the path (a collective; the loop's "was a checkpoint
        written" then agrees across ranks), and rank 0 also writes the metadata and the gathered EMA."""
        if self.sharded:
            from fastddpm.train.fsdp import full_state_dict, save_sharded

            path = save_sharded(self.dir, step, model=model, ema_model=ema_model, optimizer=optimizer, meta=meta,
                                is_main=self.is_main, keep=self.keep)
            ema_full = full_state_dict(ema_model)  # a collective: the full weights land on rank 0
            if self.is_main:
                export_safetensors(ema_full, self.ema_export, export_meta)
            return path
        if not self.is_main:
            return None
        ema_weights = clean_state_dict(ema_model.state_dict())
        state = {"model": clean_state_dict(model.state_dict()), "ema": ema_weights,
                 "optimizer": portable_optimizer_state(optimizer), **meta}
        path = save_checkpoint(self.dir, step, state, keep=self.keep)
        export_safetensors(ema_weights, self.ema_export, export_meta)
        return path
