"""Two ways to diagnose a loop nobody edited:

- `run_script`: run a user's script (as `python script.py args`) with two hooks placed from outside:
  DataLoader iteration is timed (a wait for data) and each `optimizer.step()` of the first optimizer that
  steps is a step boundary (torch.optim's global post-hook). When the bounded run is over, DoctorDone ends
  the script.
- `run_trainer`: fastddpm's own trainer for a bounded number of steps, through TrainHooks (the batch source
  is timed, each step is a boundary), no checkpoints or grids on the way.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import sys
import weakref
from pathlib import Path

import torch

from fastddpm.doctor.api import diagnose
from fastddpm.doctor.report import Report
from fastddpm.doctor.session import DoctorConfig, DoctorDone, DoctorError, Session
from fastddpm.doctor.watchers import AttentionWatch, batch_size, optimizer_info


class _TimedIterator:
    """A DataLoader iterator whose every `next` is timed as a wait for data."""

    def __init__(self, it, session: Session, hooks: "ScriptHooks"):
        self._it = it
        self._session = session
        self._hooks = hooks

    def __iter__(self):
        return self

    def __next__(self):
        batch = self._session.wait_for_data(lambda: next(self._it))
        if self._hooks.batch_size is None:
            self._hooks.batch_size = batch_size(batch)
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


class ScriptHooks:
    """Install/remove the DataLoader and optimizer hooks for one session."""

    def __init__(self, session: Session):
        self.session = session
        self._orig_iter = None
        self._handle = None
        self._optimizer = None  # weakref to the optimizer whose steps are the step boundaries
        self._train_loader = None  # weakref to the first DataLoader iterated: its new iterators are epochs
        self.optimizer_steps = 0
        self.batches_fetched = 0
        self.batch_size: int | None = None  # of the training loader's first batch
        self.optimizer_info = None
        self.attention = AttentionWatch(lambda: session.phase == "watch")

    def __enter__(self):
        from torch.utils.data import DataLoader

        hooks, session = self, self.session
        orig = DataLoader.__iter__
        self._orig_iter = orig

        def timed_iter(loader):
            if hooks._train_loader is None:
                hooks._train_loader = weakref.ref(loader)
                session.loader = loader
            if hooks._train_loader() is loader:
                it = session.new_iterator(lambda: orig(loader))
                return _TimedIterator(it, session, hooks)
            return _TimedIterator(session.wait_for_data(lambda: orig(loader)), session, _NoBatchSize())

        DataLoader.__iter__ = timed_iter

        def after_optimizer_step(optimizer, args, kwargs):
            if hooks._optimizer is None:
                hooks._optimizer = weakref.ref(optimizer)
                hooks.optimizer_info = optimizer_info(optimizer)
            if hooks._optimizer() is not optimizer:
                return
            hooks.optimizer_steps += 1
            session.step()
            if session.done:
                raise DoctorDone()

        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(after_optimizer_step)
        self.attention.__enter__()
        return self

    def __exit__(self, *exc):
        from torch.utils.data import DataLoader

        DataLoader.__iter__ = self._orig_iter
        self._handle.remove()
        self.attention.__exit__()
        return False

    def seen(self) -> dict:
        """What the hooks saw, as Measurements fields (diagnose's `seen`)."""
        return {"batch_size": self.batch_size, "optimizer": self.optimizer_info,
                "attention_calls": self.attention.measured(len(self.session.records))}


class _NoBatchSize:
    """An iterator over another loader (validation): its batches do not set the training batch size."""

    batch_size = 0


def run_script(script: str | Path, args: list[str], config: DoctorConfig, *,
               device: torch.device | str | None = None) -> Report:
    """Run `script` with `args` under the doctor; returns the Report (and writes it under config.out_dir)."""
    path = Path(script)
    if not path.is_file():
        raise DoctorError(f"doctor run: no script at {path}; give the path of the .py file that trains")
    session = Session(config, device=device)
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    hooks = ScriptHooks(session)
    ended = "the script returned"
    try:
        with hooks:
            runpy.run_path(str(path), run_name="__main__")
    except DoctorDone:
        ended = None
    except SystemExit as e:
        if e.code not in (None, 0):
            raise DoctorError(f"doctor run: {path} exited with status {e.code} after {session.step_index} steps; "
                              f"run it without the doctor first to see why") from e
        ended = f"the script exited with status {e.code or 0}"
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    if hooks.optimizer_steps == 0:
        raise DoctorError(
            f"doctor run: {path} never called optimizer.step() on a torch.optim optimizer, so the doctor found no "
            f"step boundaries. Mark them yourself with fastddpm.doctor.watch(loader) and dr.step() in the script")
    if ended is not None:
        session.finish_early(ended)
    return diagnose(session, context="user", command=["fastddpm", "doctor", "run", str(path), *args],
                    seen=hooks.seen())


class _TimedBatches:
    """fastddpm's batch source with each `get` timed; a new epoch starts when m wraps around."""

    def __init__(self, inner, session: Session):
        self._inner = inner
        self._session = session

    def get(self, m: int):
        if m % self._inner.steps_per_epoch == 0:  # the first call opens epoch 0 (not a boundary)
            self._session.mark_epoch()
        return self._session.wait_for_data(lambda: self._inner.get(m))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _step_done(session: Session) -> bool:
    """A step boundary; True once the doctor's windows are over (the trainer then stops)."""
    session.step()
    return session.done


def run_trainer(cfg, config: DoctorConfig, *, log=print) -> Report:
    """fastddpm's trainer for config.total_steps steps under the doctor. `cfg` is a RunConfig."""
    from fastddpm.config import from_dict
    from fastddpm.device import resolve_device
    from fastddpm.measure import count_step_flops
    from fastddpm.models import build_unet
    from fastddpm.rundir.layout import RunDir
    from fastddpm.trainer.loop import train
    from fastddpm.trainer.setup import TrainHooks

    out = Path(config.out_dir) if config.out_dir else None
    if out is None:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="fastddpm-doctor-"))
        config = dataclasses.replace(config, out_dir=out)
    t = dataclasses.replace(cfg.train, max_steps=config.total_steps, max_images=None, max_epochs=None,
                            checkpoint_every=None, sample_every_images=None, progress=False,
                            log_every=max(config.total_steps, 1))
    cfg = dataclasses.replace(cfg, train=t)
    device, _ = resolve_device(t.device)
    session = Session(config, device=device)
    run_dir = out / "run"
    hooks = TrainHooks(wrap_batches=lambda b: _TimedBatches(b, session), after_step=lambda step: _step_done(session),
                       final_outputs=False)
    train(cfg, out_dir=run_dir, hooks=hooks, log=log)
    resolved = from_dict(json.loads(RunDir(run_dir).config.read_text()))
    m = resolved.model
    flops = count_step_flops(build_unet(m), (resolved.train.batch_size, m.image_channels, m.image_size, m.image_size),
                             accum_steps=resolved.train.accum_steps)
    precision = json.loads(RunDir(run_dir).info.read_text())["precision"]  # what autocast ran the matmuls in
    return diagnose(session, context="fastddpm", flops_per_step=flops, command=sys.argv, matmul_dtype=precision,
                    seen={"batch_size": resolved.train.batch_size})
