"""Where each file of a run lives, in one place (README, "Run directory")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    """A run directory: `fastddpm train --out RUN_DIR` writes it, the other commands read it."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, path: str | Path) -> RunDir:
        """The run a path belongs to: a run directory itself, the run of its checkpoints/ folder or of a
        checkpoints/ckpt_* file or .dcp folder (one a resume set aside in checkpoints/abandoned-after-*/ too), or the
        folder that holds any other file (an ema.safetensors copied elsewhere)."""
        path = Path(path)
        if path.is_dir() and path.suffix != ".dcp":
            return cls(path.parent if path.name == "checkpoints" else path)
        folder = path.parent
        if folder.name.startswith("abandoned-after-") and folder.parent.name == "checkpoints":
            folder = folder.parent  # sample's, eval's and export's output belong in the run, not beside the file
        return cls(folder.parent if folder.name == "checkpoints" else folder)

    @property
    def config(self) -> Path:  # the resolved config
        return self.path / "config.json"

    @property
    def info(self) -> Path:  # run.json: device, precision and every automatic choice, with its reason
        return self.path / "run.json"

    @property
    def metrics(self) -> Path:  # one JSON record per logging step (and per evaluation)
        return self.path / "metrics.jsonl"

    @property
    def eval_log(self) -> Path:  # --eval-every: each evaluation in full
        return self.path / "eval.jsonl"

    @property
    def loss_chart(self) -> Path:  # the loss against images seen, redrawn with each grid
        return self.path / "loss.png"

    @property
    def eval_chart(self) -> Path:  # --eval-every: FID against wall time and images seen
        return self.path / "eval_curve.png"

    @property
    def ema(self) -> Path:  # the EMA weights with the config in the metadata, for sampling anywhere
        return self.path / "ema.safetensors"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:  # --log-to tensorboard: the event files
        return self.path / "tensorboard"

    @property
    def wandb_run_id(self) -> Path:  # --log-to wandb: the W&B run a resumed run continues (its files: wandb/)
        return self.path / "wandb_run_id"

    def export(self, fmt: str) -> Path:  # `fastddpm export --format FMT`'s default output
        return self.path / f"export-{fmt}"

    @property
    def samples(self) -> Path:  # sample grids, and `fastddpm sample`'s default output
        return self.path / "samples"

    @property
    def eval_dir(self) -> Path:  # `fastddpm eval`'s default output
        return self.path / "eval"

    @property
    def eval_elsewhere(self) -> Path:  # `fastddpm eval --out DIR`: a line per result written there, for export's card
        return self.eval_dir / "results_elsewhere.jsonl"
