"""`locate(path)`: whatever a user passes as a checkpoint (a run directory, checkpoints/ckpt_<step>.pt, an FSDP
run's ckpt_<step>.dcp directory, an ema.safetensors export, a diffusers folder) turned into one `Checkpoint`, with one clear error
for each way a path can be wrong. `fastddpm sample`, `eval`, `export`, `--resume` and the Python API all come
through here, so they accept the same paths and fail the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastddpm.config import CLI, ConfigError, Spelling
from fastddpm.rundir import checkpoint, sharded
from fastddpm.rundir.diffusers_folder import HELD, diffusers_meta, diffusers_weights, is_diffusers_folder
from fastddpm.rundir.files import CheckpointError, load_safetensors, read_safetensors_metadata, refuse_dangling_link
from fastddpm.rundir.layout import RunDir

EMA_EXPORT_FORMAT = "fastddpm-ema-1"  # ema.safetensors' "format" metadata
# what a model card or log calls each of Checkpoint.weights' choices
WEIGHTS_LABELS = {"ema": "EMA", "model": "raw (the trained model's own, not its EMA)"}
WHAT_TO_PASS = ("a run directory, a checkpoints/ckpt_*.pt file, an FSDP run's checkpoints/ckpt_*.dcp directory, "
                "an ema.safetensors export (or its folder), or a diffusers DDPMPipeline or UNet2DModel folder")
WHAT_TO_RESUME = ("latest (the newest checkpoint in --out), a run directory, a checkpoints/ckpt_*.pt file, or an FSDP "
                  "run's checkpoints/ckpt_*.dcp directory")


@dataclass
class Checkpoint:
    """What a path holds. `kind`: "pt" (a verified training checkpoint, loaded whole), "dcp" (an FSDP run's sharded
    checkpoint: its small metadata read, the shards on demand), "safetensors" (one weight set, `held`, with the
    config in the metadata) or "diffusers" (a diffusers UNet2DModel or DDPMPipeline folder: one weight set, the
    config built from its config.json and scheduler, no step; rundir.diffusers_folder). `meta`: step, images_seen, config (a dict) and, for "pt" and "dcp", the trainer's
    state; for "pt" also the optimizer's and the loss scaler's (the weights are `weights()`)."""

    path: Path
    kind: str
    meta: dict[str, Any]
    _weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def step(self) -> int | None:
        return None if self.meta.get("step") is None else int(self.meta["step"])

    @property
    def held(self) -> str | None:
        """The one weight set a safetensors file holds: "ema" (an ema.safetensors, or an export of the EMA weights)
        or "model" (`fastddpm export --weights model`, as its metadata records); None where both are held."""
        return self.meta.get("weights", "ema") if self.kind == "safetensors" else HELD if self.kind == "diffusers" \
            else None

    @property
    def held_label(self) -> str:
        return "EMA" if self.held == "ema" else "raw"

    @property
    def images_seen(self) -> int | None:
        return None if self.meta.get("images_seen") is None else int(self.meta["images_seen"])

    @property
    def config(self):
        """The run's RunConfig, as saved with the weights."""
        from fastddpm.config import from_dict

        return from_dict(self.meta["config"])

    @property
    def run_dir(self) -> RunDir:
        return RunDir.of(self.path)

    def info(self) -> dict[str, Any]:
        """File (absolute: a result is read from elsewhere than where it was made), step and images seen: what a
        result names as the weights it came from."""
        return {"file": str(self.path.absolute()), "step": self.step, "images_seen": self.images_seen}

    def weights(self, which: str = "ema") -> dict[str, torch.Tensor]:
        """The EMA ("ema") or raw ("model") weights as a full state dict on the CPU (of a diffusers folder: its
        UNet2DModel's, under diffusers' names, which sampling.load_for_sampling renames)."""
        if which not in ("ema", "model"):
            raise ValueError(f"weights: {which!r} is not ema or model")
        if self.held not in (None, which) and self.kind == "diffusers":
            raise CheckpointError(f"{self.path} is a diffusers folder, which holds one weight set (served as the EMA "
                                  "weights): leave out --weights model")
        if self.held not in (None, which):
            raise CheckpointError(f"{self.path} holds only the {self.held_label} weights; use --weights {self.held} "
                                  f"or pass a checkpoints/ckpt_*.pt file")
        if which not in self._weights:
            if self.kind == "safetensors":
                self._weights[which] = load_safetensors(self.path)[0]
            elif self.kind == "diffusers":
                self._weights[which] = diffusers_weights(self.meta)
            elif self.kind == "dcp":  # both weight sets are gathered in one read
                full = sharded.read_sharded_checkpoint(self.path)
                self._weights.update(ema=full["ema"], model=full["model"])
        return self._weights[which]

    def check_resumable(self, *, sharded_run: bool) -> None:
        """A run resumes the format it writes: a sharded checkpoint under FSDP, a .pt file otherwise."""
        if self.kind == "diffusers":
            raise CheckpointError(f"{self.path} is a diffusers folder: its weights, without an optimizer or a "
                                  "trainer's state, start a new run with --init-from, not a resume")
        if self.kind == "safetensors":
            raise CheckpointError(f"{self.path} holds only the {self.held_label} weights, not the optimizer and the "
                                  f"trainer's state: resume from a checkpoints/ckpt_*.pt file or the run directory")
        if sharded_run and self.kind != "dcp":
            raise CheckpointError(
                f"{self.path} is a .pt checkpoint of a single-process or DDP run, and --parallel fsdp reads sharded "
                "checkpoints: resume it with --parallel ddp, or start the FSDP run in a new directory")
        if not sharded_run and self.kind == "dcp":
            raise CheckpointError(
                f"{self.path} is a sharded checkpoint of an FSDP run: resume it under torchrun with --parallel fsdp "
                "(any number of processes, 1 included), or sample from the run's ema.safetensors")


def _pt(path: Path, state: dict[str, Any]) -> Checkpoint:
    meta = {k: v for k, v in state.items() if k not in ("model", "ema")}
    return Checkpoint(path, "pt", meta, {"model": state["model"], "ema": state["ema"]})


def newest(ckpt_dir: Path) -> Checkpoint | None:
    """The newest usable checkpoint in `ckpt_dir`: a verified .pt file, or an FSDP run's complete .dcp directory
    (broken newer ones are skipped with a warning naming them); None when there is none."""
    found = [f for f in (checkpoint.load_latest(ckpt_dir), sharded.latest_sharded(ckpt_dir)) if f is not None]
    if not found:
        return None
    path, state = max(found, key=lambda f: int(f[1]["step"]))
    return Checkpoint(path, "dcp", state) if state.get("sharded") else _pt(path, state)


def saved(ckpt_dir: Path) -> list[Path]:
    """Every complete checkpoint in `ckpt_dir`, .pt files and .dcp directories, oldest first."""
    return sorted(checkpoint.list_checkpoints(ckpt_dir) + sharded.list_sharded(ckpt_dir), key=checkpoint.step_of)


def locate(path: str | Path, *, weights: str = "ema", what: str | None = None) -> Checkpoint:
    """The Checkpoint at `path`: a run directory (its newest checkpoint; an FSDP run's ema.safetensors when the EMA
    `weights` are all that is needed, which is the cheap read; a run without checkpoints, its ema.safetensors; a
    safetensors export's folder, its model.safetensors), a .pt file, a .dcp directory or a .safetensors file.
    CheckpointError naming the path and the fix otherwise; `what` names where the path came from in that message
    (e.g. "--checkpoint", "fastddpm.load")."""
    path = Path(path)
    named = f"{what} {path}" if what else str(path)
    if not path.exists():
        raise CheckpointError(f"{named} does not exist. Pass {WHAT_TO_PASS}")
    if path.is_dir() and path.suffix != ".dcp":
        run = RunDir.of(path)
        found = newest(run.checkpoints)
        if found is not None and not (found.kind == "dcp" and weights == "ema" and run.ema.is_file()):
            return found
        exported = path / "model.safetensors"  # a `fastddpm export --format safetensors` folder
        if run.ema.is_file():
            path = run.ema
        elif exported.is_file():
            path = exported
        elif saved(run.checkpoints):  # every one is broken: saying "no checkpoint" would contradict the folder
            broken = saved(run.checkpoints)
            raise CheckpointError(
                f"{named}: none of its {len(broken)} checkpoint(s) loads ({'..., ' if len(broken) > 3 else ''}"
                f"{', '.join(p.name for p in broken[-3:])}: the warnings above say why) and it has no ema.safetensors. "
                "Restore a checkpoint (each .pt has its .sha256 beside it), or train again")
        else:
            other = next((p.name for p in (path / "model.onnx", path / "model.pt2") if p.exists()), None)
            hint = (f" It holds an export ({other}), which other runtimes load; fastddpm loads the run it came from "
                    "(export.json names its checkpoint) or a --format safetensors export." if other else "")
            if not other and is_diffusers_folder(path):
                return Checkpoint(path, "diffusers", diffusers_meta(path, what or "checkpoint"))
            if not other and (path / "unet").is_dir():  # said as "an export (unet)", a folder name, without its uses
                hint = (" It looks like a diffusers folder (unet/), but unet/config.json is missing or not a "
                        "UNet2DModel's, which fastddpm reads (as diffusers' DDPMPipeline.from_pretrained does).")
            raise CheckpointError(f"{named} holds no checkpoint and no ema.safetensors.{hint} Pass {WHAT_TO_PASS}")
    if path.is_dir():
        return Checkpoint(path, "dcp", sharded.read_meta(path))
    if path.suffix.lower() in (".onnx", ".pt2"):  # not a checkpoint, corrupted or not: an export's model
        raise CheckpointError(f"{named} is an export ({path.suffix.lstrip('.').upper()}), which other runtimes "
                              f"load; fastddpm loads the run it came from (export.json beside it names its "
                              f"checkpoint) or a --format safetensors export. Pass {WHAT_TO_PASS}")
    if path.suffix == ".safetensors":
        return _safetensors(path)
    return _pt(path, checkpoint.load_checkpoint(path))


def _safetensors(path: Path) -> Checkpoint:
    raw = read_safetensors_metadata(path)
    if "config" not in raw:
        raise CheckpointError(f"{path} has no fastddpm config in its metadata; it was not written by fastddpm. "
                              f"Pass {WHAT_TO_PASS}")
    try:
        meta = {k: json.loads(v) for k, v in raw.items() if k in ("config", "step", "images_seen")}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: its metadata is not fastddpm's ({e}); pass {WHAT_TO_PASS}") from None
    if raw.get("weights", "ema") not in WEIGHTS_LABELS:
        raise CheckpointError(f"{path}: its metadata names weights {raw['weights']!r}, neither ema nor model; it was "
                              f"not written by this fastddpm. Pass {WHAT_TO_PASS}")
    meta["weights"] = raw.get("weights", "ema")  # what fastddpm export --weights wrote (an ema.safetensors: EMA)
    return Checkpoint(path, "safetensors", meta)


def find_resume(run_dir: str | Path, resume: str | Path | Checkpoint | None, *,
                said: Spelling = CLI) -> Checkpoint | None:
    """What `--resume` means for a run in `run_dir`: None (a new run); "latest" (the newest checkpoint that
    verifies, None if there is none yet); a Checkpoint, as it is; or a path (a run directory: its newest). Errors
    spell the arguments as `said` does (the command's flags, or fastddpm.train's parameters)."""
    # Checked here, where `train` and fastddpm.train first look at --out: the run's mkdir would otherwise end in a
    # FileExistsError or NotADirectoryError traceback.
    run_dir = Path(run_dir)
    out = said("out", str(run_dir))
    in_the_way = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if in_the_way is not None and not in_the_way.is_dir():
        raise ConfigError(f"{out}: {in_the_way} is a file, and a run directory is a folder: pass a new "
                          f"folder (or a run directory, to continue its run) as {said('out')}")
    refuse_dangling_link(run_dir, flag=said("out"), fix="pass a new folder (or a run directory, to continue its run) "
                                                        f"as {said('out')}")
    if resume is None or isinstance(resume, Checkpoint):
        return resume
    if str(resume) == "latest":
        return newest(RunDir(Path(run_dir)).checkpoints)
    path = Path(resume)
    what = said("resume", str(path))
    if not path.exists():
        raise CheckpointError(f"{what} does not exist. Pass {WHAT_TO_RESUME.replace('--out', said('out'))}")
    if path.is_dir() and path.suffix != ".dcp":
        searched = RunDir.of(path).checkpoints
        found = newest(searched)
        if found is None and is_diffusers_folder(path):
            raise CheckpointError(f"{what} is a diffusers folder: its weights, without an optimizer or a trainer's "
                                  f"state, start a new run with {said('init-from')}, not a resume")
        if found is None:
            raise CheckpointError(f"{what}: no usable checkpoint in {searched}: start without {said('resume')}, or "
                                  f"pass a checkpoints/ckpt_*.pt file of another run")
        return found
    return locate(path, what=said("resume"))
