"""Where a run's numbers go besides metrics.jsonl (which is always written): TensorBoard and Weights & Biases
(`--log-to tensorboard,wandb`).

Rank 0 logs; everything logged is already a host value on the logging steps (the loss read there, the evaluation's
numbers, a grid written to disk), so logging adds no device sync to the steps between. Scalars are named
train/<key> and eval/<key> at x = the step; a grid is the image `samples` at the step it was drawn; the resolved
config is TensorBoard's text `config` and hyperparameters, and W&B's run config. W&B also gets ema.safetensors as a
model artifact when the run ends, runs offline with WANDB_MODE=offline, and a resumed run continues the same W&B
run (its id is kept in RUN_DIR/wandb_run_id), unless it resumes from before its newest checkpoint: W&B keeps a
run's first value of a step, so the new branch gets a W&B run of its own (a run killed after its last checkpoint
continues its W&B run: the steps it logged again are equal, exact resume, and W&B drops them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fastddpm.config import ConfigError, RunConfig
from fastddpm.rundir.layout import RunDir

# the package each logger needs, and how it is said when missing
_NEEDS = {
    "tensorboard": ("tensorboard", "--log-to tensorboard needs the tensorboard package: pip install tensorboard (or "
                                   "pip install 'fastddpm[tensorboard]'), or drop tensorboard from --log-to"),
    "wandb": ("wandb", "--log-to wandb needs the wandb package: pip install wandb (or pip install "
                       "'fastddpm[wandb]'; WANDB_MODE=offline logs without an account), or drop wandb from "
                       "--log-to"),
}


def check_loggers(cfg: RunConfig, run_dir: Path | None) -> None:
    """What --log-to needs, checked on every rank before the run's set-up: rank 0 opens the loggers after the
    data, the model and the compile, and under torchrun a refusal there ended the other ranks in their next
    collective. A missing package, and a file where the logger's folder goes, are refused by name."""
    import importlib.util

    for name in cfg.train.log_to:
        if name in _NEEDS and importlib.util.find_spec(_NEEDS[name][0]) is None:
            raise ConfigError(_NEEDS[name][1])
    if run_dir is None:
        return
    folders = {"tensorboard": RunDir(run_dir).tensorboard, "wandb": Path(run_dir) / "wandb"}
    for name in cfg.train.log_to:
        folder = folders.get(name)
        if folder is not None and folder.is_symlink() and not folder.exists():
            # a link to nothing is no file: said as a file, the user looks for a file that is not there
            import os

            raise ConfigError(f"--log-to {name} writes into the folder {folder}, which is a link to nothing here (its "
                              f"target {os.readlink(folder)} does not exist): create the target folder, remove the "
                              f"link, or drop {name} from --log-to")
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ConfigError(f"--log-to {name} writes into the folder {folder}, which is a file here: move or "
                              f"delete that file, or drop {name} from --log-to")


# metrics.jsonl keys that are not measurements of the step
_NOT_SCALARS = {"step", "event", "images_seen"}


def _scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key in _NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class RunLoggers:
    """The run's extra loggers (TensorBoard), each opened in RUN_DIR and closed with the run. A resumed run appends
    to the same folder: TensorBoard shows one curve, continued from the resumed step (`resumed_step`; None: a new
    run)."""

    def __init__(self, run_dir: Path, cfg: RunConfig, *, enabled: bool = True, resumed_step: int | None = None,
                 branched: bool = False):
        """`branched`: the resume leaves a branch of steps after `resumed_step` (its later checkpoints set aside),
        whose values the loggers hold."""
        self.tb = None
        self.wandb = None
        self.run_dir = Path(run_dir)
        if enabled and "wandb" in cfg.train.log_to:
            import os

            self._wandb_service = os.environ.get("WANDB_SERVICE")  # a caller's own W&B service, left running
            self.wandb, continued = _open_wandb(self.run_dir, cfg, resuming=resumed_step is not None,
                                                branch_at=resumed_step if branched else None)
            if resumed_step is not None and not continued:
                # a W&B run of the resume's own (a branch; or the first W&B run of a run that logged none before):
                # it gets the history up to the resumed step, as metrics.jsonl holds it. TensorBoard opens below,
                # so these records reach W&B alone (TensorBoard's files hold them already)
                from fastddpm.rundir.metrics import read_metrics

                metrics = RunDir(run_dir).metrics
                for record in read_metrics(metrics) if metrics.is_file() else []:
                    self.record(record)
        if enabled and "tensorboard" in cfg.train.log_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(_NEEDS["tensorboard"][1]) from None
            # A resume trains the steps after its checkpoint again: what an abandoned branch (a resume from an
            # earlier checkpoint) or a crashed run (logging past its last checkpoint) wrote from there on is
            # hidden, as metrics.jsonl sets those records aside, so that each step has one value. A new run hides
            # everything before it: the folder can only hold a run that wrote no checkpoint (a new run is refused
            # where checkpoints are), whose steps 1, 2, ... would otherwise interleave with this run's.
            purge_step = 0 if resumed_step is None else resumed_step + 1
            self.tb = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard), purge_step=purge_step)
            self.tb.add_text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2) + "\n```", global_step=0)

    def hparams(self, cfg: RunConfig, info: dict) -> None:
        """The resolved config as hyperparameters (flattened section.field; lists as text), once at the start."""
        if self.tb is None:
            return
        flat = {}
        for section, fields in cfg.to_dict().items():
            if isinstance(fields, dict):
                for name, value in fields.items():
                    flat[f"{section}.{name}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
        flat.update({"run.parameters": info.get("parameters", 0), "run.precision": str(info.get("precision"))})
        from torch.utils.tensorboard.summary import hparams

        for event in hparams(flat, {"train/loss": float("nan")}):
            self.tb.file_writer.add_summary(event)

    def record(self, record: dict) -> None:
        """A metrics.jsonl record, routed by its kind: an evaluation's, or a logging step's."""
        if record.get("event") == "eval":
            self.evaluation(record["step"], record)
        elif "step" in record:
            self.train(record)

    def train(self, record: dict) -> None:
        """A metrics.jsonl line of a logging step, at x = its step."""
        self._scalars("train", record["step"], record)

    def evaluation(self, step: int, record: dict) -> None:
        """An evaluation's numbers (FID, precision, recall, class accuracy, coverage) at x = the step."""
        self._scalars("eval", step, record)

    def _scalars(self, prefix: str, step: int, record: dict) -> None:
        values = {f"{prefix}/{k}": v for k, v in _scalars(record).items()}
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, global_step=step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def grid(self, step: int, path: Path) -> None:
        """A sample grid PNG, as the image `samples` at the step it was drawn."""
        if path is None or not Path(path).is_file():
            return
        if self.tb is not None:
            from PIL import Image

            with Image.open(path) as im:
                arr = np.asarray(im.convert("RGB"))
            self.tb.add_image("samples", arr, global_step=step, dataformats="HWC")
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({"samples": wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            import wandb

            ema = RunDir(self.run_dir).ema
            if ema.is_file():  # the weights to sample from, versioned with the run
                artifact = wandb.Artifact(f"{self.run_dir.name}-ema", type="model",
                                          description="EMA weights (safetensors; the config is in its metadata)")
                artifact.add_file(str(ema))
                self.wandb.log_artifact(artifact)
            self.wandb.finish()
            self.wandb = None
            if self._wandb_service is None:  # the W&B service process this run started: ended with it
                wandb.teardown()


def _open_wandb(run_dir: Path, cfg: RunConfig, *, resuming: bool, branch_at: int | None = None) -> tuple:
    """A W&B run in RUN_DIR/wandb: the project from WANDB_PROJECT (default fastddpm), named after the run folder;
    the same W&B run again when the fastddpm run is resumed (the id is in RUN_DIR/wandb_run_id). A new run gets a
    new id even where the file is left by an earlier run that wrote no checkpoint: W&B drops the steps of a resumed
    W&B run up to its last logged one, so continuing that run would lose this one's history up to there. For the
    same reason a resume that leaves a branch (`branch_at`: the step it resumes from, before the newest
    checkpoint) gets a new id, its notes naming the W&B run it branches from. Returns (the W&B run, whether it
    continues the fastddpm run's W&B run)."""
    import os
    import secrets
    import string

    try:
        import wandb
    except ImportError:
        raise ConfigError(_NEEDS["wandb"][1]) from None
    id_file = RunDir(run_dir).wandb_run_id
    before = id_file.read_text().strip() if resuming and id_file.is_file() else None
    run_id = before if branch_at is None and before else "".join(
        secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's own id alphabet
    notes = (f"resumed at step {branch_at:,} from W&B run {before}, whose records of later steps belong to the "
             "branch this run leaves" if branch_at is not None and before else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id + "\n")
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "fastddpm"), dir=str(run_dir), name=run_dir.name,
                          id=run_id, resume="allow", config=cfg.to_dict(), notes=notes,
                          settings=wandb.Settings(silent=True)), run_id == before
    except wandb.errors.Error as e:  # no API key, no network, a project it may not write: before any step
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--log-to wandb: W&B could not start a run ({first}): run `wandb login` (or set "
                          "WANDB_API_KEY), set WANDB_MODE=offline to log without an account (wandb sync uploads "
                          "later), or drop wandb from --log-to") from None
