"""The sharded checkpoint format of `--parallel fsdp` (torch.distributed.checkpoint, DCP).

A checkpoint is a directory `checkpoints/ckpt_<step>.dcp/`: one `__<rank>_0.distcp` file per rank plus DCP's
`.metadata` (written by DCP's coordinator after every rank's file), and `meta.pt` (step, config, RNG, ...) from
rank 0. The directory is written under a temporary name and renamed when complete, so a killed save never shadows
the last good one. DCP reshards on load: a checkpoint written by N ranks resumes on M. Across ranks the directory
must be on a filesystem every rank sees (as for any multi-node checkpoint). `read_sharded_checkpoint` turns one
back into full tensors in a single process, for sampling or inspection.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fastddpm.rundir.files import CheckpointError, fsync_dir, warn_on_rank_0

_NAME = re.compile(r"^ckpt_(\d+)\.dcp$")
_MOVED_ASIDE = re.compile(r"^\.ckpt_(\d+)\.dcp\.old$")
META = "meta.pt"
META_FORMAT = "fastddpm-dcp-1"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by its coordinator


def sharded_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"ckpt_{step:09d}.dcp"


def list_sharded(ckpt_dir: Path) -> list[Path]:
    """Complete sharded checkpoints (renamed into place, with DCP's index and the metadata), oldest first. A
    checkpoint a re-save of its step moved aside (.ckpt_<step>.dcp.old) counts while its step has no other: a save
    killed between its two renames leaves it so, and it is whole."""
    if not ckpt_dir.is_dir():
        return []
    found = {}
    for p in sorted(ckpt_dir.iterdir(), key=lambda p: p.name.startswith(".")):  # final names first
        m = _NAME.match(p.name) or _MOVED_ASIDE.match(p.name)
        if m and p.is_dir() and int(m.group(1)) not in found and (p / DCP_METADATA).is_file() \
                and (p / META).is_file():
            found[int(m.group(1))] = p
    return [found[step] for step in sorted(found)]


def _train_state(model: nn.Module, ema_model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "ema": get_model_state_dict(ema_model),
            "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_sharded(ckpt_dir: Path, step: int, *, model: nn.Module, ema_model: nn.Module,
                 optimizer: torch.optim.Optimizer, meta: dict[str, Any], is_main: bool, keep: int) -> Path:
    """Every rank writes its shards; rank 0 writes `meta` and renames the directory into place. A collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = sharded_path(ckpt_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # A re-save killed between its two renames left its step's checkpoint only under the aside name, where
        # list_sharded (and so a resume) finds it: put it back under its own name before the leftovers go, or this
        # save would delete that step's only checkpoint before its own is written.
        for aside in list_sharded(ckpt_dir):
            if m := _MOVED_ASIDE.match(aside.name):
                own = sharded_path(ckpt_dir, int(m.group(1)))
                if own.exists():  # incomplete (list_sharded preferred the aside one): it holds nothing to keep
                    shutil.rmtree(own)
                os.replace(aside, own)
                fsync_dir(ckpt_dir)
        # Saves killed midway (this step's or another's) left temp directories: no save is running now, remove them.
        for leftover in ckpt_dir.glob(".ckpt_*.dcp.*"):  # .tmp (a save), .old / .del (a replace or a delete)
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    dcp.save(_train_state(model, ema_model, optimizer), checkpoint_id=str(tmp))
    dist.barrier()  # every rank's shard file is closed before rank 0 seals the directory
    if is_main:
        with open(tmp / META, "wb") as f:
            torch.save({"format": META_FORMAT, **meta}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # the same step written again (a resume at the end): move the old one aside first
            os.replace(final, final.with_name(f".{final.name}.old"))
        os.replace(tmp, final)
        fsync_dir(ckpt_dir)
        shutil.rmtree(final.with_name(f".{final.name}.old"), ignore_errors=True)
        for old in list_sharded(ckpt_dir)[:-keep]:
            try:  # renamed out of the listing first: a delete cut short never leaves a "complete" partial one
                doomed = old.with_name(f".{old.name}.del")
                os.replace(old, doomed)
                shutil.rmtree(doomed)
            except OSError as e:
                warnings.warn(f"could not delete old checkpoint {old}: {e}", stacklevel=2)
    dist.barrier()  # nobody reads the directory (or exits) before it is in place
    return final


def read_meta(path: Path) -> dict[str, Any]:
    """The small rank-0 part of a sharded checkpoint (step, config, RNG states, scaler, world size)."""
    try:
        meta = torch.load(path / META, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"could not load {path / META}: {type(e).__name__}: {e}; resume from an earlier "
                              f"checkpoint in {path.parent}") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise CheckpointError(f"{path} is not a fastddpm sharded checkpoint (its meta.pt has no fastddpm-dcp-1 "
                              f"format): pass a ckpt_<step>.dcp directory written by `fastddpm train --parallel fsdp`")
    return {**meta, "sharded": True}


def latest_sharded(ckpt_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete sharded checkpoint; a half-written one (killed save) is reported (the next save removes
    it)."""
    if ckpt_dir.is_dir():
        for leftover in sorted(ckpt_dir.glob(".ckpt_*.dcp.tmp")):
            warn_on_rank_0(f"ignoring {leftover}: an incomplete sharded checkpoint from an interrupted save (the "
                           "next save removes it)")
    for path in reversed(list_sharded(ckpt_dir)):
        try:
            return path, read_meta(path)
        except CheckpointError as e:
            warn_on_rank_0(f"{e}; falling back to the previous checkpoint")
    return None


def load_sharded(path: Path, *, model: nn.Module, ema_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model, EMA and AdamW shards into already-sharded modules: DCP reads the pieces each rank now owns,
    whatever the world size that wrote them. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _train_state(model, ema_model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:
        raise CheckpointError(f"could not load the sharded checkpoint {path}: {_describe(e)}. If the model changed, "
                              f"start a new run directory; otherwise resume from an earlier checkpoint in "
                              f"{path.parent}") from None
    set_model_state_dict(model, state["model"])
    set_model_state_dict(ema_model, state["ema"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _describe(e: Exception) -> str:
    """DCP wraps each rank's error in a CheckpointException whose message names only the ranks: unwrap them."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(f).__name__}: {str(f).splitlines()[0] if str(f) else ''}"
                         for r, f in sorted(failures.items()))
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def read_sharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint as one process sees a .pt checkpoint: {"model", "ema"} as full CPU tensors (the
    optimizer's shards are not read), plus the metadata (step, config, ...). No process group needed."""
    # The loader behind torch's own dcp_to_torch_save (dcp.load() returns early on an empty state dict).
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    meta = read_meta(path)
    full: dict[str, Any] = {}
    try:
        # An empty state dict filled from the checkpoint's own index, for the two weight sets only.
        _load_state_dict(full, storage_reader=FileSystemReader(str(path)),
                         planner=_EmptyStateDictLoadPlanner(keys={"model", "ema"}), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"could not read the sharded checkpoint {path}: {_describe(e)}. Check that every "
                              f"__<rank>_0.distcp file is there, or use an earlier checkpoint in "
                              f"{path.parent}") from None
    return {**meta, "model": full["model"], "ema": full["ema"]}
