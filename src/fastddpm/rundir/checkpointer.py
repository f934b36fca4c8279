"""The Checkpointer: the one object that knows what a checkpoint holds.

A checkpoint is the model, its EMA, the optimizer, the loss scaler (fp16), the trainer's own state (step, images
seen, micro-batch split, RNG, thread count, world size: any object with state_dict() / load_state_dict()) and the
run's config. `save()` writes all of it, then RUN_DIR/ema.safetensors for sampling anywhere; `load()` puts all of
it back. The layout on disk (flat keys, as every fastddpm version has written them) is known here and in the
readers beside it (rundir.locate), nowhere else; the two formats are rundir.checkpoint (.pt) and rundir.sharded
(.dcp, under --parallel fsdp). As edm2's
CheckpointIO and torchtitan's CheckpointManager, it is given the objects once and reads and writes them itself.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from fastddpm.rundir import checkpoint, sharded
from fastddpm.rundir.files import CheckpointError, fsync_dir, read_safetensors_metadata, save_safetensors
from fastddpm.rundir.layout import RunDir
from fastddpm.rundir.locate import EMA_EXPORT_FORMAT, Checkpoint, newest, saved
from fastddpm.rundir.state_dicts import (clean_state_dict, configured_optimizer_settings, full_state_dict,
                                         load_model_state, match_state_layout, portable_optimizer_state,
                                         restore_optimizer_settings, with_current_optimizer_flags)


# A full disk, an exhausted quota, a disk remounted read-only, a file larger than the file system (FAT32: 4 GiB) or
# the process (ulimit -f) allows: the run cannot go on here, nothing is wrong with it.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class HasWeights(Stateful, Protocol):
    model: torch.nn.Module  # the EMA: its weights live in a module of the model's architecture


class Checkpointer:
    """A run's checkpoints: where they live (RUN_DIR/checkpoints), which format this run writes (`sharded`: FSDP's
    .dcp directories; else verified .pt files, written by rank 0 alone), how many are kept, and what each holds.

    `train_state.state_dict()` must hold "step" and "images_seen" (they name the file and go into the EMA
    export's metadata); its keys are stored at the top level of the checkpoint beside the weights."""

    def __init__(self, run_dir: str | Path, *, model: torch.nn.Module, ema: HasWeights,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, train_state: Stateful,
                 config: dict[str, Any], sharded: bool = False, keep: int = 3, is_main: bool = True):
        self.run = RunDir(Path(run_dir))
        self.model, self.ema, self.optimizer, self.scaler = model, ema, optimizer, scaler
        self.train_state, self.config = train_state, config
        self.sharded, self.keep, self.is_main = sharded, keep, is_main

    @property
    def dir(self) -> Path:
        return self.run.checkpoints

    def saved(self) -> list[Path]:
        """Every complete checkpoint, .pt files and .dcp directories, oldest first."""
        return saved(self.dir)

    def latest(self) -> Checkpoint | None:
        return newest(self.dir)

    def kept(self, step: int) -> Path | None:
        """The complete checkpoint of `step` in this run's folder, where ema.safetensors is of the same step (not an
        abandoned branch's): a resume that trains no step keeps both as they are. Saved again, they recorded the
        resuming command's settings (another --lr, --batch-size) as those that trained the weights. None otherwise:
        a run resumed from another folder or a branch's checkpoint writes its own."""
        same = [p for p in self.saved() if checkpoint.step_of(p) == step]
        try:
            ema_step = read_safetensors_metadata(self.run.ema).get("step")
        except CheckpointError:  # none, or unreadable: written again
            return None
        return same[-1] if same and ema_step == str(step) else None

    def set_aside_after(self, step: int) -> tuple[Path, list[int]] | None:
        """A resume from step `step` when the folder holds later checkpoints starts a new branch: move the later
        ones (the abandoned branch) into checkpoints/abandoned-after-<step>-<UTC time>/, where no reader looks.
        Left in place, `--resume latest` would return to the abandoned branch, retention would delete this branch's
        first checkpoints as the oldest, and a save of a step both branches reach would overwrite the old one.
        Nothing is deleted. Returns the folder and the steps moved, or None when no checkpoint is later. Rank 0's
        job, once, before this run's first save."""
        later = [p for p in self.saved() if checkpoint.step_of(p) > step]
        if not later:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        to = self.dir / f"abandoned-after-{step:09d}-{stamp}"
        to.mkdir()
        for path in later:
            for p in (path, path.with_suffix(".sha256")):
                if p.exists():
                    os.replace(p, to / p.name)
        fsync_dir(self.dir)
        return to, [checkpoint.step_of(p) for p in later]

    def save(self) -> Path | None:
        """Write the checkpoint of the train state's step and the EMA export. A .pt run: rank 0 writes, the other
        ranks return None at once (their state is the same). Sharded: every rank writes its shards and returns the
        path (a collective; the loop's "was a checkpoint written" then agrees across ranks), and rank 0 also
        writes the metadata and the gathered EMA. A disk that is full, over quota or read-only ends the run with a
        CheckpointError saying which checkpoint is intact and how to go on."""
        try:
            return self._save()
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            kept = newest(self.dir)
            raise CheckpointError(
                f"could not write the checkpoint of step {self.train_state.state_dict()['step']:,} in {self.dir}: "
                f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}). "
                + (f"The newest checkpoint, {kept.path.name} (step {kept.step:,}), is intact: " if kept else
                   "No checkpoint was written before: ")
                + ("raise the file size limit (`ulimit -f`), or give --out on a file system that takes larger files "
                   "(FAT32 stops at 4 GiB)" if e.errno == errno.EFBIG else
                   "free space (fewer --keep-checkpoints, or --out on another disk)")
                + ", then continue with --resume latest") from e

    def _save(self) -> Path | None:
        state = self.train_state.state_dict()
        meta = {"scaler": self.scaler.state_dict() if self.scaler is not None else None, **state,
                "config": self.config}
        export_meta = {"config": self.config, "step": state["step"], "images_seen": state["images_seen"],
                       "format": EMA_EXPORT_FORMAT}
        if self.sharded:
            path = sharded.save_sharded(self.dir, state["step"], model=self.model, ema_model=self.ema.model,
                                        optimizer=self.optimizer, meta=meta, is_main=self.is_main, keep=self.keep)
            ema_full = full_state_dict(self.ema.model)  # a collective: the full weights land on rank 0
            if self.is_main:
                save_safetensors(ema_full, self.run.ema, export_meta)
            return path
        if not self.is_main:
            return None
        ema_weights = clean_state_dict(self.ema.state_dict())
        path = checkpoint.save_checkpoint(self.dir, state["step"], {
            "model": clean_state_dict(self.model.state_dict()), "ema": ema_weights,
            "optimizer": portable_optimizer_state(self.optimizer), **meta}, keep=self.keep)
        save_safetensors(ema_weights, self.run.ema, export_meta)
        return path

    def load(self, ckpt: Checkpoint) -> list[str]:
        """Put everything `ckpt` holds back into the objects: weights, EMA, optimizer (with this run's configured
        AdamW settings, not the checkpoint's), scaler, then the train state (whose RNG comes last, so that nothing
        drawn while loading shifts it). Sharded: a collective. Returns notes for the log: the settings changed."""
        ckpt.check_resumable(sharded_run=self.sharded)
        settings = configured_optimizer_settings(self.optimizer)
        if ckpt.kind == "dcp":
            sharded.load_sharded(ckpt.path, model=self.model, ema_model=self.ema.model, optimizer=self.optimizer)
        else:
            load_model_state(self.model, ckpt.weights("model"), what="the checkpoint's model weights")
            self.ema.load_state_dict(ckpt.weights("ema"))
            self.optimizer.load_state_dict(with_current_optimizer_flags(ckpt.meta["optimizer"], self.optimizer))
            match_state_layout(self.optimizer)  # a checkpoint of the other memory format (channels_last on/off)
            if self.scaler is not None and ckpt.meta.get("scaler"):
                self.scaler.load_state_dict(ckpt.meta["scaler"])
        changed = restore_optimizer_settings(self.optimizer, settings)
        self.train_state.load_state_dict(ckpt.meta)
        return [changed] if changed else []
