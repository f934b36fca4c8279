"""Where a run's numbers go besides metrics.jsonl (which is always written): TensorBoard (`--log-to tensorboard`).

Rank 0 logs; everything logged is already a host value on the logging steps (the loss read there, the evaluation's
numbers, a grid written to disk), so logging adds no device sync to the steps between. TensorBoard's scalars are
named train/<key> and eval/<key>; a grid is the image `samples` at the step it was drawn; the resolved config is the
text `config` and the hyperparameters of the run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fastddpm.config import ConfigError, RunConfig

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
    to the same folder: TensorBoard shows one curve, continued from the resumed step."""

    def __init__(self, run_dir: Path, cfg: RunConfig, *, enabled: bool = True):
        self.tb = None
        if enabled and "tensorboard" in cfg.train.log_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--log-to tensorboard needs the tensorboard package: pip install tensorboard "
                                  "(or pip install 'fastddpm[tensorboard]'), or drop tensorboard from --log-to") from None
            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
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
        if self.tb is None:
            return
        for key, value in _scalars(record).items():
            self.tb.add_scalar(f"train/{key}", value, global_step=record["step"])
        self.tb.flush()

    def evaluation(self, step: int, record: dict) -> None:
        """An evaluation's numbers (FID, precision, recall, class accuracy, coverage) at x = the step."""
        if self.tb is None:
            return
        for key, value in _scalars(record).items():
            self.tb.add_scalar(f"eval/{key}", value, global_step=step)
        self.tb.flush()

    def grid(self, step: int, path: Path) -> None:
        """A sample grid PNG, as the image `samples` at the step it was drawn."""
        if self.tb is None or path is None or not Path(path).is_file():
            return
        from PIL import Image

        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
        self.tb.add_image("samples", arr, global_step=step, dataformats="HWC")
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
