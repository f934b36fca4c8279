"""The trainer's own state: the counters and the random state a resumed run must continue from exactly.

Everything the loop changes as it runs lives here or in a state_dict() object the Checkpointer saves beside it
(model, EMA, optimizer, scaler). The batch of step k is a function of (seed, k) (fastddpm.rng), so the counters
and the global RNG (dropout) are all the loop itself needs to resume bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """step and images_seen: where the run is. micro_split: each batch cut into this many micro-batches after an
    out-of-memory step (the same data and result, a slower step), kept across a resume. world_size,
    global_batch and cpu_threads: what this run computes with, saved so that a resume under others can say what
    stops being bit-exact (`resume_notes`). data: the dataset's identity (PreparedData.identity, with its source),
    saved so that a resume on other data is refused (trainer.setup). ema_off_grid: the step of the run's last EMA
    update off the --ema-every grid (the last step of a run that ended there), so that a run resumed longer folds
    the steps after it, not those before, into its next update (trainer.ema.ema_steps)."""

    device: torch.device
    world_size: int
    global_batch: int  # images per optimizer step, over all ranks and micro-batches
    cpu_threads: int | None  # intra-op threads of a CPU run (None on a GPU)
    step: int = 0
    images_seen: int = 0
    micro_split: int = 1
    train_s: float = 0.0  # training wall time up to `step`, evaluations excluded, over every process of the run
    data: dict[str, Any] | None = None
    ema_off_grid: int | None = None
    saved_by: dict[str, Any] = field(default_factory=dict)  # the loaded checkpoint's world and threads

    def advance(self) -> None:
        self.step += 1
        self.images_seen += self.global_batch

    def state_dict(self) -> dict[str, Any]:
        cuda = self.device.type == "cuda"
        return {"step": self.step, "images_seen": self.images_seen, "world_size": self.world_size,
                "global_batch": self.global_batch, "micro_split": self.micro_split, "cpu_threads": self.cpu_threads,
                "train_s": self.train_s, "data": self.data, "ema_off_grid": self.ema_off_grid,
                "rng": {"torch_cpu": torch.get_rng_state(),
                        "torch_cuda": torch.cuda.get_rng_state(self.device) if cuda else None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The counters and the global RNG of a checkpoint (any extra keys, the weights', are ignored)."""
        self.step, self.images_seen = int(state["step"]), int(state["images_seen"])
        self.micro_split = int(state.get("micro_split", 1))
        self.train_s = float(state.get("train_s", 0.0))  # 0 from a checkpoint written before it was saved
        self.ema_off_grid = state.get("ema_off_grid")  # None before: those runs updated on the grid only
        torch.set_rng_state(state["rng"]["torch_cpu"])
        if self.device.type == "cuda" and state["rng"].get("torch_cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["torch_cuda"], self.device)
        self.saved_by = {"world_size": int(state.get("world_size", 1)), "global_batch": state.get("global_batch"),
                         "cpu_threads": state.get("cpu_threads")}

    def resume_notes(self, batch_fixed: str) -> list[str]:
        """What cannot stay bit-exact after a resume under another CPU thread count or world size. `batch_fixed`:
        "global" when --global-batch-size holds the global batch fixed, else the per-device batch is."""
        notes = []
        threads = self.saved_by.get("cpu_threads")
        if self.cpu_threads is not None and threads is not None and threads != self.cpu_threads:
            notes.append(f"note: the checkpoint was written with {threads} CPU thread(s), this run has "
                         f"{self.cpu_threads}: CPU sums run in another order, so from here the run matches an "
                         f"uninterrupted one to float rounding, not bit for bit (--cpu-threads {threads} for an "
                         f"exact resume)")
        world = self.saved_by.get("world_size", self.world_size)
        if world != self.world_size:
            notes.append(
                f"note: the checkpoint was written by {world} rank{'s' if world > 1 else ''}, this run has "
                f"{self.world_size}: the global batch is {self.global_batch} (was {self.saved_by.get('global_batch')}; "
                + ("kept, --global-batch-size is fixed" if batch_fixed == "global" else
                   "per-device batch fixed; set --global-batch-size to keep the global one")
                + "), and the data order from here differs from an uninterrupted run")
        elif self.saved_by.get("global_batch") not in (None, self.global_batch):
            notes.append(f"note: the checkpoint was written with a global batch of {self.saved_by['global_batch']}, "
                         f"this run has {self.global_batch} (another --batch-size or --accum-steps): the data order "
                         "and the steps per epoch from here differ from an uninterrupted run")
        return notes
