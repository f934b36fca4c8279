"""The training loop, top to bottom: prepare the run, then while {batch, lr, step, count, log, sample, evaluate,
checkpoint, stop?}.

`prepare_run` settles everything before the first step (device, ranks, data, model shape, batch size, resumed
state) into a `Run`; `_loop` is the loop; the loop's mutable counters live in one `Progress`. Progress is
counted in steps and images seen. Every step's data order, timesteps and noise are functions of (seed, step)
(fastddpm.rng), and all mutable state is in state_dict() objects saved by each checkpoint, so a resumed run
reproduces the uninterrupted one exactly. The only host syncs are on logging steps, labelled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import fastddpm
from fastddpm.config import (
    ConfigError,
    RunConfig,
    check_same_architecture,
    from_dict,
    resolve_classes,
    resolve_model_shape,
    save_config,
)
from fastddpm.diffusion import NoiseSchedule
from fastddpm.models import UNet, count_parameters
from fastddpm.sampling import write_grid
from fastddpm.train.batch_finder import find_batch_size, is_oom, make_trial_fn
from fastddpm.train.batches import Batch, choose_placement, make_batches
from fastddpm.train.checkpoint import Checkpointer
from fastddpm.train.compile_counters import CompileCounters
from fastddpm.train.distributed import (
    SINGLE,
    DistInfo,
    any_rank,
    barrier,
    init_distributed,
    mean_across_ranks,
    shutdown,
)
from fastddpm.train.loggers import RunLoggers
from fastddpm.train.metrics import MetricsLog, read_metrics
from fastddpm.train.runtime import (
    FastPath,
    Precision,
    fix_cpu_threads,
    resolve_device,
    resolve_fast_path,
    resolve_precision,
)
from fastddpm.train.setup import Optimization, build_model, build_optimization, make_train_step

EXIT_SIGTERM, EXIT_SIGINT = 143, 130


def _quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


class TrainingInterrupted(Exception):
    """Raised after a SIGTERM/SIGINT once the checkpoint is written; `exit_code` is 143 or 130."""

    def __init__(self, exit_code: int, checkpoint: Path):
        super().__init__(f"stopped by signal; checkpoint {checkpoint}")
        self.exit_code = exit_code
        self.checkpoint = checkpoint


@dataclass
class TrainHooks:
    """Instrumentation points for tools that watch the trainer (fastddpm.doctor): they see each step's data
    source and step boundary without a copy of the loop. Defaults leave training unchanged."""

    wrap_batches: Callable[[object], object] | None = None  # batches -> object with the same .get(m)
    # called with the finished step number, on the host; returning True ends the run there (the doctor's
    # windows are bounded in time, so it stops the trainer once it has measured enough)
    after_step: Callable[[int], bool | None] | None = None
    final_outputs: bool = True  # False: skip the final grid (a diagnostic run does not need it)


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
    A second SIGINT falls through to Python's default (KeyboardInterrupt) for an impatient user."""

    def __init__(self):
        self.exit_code: int | None = None
        self._old = {}
        self.dist = SINGLE  # set once the process group is up; train() tears it down

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig, code in ((signal.SIGTERM, EXIT_SIGTERM), (signal.SIGINT, EXIT_SIGINT)):
                self._old[sig] = signal.signal(sig, self._handler(code))
        return self

    def _handler(self, code):
        def handle(signum, frame):
            if self.exit_code is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.exit_code = code
        return handle

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()  # the handlers close over this flag: drop them, so nothing keeps the run alive


# ---------------------------------------------------------------------------------------------------------------
# What the loop runs on, settled before the first step


@dataclass
class Progress:
    """The loop's counters: the step and images seen (saved in each checkpoint), the micro-batch split that an
    out-of-memory step forced (saved too), and the last files written."""

    step: int = 0
    images_seen: int = 0
    micro_split: int = 1  # each batch cut into this many micro-batches (after an OOM): same data, same result
    checkpoint: Path | None = None
    grid: Path | None = None


@dataclass
class Run:
    """Everything `prepare_run` settled. Nothing here changes while the loop runs, except `opt.step_fn` after
    an out-of-memory re-split and `info` (what run.json records)."""

    cfg: RunConfig  # resolved: model shape from the data, batch size per device
    run_dir: Path
    device: torch.device
    dist: DistInfo
    fsdp: bool
    precision: Precision
    fast: FastPath
    data: Any  # fastddpm.data.PreparedData
    model: UNet
    schedule: NoiseSchedule
    batches: Any  # ResidentBatches | StreamingBatches (or a hook's wrapper of one)
    opt: Optimization
    checkpointer: Checkpointer
    evaluator: Any  # TrainingEvaluator | None
    images_per_step: int  # the global batch: batch_size x accum_steps x ranks
    steps_per_epoch: int
    total_steps: int
    start: Progress  # where the loop starts: step 0, or the resumed checkpoint's counters
    info: dict
    log: Callable[..., None]  # print on rank 0, silent on the others
    loggers: RunLoggers | None = None  # --log-to: opened with the loop's StepLog, closed when the loop ends

    def micro_batches(self, progress: Progress) -> list[Batch]:
        """This step's accum_steps micro-batches, each cut in `micro_split` equal parts after an OOM."""
        train_cfg = self.cfg.train
        micro = [self.batches.get(progress.step * train_cfg.accum_steps + k) for k in range(train_cfg.accum_steps)]
        return [part for b in micro for part in split_batch(b, progress.micro_split)]

    def lr_at(self, images_seen: int) -> float:
        """Linear warm-up over warmup_images, then constant."""
        train_cfg = self.cfg.train
        train_cfg = self.cfg.train
        if not train_cfg.warmup_images:
            return train_cfg.lr
        return train_cfg.lr * min(1.0, images_seen / train_cfg.warmup_images)

    def write_info(self) -> None:
        """RUN_DIR/run.json: what was chosen and why (rank 0; rewritten when a choice changes mid-run)."""
        if self.dist.is_main:
            (self.run_dir / "run.json").write_text(json.dumps(self.info, indent=2) + "\n")


def split_batch(b: Batch, parts: int) -> list[Batch]:
    """A batch cut into `parts` equal micro-batches (views: the same images, timesteps and noise)."""
    if parts == 1:
        return [b]
    ys = b.y.chunk(parts) if b.y is not None else [None] * parts
    return [Batch(x0=x0, t=t, noise=noise, indices=idx, y=y) for x0, t, noise, idx, y in
            zip(b.x0.chunk(parts), b.t.chunk(parts), b.noise.chunk(parts), b.indices.chunk(parts), ys)]


def total_steps_for(cfg: RunConfig, steps_per_epoch: int, images_per_step: int | None = None) -> int:
    train_cfg = cfg.train
    if train_cfg.max_steps is not None:
        return train_cfg.max_steps
    if train_cfg.max_images is not None:
        return math.ceil(train_cfg.max_images / (images_per_step or train_cfg.batch_size))
    if train_cfg.max_epochs is not None:
        return math.ceil(train_cfg.max_epochs * steps_per_epoch)
    raise ConfigError("say how long to train: --max-steps N, --max-images N or --max-epochs N (or pick a --preset)")


def _planned_images(cfg: RunConfig, num_images: int, world: int) -> int | None:
    """The run's length in images as configured, before the batch size is settled (None: not known yet)."""
    t = cfg.train
    if t.max_images is not None:
        return t.max_images
    if t.max_steps is not None and isinstance(t.batch_size, int):
        return t.max_steps * t.batch_size * t.accum_steps * max(1, world)
    if t.max_epochs is not None:
        return int(t.max_epochs * num_images)
    return None


def prepare_run(cfg: RunConfig, run_dir: Path, resume, *, stop: _StopFlag, log, hooks: TrainHooks) -> Run:
    """Device and ranks, data, model shape, resumed state, model and batch size, optimisation: the run as the
    loop will see it, written to config.json and run.json and described in the log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    device, device_reason, dist, cfg, log, resume = _join_ranks(cfg, stop, log, resume)
    fsdp = dist.enabled and cfg.train.parallel == "fsdp"
    cpu_threads = fix_cpu_threads(cfg.train.cpu_threads)[0] if device.type == "cpu" else None
    precision = resolve_precision(cfg.train.precision, device)
    if device.type == "cuda":  # TF32 for the fp32 matmuls/convs outside autocast (10-bit mantissa, fp32 range)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    data = _load_data(cfg, dist)
    cfg = resolve_classes(resolve_model_shape(cfg, data.images.shape), data.labels, data.class_names, cfg.data.source)
    checkpointer = Checkpointer(run_dir, sharded=fsdp, keep=cfg.train.keep_checkpoints, is_main=dist.is_main)
    resumed = _find_resume(checkpointer, resume, cfg, data.images.shape, dist, device, log)

    fast = resolve_fast_path(cfg.train, device, precision, world_size=dist.world_size if dist.enabled else 0,
                             parallel="fsdp" if fsdp else "ddp",
                             planned_images=_planned_images(cfg, len(data.images), dist.world_size))
    model, schedule = build_model(cfg, device=device, fast=fast, keep_on_cpu=fsdp)
    cfg, batch_note, batch_fixed = _settle_batch_size(cfg, model, schedule, precision, data, dist, device, log)
    train_cfg, world = cfg.train, dist.world_size
    batches, placement, placement_reason = _make_batches(cfg, data, device, dist, hooks)
    images_per_step = train_cfg.batch_size * train_cfg.accum_steps * world
    steps_per_epoch = batches.steps_per_epoch // train_cfg.accum_steps
    if steps_per_epoch < 1:
        raise ConfigError(f"batch {train_cfg.batch_size} x accum_steps {train_cfg.accum_steps} is more than the "
                          f"dataset's {batches.num_images} images: lower one of them")
    total_steps = total_steps_for(cfg, steps_per_epoch, images_per_step)

    opt = build_optimization(cfg, model, schedule, device=device, precision=precision, fast=fast,
                             resume_state=resumed[1] if resumed is not None else None,
                             ddp=dist.enabled and not fsdp, fsdp=fsdp)
    evaluator = None
    if train_cfg.eval_every_images and dist.is_main:
        # Built before the clock starts: training the dataset's feature network (once, then cached) and the real
        # data's statistics are set-up, not time-to-quality.
        from fastddpm.eval.during_training import TrainingEvaluator

        evaluator = TrainingEvaluator(cfg, run_dir=run_dir, device=device, autocast_dtype=precision.autocast_dtype,
                                      log=log)
    start = _restore(resumed, cpu_threads, device, images_per_step, batch_fixed, world, log)
    if start.micro_split > 1:  # an earlier OOM re-split the batches: keep the same micro-batches
        opt.step_fn = make_train_step(cfg, model, schedule, optimizer=opt.optimizer, scaler=opt.scaler, ema=opt.ema,
                                      device=device, precision=precision, fast=fast,
                                      accum_steps=train_cfg.accum_steps * start.micro_split,
                                      forward_model=opt.step_fn.forward_model if dist.enabled else None)

    run = Run(cfg=cfg, run_dir=run_dir, device=device, dist=dist, fsdp=fsdp, precision=precision, fast=fast,
              data=data, model=model, schedule=schedule, batches=batches, opt=opt, checkpointer=checkpointer,
              evaluator=evaluator, images_per_step=images_per_step, steps_per_epoch=steps_per_epoch,
              total_steps=total_steps, start=start, info={}, log=log)
    run.info = _run_info(run, device_reason=device_reason, cpu_threads=cpu_threads, placement=placement,
                         placement_reason=placement_reason, batch_note=batch_note, batch_fixed=batch_fixed)
    if dist.is_main:
        save_config(cfg, run_dir / "config.json")
    run.write_info()
    _describe(run)
    return run


def _load_data(cfg: RunConfig, dist: DistInfo):
    """The dataset's uint8 cache (fastddpm.data.prepare): built once by rank 0, then read by every rank."""
    from fastddpm.data import prepare

    if not dist.is_main:
        barrier(dist)  # rank 0 builds the uint8 cache first; the others then read it
    d = cfg.data
    data = prepare(d.source, split=d.split, resize=d.resize, resize_mode=d.resize_mode, image_mode=d.image_mode,
                   skip_bad=d.skip_bad, cache_dir=Path(d.cache_dir) if d.cache_dir else None,
                   progress=cfg.train.progress)
    if dist.enabled and dist.is_main:
        barrier(dist)
    return data


def _join_ranks(cfg: RunConfig, stop: _StopFlag, log, resume):
    """The device, and under torchrun this rank's place in the job. Returns (device, why, dist, cfg, log,
    resume): ranks other than 0 log nothing and draw no progress bar; a worker torchrun restarted resumes."""
    device, device_reason = resolve_device(cfg.train.device)
    dist, device = init_distributed(device, cfg.train.dist_timeout_s)  # under torchrun: this rank's device
    stop.dist = dist
    train_cfg = cfg.train
    if train_cfg.parallel == "fsdp" and not dist.enabled:
        raise ConfigError("train.parallel=fsdp shards the model across torchrun's processes: launch with "
                          "`torchrun --nproc-per-node N -m fastddpm train --parallel fsdp ...` (N=1 works too), or "
                          "drop --parallel fsdp for a single-process run")
    fsdp = dist.enabled and train_cfg.parallel == "fsdp"
    if fsdp and train_cfg.eval_every_images:
        raise ConfigError("--eval-every is not supported with --parallel fsdp yet (evaluation runs on rank 0 alone "
                          "and cannot all-gather the sharded EMA): evaluate the run's ema.safetensors afterwards "
                          "with `fastddpm eval --checkpoint RUN_DIR/ema.safetensors`")
    if fsdp and train_cfg.batch_size == "auto":
        raise ConfigError("batch_size=auto measures a full replica of the model, which --parallel fsdp exists to "
                          "avoid: set --batch-size (per device) or --global-batch-size")
    if dist.enabled:
        device_reason += (f"; rank {dist.rank} of {dist.world_size} ({dist.backend}, "
                          f"{'FSDP2 fully_shard' if fsdp else 'DistributedDataParallel'})")
        if not dist.is_main:  # rank 0 speaks (and writes) for the job
            log = _quiet
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(train_cfg, progress=False))
        if dist.restarted and resume is None:
            resume = "latest"
            log("torchrun restarted the workers: resuming from the newest complete checkpoint")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # graph capture, bf16 checks and new streams use the current device
    return device, device_reason, dist, cfg, log, resume


def _make_batches(cfg: RunConfig, data, device: torch.device, dist: DistInfo, hooks: TrainHooks):
    """This rank's batch source, resident on the device or streamed (choose_placement says which and why).
    Returns (batches, placement, reason)."""
    train_cfg = cfg.train
    placement, reason = choose_placement(data.images, device, train_cfg.data_placement, train_cfg.device_memory_budget,
                                         world_size=dist.world_size)
    conditional = cfg.model.conditional  # the labels travel with the images, dropped to the null class at random
    batches = make_batches(data.images, placement, batch_size=train_cfg.batch_size,
                           num_timesteps=cfg.diffusion.num_timesteps, seed=train_cfg.seed, device=device,
                           hflip=cfg.data.hflip, rank=dist.rank, world_size=dist.world_size,
                           labels=data.labels if conditional else None,
                           cond_drop_prob=train_cfg.cond_drop_prob if conditional else 0.0,
                           num_classes=cfg.model.num_classes)
    if hooks.wrap_batches is not None:
        batches = hooks.wrap_batches(batches)
    return batches, placement, reason


def _find_resume(checkpointer: Checkpointer, resume, cfg: RunConfig, images_shape, dist: DistInfo,
                 device: torch.device, log) -> tuple[Path, dict] | None:
    """The checkpoint to resume (None: a new run). Every rank looks for itself, and all must find the same one
    (2 tiny collectives); it must be in the format this run writes and of the same architecture."""
    resumed = checkpointer.resolve(resume)
    if resume == "latest" and resumed is None:
        log(f"--resume latest: no checkpoint in {checkpointer.dir} yet, starting a new run")
    if dist.enabled:
        found_step = int(resumed[1]["step"]) if resumed is not None else -1
        lowest, highest = -any_rank(-found_step, dist, device), any_rank(found_step, dist, device)
        if lowest != highest:
            raise ConfigError(
                f"the ranks found different checkpoints to resume in {checkpointer.dir.parent} (steps {lowest} to "
                f"{highest}; -1 = none): every rank must see the same run directory, so put --out on a filesystem "
                f"all nodes share")
    if resumed is not None:
        checkpointer.check_format(resumed)
        check_same_architecture(resolve_model_shape(from_dict(resumed[1]["config"]), images_shape), cfg, resumed[0])
    return resumed


def _settle_batch_size(cfg: RunConfig, model, schedule, precision: Precision, data, dist: DistInfo,
                       device: torch.device, log) -> tuple[RunConfig, str, str]:
    """The per-device batch size: as requested, from --global-batch-size, or the measured throughput knee
    (batch_size=auto). Returns (cfg with it, how it was chosen, which batch stays fixed across world sizes)."""
    train_cfg, world = cfg.train, dist.world_size
    if train_cfg.global_batch_size is not None:
        per_device, rest = divmod(train_cfg.global_batch_size, train_cfg.accum_steps * world)
        if train_cfg.batch_size == "auto" or rest or per_device < 1:
            raise ConfigError(
                f"train.global_batch_size={train_cfg.global_batch_size} must be a multiple of "
                f"accum_steps={train_cfg.accum_steps} x {world} rank(s) = {train_cfg.accum_steps * world}, and cannot "
                f"be combined with batch_size=auto: pick a multiple, or fix the per-device --batch-size instead")
        note = f"global batch {train_cfg.global_batch_size} / ({train_cfg.accum_steps} x {world})"
        return dataclasses.replace(cfg, train=dataclasses.replace(train_cfg, batch_size=per_device)), note, "global"
    if train_cfg.batch_size != "auto":
        return cfg, "requested", "per device"
    log("batch size: searching for the throughput knee (uncompiled copy of the model, state untouched)")
    trial = make_trial_fn(model, schedule, cfg.diffusion.prediction, precision,
                          image_shape=tuple(data.images.shape[1:]), device=device)
    best, trials = find_batch_size(trial, limit=min(8192, data.images.shape[0] // world), log=log)
    best = -any_rank(-best, dist, device)  # every rank takes the smallest knee: one static shape for all
    note = "auto: " + ", ".join(f"{tr.batch_size}: " + (f"{tr.images_per_s:,.0f} img/s" if tr.images_per_s else "OOM")
                                for tr in trials) + f" -> {best}"
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trials' cached blocks would make the data look like it doesn't fit
    return dataclasses.replace(cfg, train=dataclasses.replace(train_cfg, batch_size=best)), note, "per device"


def _restore(resumed: tuple[Path, dict] | None, cpu_threads: int | None, device: torch.device,
             images_per_step: int, batch_fixed: str, world: int, log) -> Progress:
    """The resumed checkpoint's counters and RNG state (the weights, EMA and optimizer were loaded with the
    optimisation), with a note for what cannot stay bit-exact: another CPU thread count, another world size."""
    if resumed is None:
        return Progress()
    path, state = resumed
    torch.set_rng_state(state["rng"]["torch_cpu"])
    if device.type == "cuda" and state["rng"].get("torch_cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["torch_cuda"], device)
    start = Progress(step=int(state["step"]), images_seen=int(state["images_seen"]),
                     micro_split=int(state.get("micro_split", 1)))
    log(f"resumed from {path} at step {start.step:,} ({start.images_seen:,} images)")
    saved_threads = state.get("cpu_threads")
    if cpu_threads is not None and saved_threads is not None and saved_threads != cpu_threads:
        log(f"note: the checkpoint was written with {saved_threads} CPU thread(s), this run has {cpu_threads}: "
            f"CPU sums run in another order, so from here the run matches an uninterrupted one to float "
            f"rounding, not bit for bit (--cpu-threads {saved_threads} for an exact resume)")
    saved_world = int(state.get("world_size", 1))
    if saved_world != world:
        log(f"note: the checkpoint was written by {saved_world} rank{'s' if saved_world > 1 else ''}, this run has "
            f"{world}: the global batch is {images_per_step} (was {state.get('global_batch')}; "
            + ("kept, --global-batch-size is fixed" if batch_fixed == "global" else
               "per-device batch fixed; set --global-batch-size to keep the global one")
            + "), and the data order from here differs from an uninterrupted run")
    return start


def _run_info(run: Run, *, device_reason: str, cpu_threads: int | None, placement: str, placement_reason: str,
              batch_note: str, batch_fixed: str) -> dict:
    """What run.json records: every choice the set-up made, and why."""
    cfg, train_cfg, dist, data = run.cfg, run.cfg.train, run.dist, run.data
    return {
        "fastddpm": fastddpm.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "device": str(run.device), "device_reason": device_reason, "cpu_threads": cpu_threads,
        "precision": run.precision.name, "precision_reason": run.precision.reason,
        "parameters": count_parameters(run.model),
        "data": {"source": cfg.data.source, "cache": str(data.cache_path), "shape": list(data.images.shape),
                 "placement": placement, "placement_reason": placement_reason},
        "batch_size": train_cfg.batch_size, "batch_size_reason": batch_note, "accum_steps": train_cfg.accum_steps,
        "world_size": dist.world_size, "global_batch": run.images_per_step, "batch_fixed": batch_fixed,
        "parallel": ("fsdp" if run.fsdp else "ddp") if dist.enabled else None,
        "fast_path": run.fast.reasons, "grad_checkpointing": train_cfg.grad_checkpointing,
        "steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps, "command": sys.argv,
    }


def _describe(run: Run) -> None:
    """The run's choices, one line each, as run.json records them."""
    cfg, train_cfg, log, info = run.cfg, run.cfg.train, run.log, run.info
    world, threads = run.dist.world_size, info["cpu_threads"]
    classes = f", conditional on {cfg.model.num_classes} classes" if cfg.model.conditional else ""
    log(f"model: U-Net, {info['parameters']:,} parameters{classes} ({cfg.preset or 'custom'} preset)")
    log(f"data: {run.data.images.shape[0]:,} images {tuple(run.data.images.shape[1:])} from {cfg.data.source}; "
        f"placement {info['data']['placement']} ({info['data']['placement_reason']})")
    log(f"batch: {train_cfg.batch_size} x {train_cfg.accum_steps} accumulation"
        + (f" x {world} ranks" if world > 1 else "") + f" = {run.images_per_step} images/step "
        f"({info['batch_size_reason']}); {run.steps_per_epoch:,} steps/epoch")
    log(f"device: {run.device} ({info['device_reason']})" + (f", {threads} CPU threads" if threads else "")
        + f"; precision: {run.precision.name} ({run.precision.reason})")
    for line in run.fast.lines():
        log(line)
    log(f"training to step {run.total_steps:,} ({run.total_steps * run.images_per_step:,} images); run dir "
        f"{run.run_dir}")


# ---------------------------------------------------------------------------------------------------------------
# The loop


def train(cfg: RunConfig, *, out_dir: str | Path, resume: str | tuple[Path, dict] | None = None,
          log=print, hooks: TrainHooks | None = None) -> TrainResult:
    """Train per `cfg` into `out_dir`. `resume`: "latest", a checkpoint path, a run directory, or an already
    loaded (path, state) pair (what Checkpointer.resolve returns). SIGTERM/SIGINT at any point, set-up included,
    end the run after the current step with a checkpoint (TrainingInterrupted, exit code 143 / 130)."""
    # A run sets torch's process-wide switches for itself (CPU threads: train.cpu_threads; on CUDA TF32 and
    # cudnn.benchmark): the caller's come back when it ends, so a notebook or test that trains in-process keeps its own.
    threads = torch.get_num_threads()
    switches = _backend_switches()
    hooks = hooks or TrainHooks()
    with _StopFlag() as stop:
        try:
            return _prepare_and_loop(cfg, Path(out_dir), resume, stop, log, hooks)
        finally:
            if stop.dist.enabled and sys.exc_info()[2] is not None:
                # A run that ends in an exception (a SIGTERM's TrainingInterrupted included) leaves its frames in
                # the traceback, and with them the DDP/FSDP model that holds the process group: clear them, so
                # the group and its threads end in shutdown() and not during interpreter shutdown.
                traceback.clear_frames(sys.exc_info()[2])
            shutdown(stop.dist)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            _set_backend_switches(switches)


def _backend_switches() -> tuple[bool, bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark


def _set_backend_switches(switches: tuple[bool, bool, bool]) -> None:
    if _backend_switches() != switches:  # set only when changed: a torch.backends module has its own __setattr__
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = switches


def _prepare_and_loop(cfg: RunConfig, out_dir: Path, resume, stop: _StopFlag, log, hooks: TrainHooks
                      ) -> TrainResult:
    # Its own frame: once it returns nothing holds the Run (the model, and under torchrun the process group).
    return _loop(prepare_run(cfg, out_dir, resume, stop=stop, log=log, hooks=hooks), stop, hooks)


def _loop(run: Run, stop: _StopFlag, hooks: TrainHooks) -> TrainResult:
    out = StepLog(run, run.start)  # metrics.jsonl (+ --log-to), the progress bar, the loss summed on the device
    try:
        return _steps(run, stop, hooks, out)
    finally:
        out.loggers.close()


def _steps(run: Run, stop: _StopFlag, hooks: TrainHooks, out: StepLog) -> TrainResult:
    train_cfg = run.cfg.train
    progress = run.start
    while progress.step < run.total_steps:
        # the batch and the learning rate are functions of (seed, step): a resumed run draws the same ones
        micro = run.micro_batches(progress)
        lr = run.lr_at(progress.images_seen + run.images_per_step)
        try:
            loss = run.opt.step_fn(micro, lr=lr, step=progress.step)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is handled; the rest re-raise
            if not is_oom(e):
                raise
            del micro, e  # drop the failed step's activations before trying again
            resplit_after_oom(run, progress)
            continue  # the same step again: nothing was updated (the update and EMA come after the backward)
        progress.step += 1
        progress.images_seen += run.images_per_step
        out.count(loss)
        if hooks.after_step is not None and hooks.after_step(progress.step):
            break

        logging_step = progress.step % train_cfg.log_every == 0 or progress.step == run.total_steps
        stop_code = _agreed_stop(run, stop, logging_step)
        if logging_step or run.device.type == "cpu":  # on a CPU the check costs nothing: stop at once
            check_health(run, progress, out)
        if logging_step:
            out.write(lr)
        out.tick()
        done = progress.step == run.total_steps
        if _crossed(progress.images_seen, run.images_per_step, train_cfg.sample_every_images) and not done:
            maybe_write_grid(run, progress, f"grid_{progress.images_seen:09d}.png")
        if stop_code is None:
            maybe_evaluate(run, progress, out, done)
        every = train_cfg.checkpoint_every
        if done or (every and progress.step % every == 0) or stop_code is not None:
            progress.checkpoint = save_checkpoint(run, progress)
        if stop_code is not None:
            barrier(run.dist)  # no rank exits (and makes torchrun kill the others) before rank 0 has written
            out.close()
            run.log(f"stopped by signal at step {progress.step:,}; checkpoint {progress.checkpoint}; "
                    f"resume with --resume latest")
            raise TrainingInterrupted(stop_code, progress.checkpoint)
    out.close()
    return _finish(run, progress, out, stop, hooks)


# ---------------------------------------------------------------------------------------------------------------
# What the loop calls


class StepLog:
    """The loop's outputs between checkpoints: the loss summed on the device (no sync per step) and read on
    logging steps, metrics.jsonl, the progress bar (and the log routed around it), the compile counters, and
    the clocks that images/s and wall_s come from (evaluation time taken out)."""

    def __init__(self, run: Run, progress: Progress):
        self.run, self.progress = run, progress
        self.loggers = run.loggers = RunLoggers(run.run_dir, run.cfg, enabled=run.dist.is_main)
        self.loggers.hparams(run.cfg, run.info)
        self.metrics = MetricsLog(run.run_dir / "metrics.jsonl", also=self.loggers.record)
        self.compile_counters = CompileCounters(enabled=run.fast.compile)
        self.loss_sum = torch.zeros((), device=run.device)
        self.loss_count = 0
        self.last_loss: float | None = None
        self.t_start = self.t_log = time.perf_counter()
        self.images_at_log = progress.images_seen
        self.bar = None
        if run.cfg.train.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=run.total_steps, initial=progress.step, unit="step", dynamic_ncols=True, leave=True)
            run.log = self.bar.write  # log lines go above the bar
            if run.evaluator is not None:
                run.evaluator.log = run.log

    def count(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.loss_count += 1
        if self.progress.step == min(self.run.total_steps, 3):
            self.compile_counters.mark_warm()

    def write(self, lr: float) -> None:
        """A metrics line: the mean loss over ranks and steps since the last one. Note: a host sync."""
        run, p = self.run, self.progress
        mean_across_ranks(self.loss_sum, run.dist)
        self.last_loss = self.loss_sum.item() / self.loss_count  # note: host-device sync, on logging steps only
        now = time.perf_counter()
        images_per_s = (p.images_seen - self.images_at_log) / max(now - self.t_log, 1e-9)
        scaler = run.opt.scaler
        self.metrics.write({"step": p.step, "images_seen": p.images_seen,
                            "epoch": p.images_seen / run.data.images.shape[0],
                            "loss": self.last_loss, "images_per_s": images_per_s, "lr": lr,
                            "wall_s": now - self.t_start, **self.compile_counters.report(),
                            **({"loss_scale": scaler.get_scale()} if scaler is not None else {})})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{self.last_loss:.4f}", img_s=f"{images_per_s:,.0f}", refresh=False)
        self.loss_sum.zero_()
        self.loss_count = 0
        self.t_log, self.images_at_log = now, p.images_seen

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def exclude(self, seconds: float) -> None:
        """Evaluation is not training: keep its seconds out of wall_s and images_per_s."""
        self.t_start += seconds
        self.t_log += seconds

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _agreed_stop(run: Run, stop: _StopFlag, logging_step: bool) -> int | None:
    """The exit code of a SIGTERM/SIGINT (None: go on). Under torchrun every rank must stop at the same step:
    the ranks agree with a collective, on a GPU only on logging steps (a signal waits until the next one)."""
    if not run.dist.enabled:
        return stop.exit_code
    if not (logging_step or run.device.type == "cpu"):
        return None
    return any_rank(stop.exit_code or 0, run.dist, run.device) or None


def check_health(run: Run, progress: Progress, out: StepLog) -> None:
    """Stop a run that can no longer learn, naming the step, the last checkpoint and the fix. Note: both checks
    read the device (host syncs): the loop calls this on logging steps only (every step on a CPU)."""
    train_cfg = run.cfg.train
    bad = run.opt.step_fn.first_bad_step()
    if bad is not None:
        out.close()
        raise FloatingPointError(
            f"the loss or the gradients became NaN/Inf at step {bad + 1:,}; that step's update and all later ones "
            f"were skipped, so the weights and EMA keep their values from step {bad:,}. Try a lower --lr (now "
            f"{train_cfg.lr:g}), keep --grad-clip on, or --precision fp32/bf16 instead of fp16; then resume from the "
            f"last checkpoint with --resume latest ({_last_saved(run)})")
    # fp16: the GradScaler skips an overflowing step and halves its scale; that is routine. A scale below 1 means
    # the gradients overflow even unscaled: a diverged run that would otherwise skip every step silently.
    scaler = run.opt.scaler
    if scaler is not None and scaler.get_scale() < 1.0:
        out.close()
        raise FloatingPointError(
            f"the fp16 loss scale fell to {scaler.get_scale():.3g} by step {progress.step:,}: the gradients are "
            f"NaN/Inf at every scale, so every recent step was skipped (not an fp16 overflow). Try --precision "
            f"bf16 or fp32, or a lower --lr (now {train_cfg.lr:g}); then resume from the last checkpoint with --resume "
            f"latest ({_last_saved(run)})")


def _last_saved(run: Run) -> Path | str:
    saved = run.checkpointer.saved()
    return saved[-1] if saved else "none"


def resplit_after_oom(run: Run, progress: Progress) -> None:
    """Out of memory in a step: twice as many micro-batches of half the size (the same images, timesteps and
    noise: the global batch and the result are unchanged, the step is slower), or a clear stop at the minimum."""
    train_cfg, split, step = run.cfg.train, progress.micro_split, progress.step
    size = train_cfg.batch_size // split
    if run.dist.enabled:
        raise ConfigError(
            f"out of memory at step {step + 1:,} on rank {run.dist.rank} with micro-batches of {size}: under "
            f"torchrun the ranks cannot re-plan alone; restart with a smaller --batch-size (or --accum-steps "
            f"{2 * split} with half the batch) and --resume latest")
    if size == 1:
        raise ConfigError(
            f"out of memory at step {step + 1:,} even with micro-batches of 1 image: turn on --grad-checkpointing, "
            f"train a smaller model, lower --precision to bf16, or free device memory")
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
    o = run.opt
    o.step_fn = make_train_step(run.cfg, run.model, run.schedule, optimizer=o.optimizer, scaler=o.scaler, ema=o.ema,
                                device=run.device, precision=run.precision, fast=run.fast,
                                accum_steps=train_cfg.accum_steps * new)
    progress.micro_split = new
    run.info["micro_split"] = new
    run.write_info()


def _crossed(images_seen: int, images_per_step: int, every: int | None) -> bool:
    """True on the step that crosses a multiple of `every` images (never when `every` is None)."""
    return bool(every) and images_seen // every > (images_seen - images_per_step) // every


def maybe_write_grid(run: Run, progress: Progress, name: str) -> None:
    """A sample grid from the EMA weights into RUN_DIR/samples/NAME (rank 0 writes; under FSDP every rank
    samples, since each block's forward all-gathers its shards)."""
    if run.dist.is_main or run.fsdp:
        progress.grid = write_grid(run.opt.ema.model, run.schedule, run.cfg, run.device, run.precision,
                                   run.run_dir / "samples" / name, save=run.dist.is_main)
        if name != "final.png":
            run.log(f"step {progress.step:,}: wrote {progress.grid}")
        if run.dist.is_main and run.loggers is not None:
            run.loggers.grid(progress.step, progress.grid)
    metrics = run.run_dir / "metrics.jsonl"
    if run.dist.is_main and metrics.is_file():  # the loss curve, redrawn with each grid from the log so far
        from fastddpm import charts

        charts.loss_curve(read_metrics(metrics), run.run_dir / "loss.png",
                          title=f"{run.cfg.preset or 'custom'}: training loss, {run.run_dir.name}")


def maybe_evaluate(run: Run, progress: Progress, out: StepLog, done: bool) -> None:
    """FID, precision/recall and coverage from the EMA weights (--eval-every, and after the last step), on rank 0;
    the evaluation's seconds are taken out of the training clocks."""
    evaluator = run.evaluator
    if evaluator is None or not (done or evaluator.due(progress.images_seen, run.images_per_step)):
        return
    out.exclude(evaluator.run(run.opt.ema.model, step=progress.step, images_seen=progress.images_seen,
                              epoch=progress.images_seen / run.data.images.shape[0], t_start=out.t_start,
                              metrics=out.metrics))


def save_checkpoint(run: Run, progress: Progress) -> Path | None:
    """The checkpoint of this step (Checkpointer: rank 0 writes a .pt, or every rank its FSDP shards)."""
    cfg, o = run.cfg, run.opt
    meta = {"scaler": o.scaler.state_dict() if o.scaler is not None else None,
            "step": progress.step, "images_seen": progress.images_seen, "config": cfg.to_dict(),
            "world_size": run.dist.world_size, "global_batch": run.images_per_step,
            "micro_split": progress.micro_split, "cpu_threads": run.info["cpu_threads"],
            "rng": {"torch_cpu": torch.get_rng_state(),
                    "torch_cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None}}
    export_meta = {"config": cfg.to_dict(), "step": progress.step, "images_seen": progress.images_seen,
                   "format": "fastddpm-ema-1"}
    return run.checkpointer.save(progress.step, model=run.model, ema_model=o.ema.model, optimizer=o.optimizer,
                                 meta=meta, export_meta=export_meta)


def _finish(run: Run, progress: Progress, out: StepLog, stop: _StopFlag, hooks: TrainHooks) -> TrainResult:
    """After the last step: a checkpoint if none was written (resumed at or past the end), the final grid, and
    what the fast path ended up doing."""
    if progress.checkpoint is None:
        progress.checkpoint = save_checkpoint(run, progress)
    stop_code = any_rank(stop.exit_code or 0, run.dist, run.device) or None
    if stop_code is not None:  # a signal after the last step: the checkpoint is written, skip the grid
        barrier(run.dist)
        run.log(f"stopped by signal after the last step; checkpoint {progress.checkpoint}")
        raise TrainingInterrupted(stop_code, progress.checkpoint)
    if hooks.final_outputs:
        maybe_write_grid(run, progress, "final.png")
    if run.fast.compile:
        run.log(f"compile: {out.compile_counters.report()}")
    step_fn = run.opt.step_fn
    if run.fast.cuda_graphs == "capture":
        run.info["cuda_graphs_used"] = step_fn.graph is not None
        run.info["cuda_graphs_failure"] = step_fn.graph_failed
        run.write_info()
        if step_fn.graph_failed:
            run.log(f"cuda graphs: not used ({step_fn.graph_failed})")
    run.log(f"done: step {progress.step:,}, {progress.images_seen:,} images, loss {out.last_loss}; grid "
            f"{progress.grid}; weights {run.run_dir / 'ema.safetensors'}")
    return TrainResult(run_dir=run.run_dir, step=progress.step, images_seen=progress.images_seen,
                       last_loss=out.last_loss, checkpoint=progress.checkpoint, grid=progress.grid)
