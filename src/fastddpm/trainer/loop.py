"""The training loop, top to bottom: `prepare_run` (fastddpm.trainer.setup) settles the run, then while {batch,
lr, step, count, log, sample, evaluate, checkpoint, stop?}.

Progress is counted in steps and images seen (TrainState). Every step's data order, timesteps and noise are
functions of (seed, step) (fastddpm.rng), and all mutable state is in state_dict() objects that each checkpoint
saves, so a resumed run reproduces the uninterrupted one exactly. Host syncs are deliberate and labelled: the
loss is read on logging steps; the health check (NaN/Inf, the fp16 loss scale) reads the device on logging steps
on a GPU and every step on a CPU, where a read costs nothing; under torchrun the ranks agree on a stop signal
with one collective at the same points; a foreach (CPU or FSDP) update checks the step's finiteness on the host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

import torch

from fastddpm.config import CLI, ConfigError, RunConfig, Spelling
from fastddpm.pipes import EXIT_READER_GONE, ReaderGone, ReaderWatch
from fastddpm.progress import progress_bar
from fastddpm.rundir.files import rank_0_by_env
from fastddpm.rundir.locate import Checkpoint
from fastddpm.rundir.metrics import MetricsLog, read_metrics
from fastddpm.sampling import write_grid
from fastddpm.trainer.batch_finder import is_oom
from fastddpm.trainer.compile_counters import CompileCounters
from fastddpm.trainer.ema import ema_steps as fold_ema_steps
from fastddpm.distributed import SINGLE, any_rank, barrier, mean_across_ranks, shutdown
from fastddpm.trainer.loggers import RunLoggers
from fastddpm.trainer.setup import Run, TrainHooks, prepare_run
from fastddpm.trainer.step import CudaGraphCaptureError

EXIT_SIGTERM, EXIT_SIGINT = 143, 130


class TrainingInterrupted(Exception):
    """Raised after a SIGTERM/SIGINT (or the reader of stdout or stderr leaving) once the checkpoint is written;
    `exit_code` is 143, 130 (or 141). `checkpoint` is None where the stop came in the set-up, before the first
    step: nothing was trained, nothing written."""

    def __init__(self, exit_code: int, checkpoint: Path | None):
        cause = _cause(exit_code)
        super().__init__(f"stopped by {cause}; checkpoint {checkpoint}" if checkpoint is not None else
                         f"stopped by {cause} during the set-up, before the first step: nothing was saved")
        self.exit_code = exit_code
        self.checkpoint = checkpoint


class ReaderLeft(TrainingInterrupted, ReaderGone):
    """The stop of a run whose reader of stdout or stderr left (exit 141): a BrokenPipeError too, so a command that
    lets the trainer's stop through (`fastddpm doctor train | head`) ends as any command whose reader left does, in
    fastddpm.cli.main, not in a traceback."""


def _interrupted(exit_code: int, checkpoint: Path | None) -> TrainingInterrupted:
    return (ReaderLeft if exit_code == EXIT_READER_GONE else TrainingInterrupted)(exit_code, checkpoint)


def _cause(exit_code: int | None) -> str:
    return "the closed pipe its output went to" if exit_code == EXIT_READER_GONE else "signal"


class _StoppedAtOnce(BaseException):
    """Raised by the signal handler (or the print that finds the reader gone) inside `_StopFlag.at_once` (a
    BaseException, as KeyboardInterrupt is: an `except Exception` in the set-up must not swallow it)."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    images_seen: int
    last_loss: float | None
    checkpoint: Path | None
    grid: Path | None


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop finishes the current step, checkpoints and exits (143 / 130).
    A second SIGINT falls through to Python's default (KeyboardInterrupt) for an impatient user. The reader of
    stdout or stderr leaving (`fastddpm train | head`) stops the run as SIGTERM does, exit 141: a write into the
    closed pipe, or the poll at each step's end (`readers`), finds it."""

    def __init__(self):
        self.exit_code: int | None = None
        self._old = {}
        self.dist = SINGLE  # set once the process group is up; train() tears it down
        self._at_once: str | None = None  # the set-up a signal now stops there and then (at_once)
        self.folder_lock = None  # the run folder's RunFolderLock, set once the folder exists; train() lets it go
        self.readers = ReaderWatch(self._reader_left)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig, code in ((signal.SIGTERM, EXIT_SIGTERM), (signal.SIGINT, EXIT_SIGINT)):
                self._old[sig] = signal.signal(sig, self._handler(code))
        self.readers.__enter__()
        return self

    def _reader_left(self, stream: str) -> None:
        """The reader of `stream` left: stop as a SIGTERM stops; in a set-up that stops at once, there and then
        (raised from the print that found it, in the main thread, where a signal's handler would raise)."""
        if self.exit_code is None:
            self.exit_code = EXIT_READER_GONE
            if self._at_once is not None and threading.current_thread() is threading.main_thread():
                raise _StoppedAtOnce

    def _handler(self, code):
        def handle(signum, frame):
            if self.exit_code is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            first = self.exit_code is None
            self.exit_code = code
            if first and self._at_once is not None:
                raise _StoppedAtOnce
            if first and rank_0_by_env():
                # said at once: the first step (the model's compilation, a CUDA graph's capture) can take
                # minutes, where a Ctrl-C that seemed lost would be pressed again. os.write: the handler may run
                # while the main thread is inside a print to the same stream
                again = " (Ctrl-C again to stop at once, without one)" if signum == signal.SIGINT else ""
                with contextlib.suppress(OSError):  # stderr's reader gone: the run stops all the same
                    os.write(2, f"{signal.Signals(signum).name}: the run stops after its current step, with a "
                                f"checkpoint{again}\n".encode())
        return handle

    @contextlib.contextmanager
    def at_once(self, what: str, log: Callable[[str], None]):
        """While `what` runs, a signal stops the run there and then (TrainingInterrupted, no checkpoint), not after
        a first step: for the set-up that can take minutes (a dataset cache to build, a feature network to train)
        and leaves the run folder as it was (caches are written whole or not at all)."""
        try:
            if self.exit_code is not None:  # a signal came earlier in the set-up
                raise _StoppedAtOnce
            self._at_once = what
            try:
                yield
            finally:
                self._at_once = None
        except _StoppedAtOnce:
            log(f"stopped by {_cause(self.exit_code)} while {what}, before the first step: nothing was trained or "
                "saved; the run folder is as it was (run the same command again to go on)")
            raise _interrupted(self.exit_code, None) from None

    def __exit__(self, *exc):
        self.readers.__exit__(*exc)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()  # the handlers close over this flag: drop them, so nothing keeps the run alive


def train(cfg: RunConfig, *, out_dir: str | Path, resume: str | Path | Checkpoint | None = None,
          log: Callable[[str], None] = print, hooks: TrainHooks | None = None, said: Spelling = CLI) -> TrainResult:
    """Train per `cfg` into `out_dir`. `resume`: "latest", a checkpoint path, a run directory, or a Checkpoint
    already located (fastddpm.rundir.locate). SIGTERM/SIGINT at any point, set-up included, end the run after the
    current step with a checkpoint (TrainingInterrupted, exit code 143 / 130). `said`: how errors and notes name
    the run's arguments (`--resume latest` to the command's user, `resume='latest'` to fastddpm.train's)."""
    # A run sets torch's process-wide switches for itself (CPU threads: train.cpu_threads; on CUDA TF32 and
    # cudnn.benchmark): the caller's come back when it ends, so a notebook or test that trains in-process keeps its own.
    threads = torch.get_num_threads()
    switches = _backend_switches()
    hooks = hooks or TrainHooks()
    with _StopFlag() as stop:
        try:
            return _prepare_and_loop(cfg, Path(out_dir), resume, stop, log, hooks, said)
        finally:
            if stop.dist.enabled and sys.exc_info()[2] is not None:
                # A run that ends in an exception (a SIGTERM's TrainingInterrupted included) leaves its frames in
                # the traceback, and with them the DDP/FSDP model that holds the process group: clear them, so
                # the group and its threads end in shutdown() and not during interpreter shutdown.
                traceback.clear_frames(sys.exc_info()[2])
            shutdown(stop.dist)
            if stop.folder_lock is not None:
                stop.folder_lock.release()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            _set_backend_switches(switches)


def _backend_switches() -> tuple[bool, bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark


def _set_backend_switches(switches: tuple[bool, bool, bool]) -> None:
    if _backend_switches() != switches:  # set only when changed: a torch.backends module has its own __setattr__
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = switches


def _prepare_and_loop(cfg: RunConfig, out_dir: Path, resume, stop: _StopFlag, log, hooks: TrainHooks,
                      said: Spelling) -> TrainResult:
    # Its own frame: once it returns nothing holds the Run (the model, and under torchrun the process group).
    run = prepare_run(cfg, out_dir, resume, stop=stop, log=log, hooks=hooks, said=said)
    out = StepLog(run)  # metrics.jsonl (+ --log-to), the progress bar, the loss summed on the device
    try:
        return _loop(run, stop, hooks, out)
    finally:
        out.close()


# ---------------------------------------------------------------------------------------------------------------
# The loop


def _loop(run: Run, stop: _StopFlag, hooks: TrainHooks, out: StepLog) -> TrainResult:
    train_cfg, state = run.cfg.train, run.state
    if run.evaluator is not None and any_rank(int(run.evaluator.missed(
            state.images_seen, run.images_per_step, at_end=state.step == run.total_steps)), run.dist, run.device):
        # a signal stopped the run on an evaluation's step: its weights, now. Another during it stops the run
        # again before any step, that evaluation still due.
        if maybe_evaluate(run, out, True, stop):
            _stopped(run, out, stop.exit_code, run.checkpointer.save())
    while state.step < run.total_steps:
        # the batch and the learning rate are functions of (seed, step): a resumed run draws the same ones
        micro = run.micro_batches()
        lr = run.lr_at(state.images_seen + run.images_per_step)
        # the EMA folds in every ema_every-th step and the run's last, so the final EMA misses none of the steps
        ema_steps = fold_ema_steps(state.step, train_cfg.ema_every, last=state.step + 1 == run.total_steps,
                                   off_grid=state.ema_off_grid)
        try:
            loss = run.opt.step_fn(micro, lr=lr, step=state.step, ema_steps=ema_steps)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is handled; the rest re-raise
            # A capture that failed (out of memory included) may have broken the process: it stops, naming
            # --cuda-graphs off, and never runs the step again here.
            if isinstance(e, CudaGraphCaptureError) or not is_oom(e):
                raise
            del micro, e  # drop the failed step's activations before trying again
            resplit_after_oom(run)
            continue  # the same step again: nothing was updated (the update and EMA come after the backward)
        if ema_steps and state.step % train_cfg.ema_every:
            state.ema_off_grid = state.step
        state.advance()
        out.count(loss)
        if hooks.after_step is not None and hooks.after_step(state.step):
            break

        logging_step = state.step % train_cfg.log_every == 0 or state.step == run.total_steps
        stop_code = _agreed_stop(run, stop, logging_step)
        if logging_step or run.device.type == "cpu":  # on a CPU the check costs nothing: stop at once
            check_health(run, out)
        if logging_step or stop_code is not None:  # a stop writes the losses since the last line: none is lost
            out.write(lr)
        out.tick()
        done = state.step == run.total_steps
        if _crossed(state.images_seen, run.images_per_step, train_cfg.sample_every_images) and not done:
            out.grid(f"grid_{state.images_seen:09d}.png")
        if stop_code is None and maybe_evaluate(run, out, done, stop):
            stop_code = stop.exit_code  # it came during the evaluation: the checkpoint's evaluation runs on resume
            if not logging_step:
                out.write(lr)  # the losses since the last line, as any stop writes them
        every = train_cfg.checkpoint_every
        if done or (every and state.step % every == 0) or stop_code is not None:
            if not (logging_step or run.device.type == "cpu"):
                check_health(run, out)  # never save weights a NaN froze under a later step (a save syncs anyway)
            state.train_s = time.perf_counter() - out.t_start
            out.checkpoint = run.checkpointer.save()
        if stop_code is not None:
            _stopped(run, out, stop_code, out.checkpoint)
    out.close_bar()
    return _finish(run, out, stop, hooks)


def _stopped(run: Run, out: StepLog, stop_code: int, checkpoint: Path) -> NoReturn:
    barrier(run.dist)  # no rank exits (and makes torchrun kill the others) before rank 0 has written
    out.close_bar()
    run.log(f"stopped by {_cause(stop_code)} at step {run.state.step:,}; checkpoint {checkpoint}; resume with "
            f"{run.said('resume', 'latest')}")
    raise _interrupted(stop_code, checkpoint)


def _finish(run: Run, out: StepLog, stop: _StopFlag, hooks: TrainHooks) -> TrainResult:
    """After the last step: a checkpoint if none was written (resumed at or past the end), the final grid, and
    what the fast path ended up doing."""
    state = run.state
    if out.checkpoint is None:  # no step trained here: the checkpoint resumed from stays the run's record
        out.checkpoint = run.checkpointer.kept(state.step) or run.checkpointer.save()
    stop_code = any_rank(stop.exit_code or 0, run.dist, run.device) or None
    if stop_code is not None:  # a signal after the last step: the checkpoint is written, skip the grid
        barrier(run.dist)
        run.log(f"stopped by {_cause(stop_code)} after the last step; checkpoint {out.checkpoint}")
        raise _interrupted(stop_code, out.checkpoint)
    if hooks.final_outputs:
        out.grid("final.png")
    if run.fast.compile:
        run.log(f"compile: {out.compile_counters.report()}")
    step_fn = run.opt.step_fn
    if run.fast.cuda_graphs == "capture":
        run.info.update(cuda_graphs_used=step_fn.graph is not None, cuda_graphs_failure=step_fn.graph_failed)
        if step_fn.graph_failed:
            run.log(f"cuda graphs: not used ({step_fn.graph_failed})")
    loss = (f"loss {out.last_loss:.4f}" if out.last_loss is not None else
            "no step trained here (the run had already reached its length; a longer --max-steps, --max-images or "
            "--max-epochs continues it)")
    run.log(f"done: step {state.step:,}, {state.images_seen:,} images, {loss}; grid {out.last_grid}; "
            f"weights {run.run_dir.ema}")
    return TrainResult(run_dir=run.run_dir.path, step=state.step, images_seen=state.images_seen,
                       last_loss=out.last_loss, checkpoint=out.checkpoint, grid=out.last_grid)


# ---------------------------------------------------------------------------------------------------------------
# What the loop calls


class StepLog:
    """The loop's outputs: the loss summed on the device (no sync per step) and read on logging steps,
    metrics.jsonl and the --log-to loggers, the progress bar (with the log routed above it), the compile
    counters, the clocks that images/s and wall_s come from (evaluation time taken out), sample grids, and the
    last checkpoint and grid written."""

    def __init__(self, run: Run):
        self.run = run
        self.loggers = RunLoggers(run.run_dir.path, run.cfg, enabled=run.dist.is_main,
                                  resumed_step=run.state.step if run.state.step else None, branched=run.branched)
        self.loggers.hparams(run.cfg, run.info.record)
        self.metrics = MetricsLog(run.run_dir.metrics, also=self.loggers.record)
        self.compile_counters = CompileCounters(enabled=run.fast.compile)
        # warm after this process's third step (compile, and the graphs of the first steps' shapes): a resumed
        # run compiles afresh from its checkpoint's step
        self.warm_at_step = min(run.total_steps, run.state.step + 3)
        self.loss_sum = torch.zeros((), device=run.device)
        self.loss_count = 0
        self.last_loss: float | None = None
        self.checkpoint: Path | None = None
        self.last_grid: Path | None = None
        self.t_log = time.perf_counter()
        # a resumed run's clock goes on from its checkpoint's training time, so wall_s is the run's, not the process's
        self.t_start = self.t_log - run.state.train_s
        self.images_at_log = run.state.images_seen
        self.bar = None
        if run.cfg.train.progress:  # a bar on a terminal or in a notebook, plain lines in a log file
            self.bar = progress_bar(run.total_steps, initial=run.state.step, unit="step")
            run.log.around(self.bar)

    def count(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.loss_count += 1
        if self.run.state.step == self.warm_at_step:
            self.compile_counters.mark_warm()

    def write(self, lr: float) -> None:
        """A metrics line: the mean loss over ranks and steps since the last one. Note: a host sync."""
        run, state = self.run, self.run.state
        mean_across_ranks(self.loss_sum, run.dist)
        self.last_loss = self.loss_sum.item() / self.loss_count  # note: host-device sync, on logging steps only
        now = time.perf_counter()
        images_per_s = (state.images_seen - self.images_at_log) / max(now - self.t_log, 1e-9)
        scaler = run.opt.scaler
        if run.dist.is_main:  # every rank joined the mean above; rank 0 writes the line (one per step)
            self.metrics.write({"step": state.step, "images_seen": state.images_seen,
                                "epoch": run.epochs_done,
                                "loss": self.last_loss, "images_per_s": images_per_s, "lr": lr,
                                "wall_s": now - self.t_start, **self.compile_counters.report(),
                                **({"loss_scale": scaler.get_scale()} if scaler is not None else {})})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{self.last_loss:.4f}", img_s=f"{images_per_s:,.0f}", refresh=False)
        self.loss_sum.zero_()
        self.loss_count = 0
        self.t_log, self.images_at_log = now, state.images_seen

    def grid(self, name: str) -> None:
        """A sample grid from the EMA weights into RUN_DIR/samples/NAME, and the loss curve redrawn (rank 0
        writes; under FSDP every rank samples, since each block's forward all-gathers its shards)."""
        run = self.run
        if run.dist.is_main or run.fsdp:
            self.last_grid = write_grid(run.opt.ema.model, run.schedule, run.cfg, run.device, run.precision,
                                        run.run_dir.samples / name, save=run.dist.is_main)
            if name != "final.png":
                run.log(f"step {run.state.step:,}: wrote {self.last_grid}")
            if run.dist.is_main:
                self.loggers.grid(run.state.step, self.last_grid)
        if run.dist.is_main and run.run_dir.metrics.is_file():  # the loss curve, from the log so far
            from fastddpm import charts

            charts.loss_curve(read_metrics(run.run_dir.metrics), run.run_dir.loss_chart,
                              title=f"{run.cfg.preset or 'custom'}: training loss, {run.run_dir.path.name}")

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def exclude(self, seconds: float) -> None:
        """Evaluation is not training: keep its seconds out of wall_s and images_per_s."""
        self.t_start += seconds
        self.t_log += seconds

    def close_bar(self) -> None:
        """The progress bar ends (the log goes straight to its sink again); the loggers stay open for the final
        grid and checkpoint."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.run.log.around(None)

    def close(self) -> None:
        """The end of the run: the bar and, once, the loggers (W&B uploads ema.safetensors here)."""
        self.close_bar()
        if self.loggers is not None:
            self.loggers.close()
            self.loggers = None


def _agreed_stop(run: Run, stop: _StopFlag, logging_step: bool) -> int | None:
    """The exit code of a SIGTERM/SIGINT or of the reader's leaving (None: go on). Under torchrun every rank must
    stop at the same step: the ranks agree with a collective, on a GPU only on logging steps (a signal waits
    until the next one)."""
    stop.readers.poll()  # a system call, no device sync
    if not run.dist.enabled:
        return stop.exit_code
    if not (logging_step or run.device.type == "cpu"):
        return None
    return any_rank(stop.exit_code or 0, run.dist, run.device) or None


def check_health(run: Run, out: StepLog) -> None:
    """Stop a run that can no longer learn, naming the step, the last checkpoint and the fix. Note: both checks
    read the device (host syncs): the loop calls this on logging steps and before a save only (every step on a
    CPU)."""
    train_cfg, said = run.cfg.train, run.said
    bad = run.opt.step_fn.first_bad_step()
    if bad is not None:
        out.close_bar()
        raise FloatingPointError(
            f"the loss or the gradients became NaN/Inf at step {bad + 1:,}; that step's update and all later ones "
            f"were skipped, so the weights and EMA keep their values from step {bad:,}. Try a lower {said('lr')} "
            f"(now {train_cfg.lr:g}), keep {said('grad-clip')} on, or {said('precision')} fp32/bf16 instead of fp16; "
            f"then resume from the last checkpoint with {said('resume', 'latest')} ({_last_saved(run)})")
    # fp16: the GradScaler skips an overflowing step and halves its scale; that is routine. A scale below 1 means
    # the gradients overflow even unscaled: a diverged run that would otherwise skip every step silently.
    scaler = run.opt.scaler
    if scaler is not None and scaler.get_scale() < 1.0:
        out.close_bar()
        raise FloatingPointError(
            f"the fp16 loss scale fell to {scaler.get_scale():.3g} by step {run.state.step:,}: the gradients are "
            f"NaN/Inf at every scale, so every recent step was skipped (not an fp16 overflow). Try "
            f"{said('precision')} bf16 or fp32, or a lower {said('lr')} (now {train_cfg.lr:g}); then resume from the "
            f"last checkpoint with {said('resume', 'latest')} ({_last_saved(run)})")


def _last_saved(run: Run) -> Path | str:
    saved = run.checkpointer.saved()
    return saved[-1] if saved else "none"


def resplit_after_oom(run: Run) -> None:
    """Out of memory in a step: twice as many micro-batches of half the size (the same images, timesteps and
    noise: the global batch and the result are unchanged, the step is slower), or a clear stop at the minimum."""
    train_cfg, split, step, said = run.cfg.train, run.state.micro_split, run.state.step, run.said
    size = train_cfg.batch_size // split
    if run.dist.enabled:
        raise ConfigError(
            f"out of memory at step {step + 1:,} on rank {run.dist.rank} with micro-batches of {size}: under "
            f"torchrun the ranks cannot re-plan alone; restart with a smaller {said('batch-size')} (or "
            f"{said('accum-steps', 2 * split)} with half the batch) and {said('resume', 'latest')}")
    if size == 1:
        raise ConfigError(
            f"out of memory at step {step + 1:,} even with micro-batches of 1 image: turn on "
            f"{said('grad-checkpointing')}, train a smaller model, lower {said('precision')} to bf16, or free device "
            "memory")
    new = split * 2
    if train_cfg.batch_size % new:
        raise ConfigError(
            f"out of memory at step {step + 1:,} with micro-batches of {size} images, which cannot be halved "
            f"evenly: use a --batch-size divisible by {new}, turn on --grad-checkpointing, or free device memory "
            f"(a smaller --device-memory-budget keeps less data on the GPU)")
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    run.log(f"out of memory at step {step + 1:,} with micro-batches of {size}: continuing with {new} micro-batches "
            f"of {train_cfg.batch_size // new} per batch (gradient accumulation; the global batch, the data and the "
            f"result are unchanged, the step is slower)")
    run.state.micro_split = new
    run.opt.build_step(new)
    run.info.update(micro_split=new)


def _crossed(images_seen: int, images_per_step: int, every: int | None) -> bool:
    """True on the step that crosses a multiple of `every` images (never when `every` is None)."""
    return bool(every) and images_seen // every > (images_seen - images_per_step) // every


def maybe_evaluate(run: Run, out: StepLog, done: bool, stop: _StopFlag) -> bool:
    """FID, precision/recall and coverage from the EMA weights (--eval-every, and after the last step): every rank
    draws its share of the samples, rank 0 scores them; the evaluation's seconds are taken out of the training
    clocks. True when a stop signal cut it short: in one process the signal is heard between sample batches (an
    evaluation takes up to minutes); under torchrun, where the ranks share the batches, after it."""
    evaluator, state = run.evaluator, run.state
    if evaluator is None or not (done or evaluator.due(state.images_seen, run.images_per_step)):
        return False
    from fastddpm.eval.evaluate import EvaluationStopped

    t_eval = time.perf_counter()
    try:
        out.exclude(evaluator.run(run.opt.ema.model, step=state.step, images_seen=state.images_seen,
                                  epoch=run.epochs_done, t_start=out.t_start, metrics=out.metrics,
                                  should_stop=None if run.dist.enabled else lambda: stop.exit_code is not None))
    except EvaluationStopped:
        out.exclude(time.perf_counter() - t_eval)
        cause = "the signal" if stop.exit_code != EXIT_READER_GONE else _cause(stop.exit_code)
        run.log(f"evaluation at {state.images_seen:,} images stopped by {cause}: it runs on resume, from this "
                "step's weights")
        return True
    return False
