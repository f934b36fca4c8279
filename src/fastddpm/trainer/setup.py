"""Everything settled before the first step, into one `Run`: device and ranks, data, model shape, the checkpoint
to resume, model and batch size, optimisation, the train state. Each automatic choice is resolved once, with its
reason, into `Choices`, which both the log and RUN_DIR/run.json print from.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import fastddpm
from fastddpm.config import (CLI, RUN_LENGTHS, ConfigError, RunConfig, Spelling, check_same_architecture,
                             resolve_classes, resolve_model_shape, save_config)
from fastddpm.config.model_checks import check_attention_levels
from fastddpm.config.presets import PRESETS
from fastddpm.data.sources import refuse_output_among_images
from fastddpm.device import Precision, fix_cpu_threads, resolve_device, resolve_precision
from fastddpm.diffusion import NoiseSchedule
from fastddpm.diffusion.ode_solvers import LAMBDA_MIN
from fastddpm.models import UNet, count_parameters
from fastddpm.rundir import metrics
from fastddpm.rundir.checkpoint import step_of
from fastddpm.rundir.checkpointer import Checkpointer
from fastddpm.rundir.files import make_writable_dir, remove_if_empty
from fastddpm.rundir.layout import RunDir
from fastddpm.rundir.lock import RunFolderLock
from fastddpm.rundir.locate import Checkpoint, find_resume, saved
from fastddpm.sampling import run_sampling, step_limit
from fastddpm.trainer.batch_finder import find_batch_size, make_trial_fn
from fastddpm.trainer.batches import Batch, choose_placement, make_batches, step_batches
from fastddpm.trainer.build import Optimization, build_model
from fastddpm.distributed import DistInfo, any_rank, barrier, init_distributed, same_on_every_rank
from fastddpm.trainer.fast_path import FastPath, resolve_fast_path
from fastddpm.trainer.loggers import check_loggers
from fastddpm.trainer.resume_checks import (check_run_length, check_same_inputs, init_from_note, recipe_changes,
                                            set_aside_the_abandoned, unconditional_init_note)
from fastddpm.trainer.state import TrainState


@dataclass
class TrainHooks:
    """Instrumentation points for tools that watch the trainer (fastddpm.doctor): they see each step's data
    source and step boundary without a copy of the loop. Defaults leave training unchanged."""

    wrap_batches: Callable[[object], object] | None = None  # batches -> object with the same .get(m)
    # called with the finished step number, on the host; returning True ends the run there (the doctor's
    # windows are bounded in time, so it stops the trainer once it has measured enough)
    after_step: Callable[[int], bool | None] | None = None
    final_outputs: bool = True  # False: skip the final grid (a diagnostic run does not need it)


class Console:
    """The run's log: every line goes to the sink (print, or the caller's `log`) on rank 0, nothing on the other
    ranks. While the loop's progress bar is drawn, tqdm clears it around each line and redraws it below, so the
    lines and the bar do not run into each other."""

    def __init__(self, sink: Callable[..., None] = print, *, enabled: bool = True):
        self.sink, self.enabled = sink, enabled
        self._bar = None

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self.sink(message)
        else:
            with self._bar.external_write_mode(file=self._bar.fp):
                self.sink(message)

    def around(self, bar) -> None:
        """Write around tqdm `bar` from now on (None: it is closed)."""
        self._bar = bar


@dataclass(frozen=True)
class Choices:
    """Every choice set-up made, each value with the reason it was made (requested, or what `auto` saw)."""

    device: str
    device_reason: str
    cpu_threads: int | None  # a CPU run's intra-op threads (train.cpu_threads, or torch's count)
    precision: Precision
    batch_size: int
    batch_size_reason: str
    batch_fixed: str  # "global" (--global-batch-size) or "per device": which one a resume on a new world keeps
    placement: str
    placement_reason: str
    fast: FastPath

    def lines(self, world: int, images_per_step: int, accum_steps: int, steps_per_epoch: int) -> list[str]:
        threads = f", {self.cpu_threads} CPU threads" if self.cpu_threads else ""
        return [f"batch: {self.batch_size} x {accum_steps} accumulation" + (f" x {world} ranks" if world > 1 else "")
                + f" = {images_per_step} images/step ({self.batch_size_reason}); {steps_per_epoch:,} steps/epoch",
                f"device: {self.device} ({self.device_reason}){threads}; precision: {self.precision.name} "
                f"({self.precision.reason})",
                *self.fast.lines()]

    def record(self) -> dict[str, Any]:
        """The choices as run.json holds them."""
        return {"device": self.device, "device_reason": self.device_reason, "cpu_threads": self.cpu_threads,
                "precision": self.precision.name, "precision_reason": self.precision.reason,
                "batch_size": self.batch_size, "batch_size_reason": self.batch_size_reason,
                "batch_fixed": self.batch_fixed, "fast_path": self.fast.reasons}


class RunInfo:
    """RUN_DIR/run.json: what was chosen and why, and the few facts the run learns as it goes (an out-of-memory
    re-split, whether the CUDA graph was used), each rewriting the file. Rank 0 writes."""

    def __init__(self, path: Path, record: dict[str, Any], *, write: bool):
        self.path, self.record, self._write = path, record, write
        self.update()

    def update(self, **facts: Any) -> None:
        self.record.update(facts)
        if self._write:
            self.path.write_text(json.dumps(self.record, indent=2) + "\n")


@dataclass(frozen=True)
class Run:
    """What the loop runs with, settled by `prepare_run`. The fields never change once it is built; the objects
    behind them do, as they train: the model, `opt` (whose step is rebuilt after an out-of-memory re-split) and
    `state`, which the checkpoints save."""

    cfg: RunConfig  # resolved: model shape from the data, batch size per device
    run_dir: RunDir
    dist: DistInfo
    device: torch.device
    choices: Choices
    data: Any  # fastddpm.data.PreparedData
    model: UNet
    schedule: NoiseSchedule
    batches: Any  # ResidentBatches | StreamingBatches (or a hook's wrapper of one)
    opt: Optimization
    state: TrainState
    checkpointer: Checkpointer
    evaluator: Any  # TrainingEvaluator | None
    steps_per_epoch: int
    total_steps: int
    info: RunInfo
    log: Console
    said: Spelling = CLI  # how the run's errors and notes name its arguments: flags, or fastddpm.train's keywords
    branched: bool = False  # a resume from before the newest checkpoint: the loggers hold the branch it leaves

    @property
    def precision(self) -> Precision:
        return self.choices.precision

    @property
    def fast(self) -> FastPath:
        return self.choices.fast

    @property
    def fsdp(self) -> bool:
        return self.dist.enabled and self.cfg.train.parallel == "fsdp"

    @property
    def images_per_step(self) -> int:  # the global batch: batch_size x accum_steps x ranks
        return self.state.global_batch

    @property
    def epochs_done(self) -> float:
        """Passes over the data as the loop makes them: steps_per_epoch full global batches each (the ragged tail
        of each pass is dropped), so --max-epochs N ends at N.0."""
        return self.state.images_seen / (self.steps_per_epoch * self.images_per_step)

    def micro_batches(self) -> list[Batch]:
        """The current step's micro-batches: a function of (seed, step) and the OOM split, like every batch."""
        return step_batches(self.batches, self.state.step, self.cfg.train.accum_steps, self.state.micro_split)

    def lr_at(self, images_seen: int) -> float:
        """Linear warm-up over warmup_images, then constant."""
        train_cfg = self.cfg.train
        if not train_cfg.warmup_images:
            return train_cfg.lr
        return train_cfg.lr * min(1.0, images_seen / train_cfg.warmup_images)


def prepare_run(cfg: RunConfig, run_dir: Path, resume: str | Path | Checkpoint | None, *, stop,
                log: Callable[..., None], hooks: TrainHooks, said: Spelling = CLI) -> Run:
    """Device and ranks, data, model shape, resumed state, model and batch size, optimisation: the run as the
    loop will see it, written to config.json and run.json and described in the log. `stop`: the loop's signal
    flag, told the process group once there is one (the long parts of the set-up stop at once: `stop.at_once`).
    `said`: how errors name the run's arguments (config.Spelling)."""
    with same_on_every_rank():  # what the config and the folder decide, before the process group exists
        _check_before_loading(cfg)
        check_loggers(cfg, run_dir)
        device, device_reason = resolve_device(cfg.train.device)
        out = said("out")
        refuse_output_among_images(cfg.data.source, run_dir, flag=out, what="its sample grids (samples/*.png)")
        created = make_writable_dir(run_dir, flag=out, fix="pass a folder that can be created and written (or a "
                                                           "run directory, to continue its run)")
    stop.folder_lock = lock = RunFolderLock(run_dir, said=said)  # rank 0's: one trainer per folder; train() frees it
    try:
        return _prepare(cfg, run_dir, resume, device, device_reason, stop=stop, log=log, hooks=hooks, said=said)
    except BaseException:  # refused in set-up (data, model, --init-from, batch): no empty run folder left behind
        lock.release()
        remove_if_empty(created)
        raise


def _prepare(cfg: RunConfig, run_dir: Path, resume: str | Path | Checkpoint | None, device: torch.device,
             device_reason: str, *, stop, log: Callable[..., None], hooks: TrainHooks, said: Spelling) -> Run:
    rd = RunDir(run_dir)
    dist, device = init_distributed(device, cfg.train.dist_timeout_s)  # under torchrun: this rank's device
    stop.dist = dist
    console = Console(log, enabled=dist.is_main)  # rank 0 speaks (and writes) for the job
    cfg, device_reason, resume = _join_ranks(cfg, dist, device, device_reason, resume, console, rd)
    fsdp = dist.enabled and cfg.train.parallel == "fsdp"
    cpu_threads = fix_cpu_threads(cfg.train.cpu_threads)[0] if device.type == "cpu" else None
    precision = resolve_precision(cfg.train.precision, device)
    if device.type == "cuda":  # TF32 for the fp32 matmuls/convs outside autocast (10-bit mantissa, fp32 range)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    with stop.at_once("preparing the dataset", console):
        data = _load_data(cfg, dist)
    cfg = _absolute_source(cfg, data)
    identity = data.identity()
    with same_on_every_rank():  # the same folder, checkpoint and data on every rank (the ranks agree on which)
        resumed = _find_resume(rd, resume, cfg, data, identity, dist, device, fsdp, console, said)
    said_on_resume = init_from_note(resumed, cfg, said) if resumed is not None else []
    untrained = _untrained_null_class(cfg)
    if untrained and resumed is None:  # a new run; one trained so before goes on, told (below)
        raise ConfigError(f"{untrained}: add {said('sample-guidance', 1)} (plain conditional), or keep a label "
                          "dropout (0.1, Ho & Salimans 2022)")
    if untrained:
        said_on_resume.append(f"note: {untrained}, so they draw from an untrained embedding; resume with "
                              f"{said('sample-guidance', 1)} for grids and evaluations that mean something")
    if resumed is not None:  # where the run's weights began, whatever a resume's --init-from says
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=resumed.config.train.init_from))
        cfg = _the_runs_class_names(cfg, resumed)
    cfg = _resolve_from_data(cfg, data)
    if resumed is None:  # a new model (`--resume latest` with no checkpoint too); a resumed run keeps its own
        check_attention_levels(cfg.model)

    fast = resolve_fast_path(cfg.train, device, precision, world_size=dist.world_size if dist.enabled else 0,
                             parallel="fsdp" if fsdp else "ddp",
                             planned_images=_planned_images(cfg, len(data.images), dist.world_size),
                             model_family=cfg.model.family)
    model, schedule = build_model(cfg, device=device, fast=fast, keep_on_cpu=fsdp)
    if cfg.train.init_from and resumed is None:  # before the EMA copies the weights
        from fastddpm.diffusers_io import load_init

        console("\n".join([load_init(model, cfg, cfg.train.init_from, said), *unconditional_init_note(cfg, said)]))
    with stop.at_once("searching for the batch size (--batch-size auto)", console):  # trial steps, nothing written
        cfg, batch_note, batch_fixed = _settle_batch_size(cfg, model, schedule, precision, data, dist, device,
                                                          console)
    train_cfg = cfg.train
    batches, placement, placement_reason = _make_batches(cfg, data, device, dist, hooks)
    steps_per_epoch = batches.steps_per_epoch // train_cfg.accum_steps
    if steps_per_epoch < 1:
        raise ConfigError(f"batch {train_cfg.batch_size} x accum_steps {train_cfg.accum_steps} is more than the "
                          f"dataset's {batches.num_images} images: lower one of them")
    images_per_step = train_cfg.batch_size * train_cfg.accum_steps * dist.world_size

    opt = Optimization(cfg, model, schedule, device=device, precision=precision, fast=fast,
                       parallel=("fsdp" if fsdp else "ddp") if dist.enabled else None)
    evaluator = None
    if train_cfg.eval_every_images:
        # Built before the clock starts: training the dataset's feature network (once, then cached) and the real
        # data's statistics are set-up, not time-to-quality. Every rank samples its share; rank 0 scores.
        from fastddpm.eval.during_training import TrainingEvaluator

        with stop.at_once("setting up --eval-every (its feature network, the real images' statistics)", console):
            evaluator = TrainingEvaluator(cfg, run_dir=run_dir, device=device, autocast_dtype=precision.autocast_dtype,
                                          log=console, rank=dist.rank, world_size=dist.world_size, said=said)
    state = TrainState(device=device, world_size=dist.world_size, global_batch=images_per_step,
                       cpu_threads=cpu_threads, data={"source": cfg.data.source, **identity})
    checkpointer = Checkpointer(run_dir, model=model, ema=opt.ema, optimizer=opt.optimizer, scaler=opt.scaler,
                                train_state=state, config=cfg.to_dict(), sharded=fsdp,
                                keep=train_cfg.keep_checkpoints, is_main=dist.is_main)
    branched = False  # whether the resume leaves a branch of later checkpoints
    if resumed is not None:
        changed = checkpointer.load(resumed)  # weights, EMA, optimizer, scaler, counters; the global RNG last
        changed += check_run_length(  # before anything in the run directory moves
            resumed, cfg, step=state.step, end_step=total_steps_for(cfg, steps_per_epoch, images_per_step,
                                                                   step=state.step, images_seen=state.images_seen),
            was_end_step=total_steps_for(resumed.config, steps_per_epoch, images_per_step, step=state.step,
                                         images_seen=state.images_seen), said=said)
        console(f"resumed from {resumed.path} at step {state.step:,} ({state.images_seen:,} images)")
        for note in [*changed, *said_on_resume, *recipe_changes(resumed, cfg), *state.resume_notes(batch_fixed)]:
            console(note)
        branched = dist.is_main and set_aside_the_abandoned(rd, checkpointer, state.step, console)
    elif dist.is_main:
        # A new run: the folder holds no checkpoint (else it is refused), but may hold the logs of a run that wrote
        # none (stopped early, or its checkpoints deleted); their steps would interleave with this run's.
        for path in (rd.metrics, rd.eval_log):
            moved = metrics.set_aside_after(path, None)
            if moved:
                console(f"{path.name}: {moved} record(s) of an earlier run in {rd.path} that wrote no checkpoint "
                        f"moved to {metrics.abandoned(path).name}")
    total_steps = total_steps_for(cfg, steps_per_epoch, images_per_step, step=state.step,
                                  images_seen=state.images_seen)
    opt.build_step(state.micro_split)  # over the final state; an earlier OOM's split is kept

    choices = Choices(device=str(device), device_reason=device_reason, cpu_threads=cpu_threads, precision=precision,
                      batch_size=train_cfg.batch_size, batch_size_reason=batch_note, batch_fixed=batch_fixed,
                      placement=placement, placement_reason=placement_reason, fast=fast)
    if dist.is_main:
        save_config(cfg, rd.config)
    info = RunInfo(rd.info, _run_record(cfg, choices, model, data, dist, images_per_step, steps_per_epoch,
                                        total_steps), write=dist.is_main)
    run = Run(cfg=cfg, run_dir=rd, dist=dist, device=device, choices=choices, data=data, model=model,
              schedule=schedule, batches=batches, opt=opt, state=state, checkpointer=checkpointer, evaluator=evaluator,
              steps_per_epoch=steps_per_epoch, total_steps=total_steps, info=info, log=console, said=said,
              branched=branched)
    _describe(run)
    return run


def total_steps_for(cfg: RunConfig, steps_per_epoch: int, images_per_step: int, *, step: int = 0,
                    images_seen: int = 0) -> int:
    """The step the run ends at, from where it is (`step`, `images_seen`: a resumed checkpoint's). --max-steps
    counts steps; --max-images and --max-epochs count images, so a run resumed at another global batch (another
    batch size or world size) trains the images still missing at its new batch: step + ceil(missing / batch)."""
    train_cfg = cfg.train
    if train_cfg.max_steps is not None:
        return train_cfg.max_steps
    if train_cfg.max_images is not None:
        target_images = train_cfg.max_images
    else:  # prepare_run checked that one length is given
        # An epoch as the loop counts it: steps_per_epoch full global batches, the ragged tail dropped. Rounded
        # before the ceiling, so that float noise in the product cannot add a step.
        target_images = math.ceil(round(train_cfg.max_epochs * steps_per_epoch * images_per_step, 6))
    return step + -(-max(0, target_images - images_seen) // images_per_step)


def _check_before_loading(cfg: RunConfig) -> None:
    """What the config alone decides, checked before the device, the data or a checkpoint is touched."""
    if all(getattr(cfg.train, name) is None for name in RUN_LENGTHS):
        raise ConfigError("say how long to train: --max-steps N, --max-images N or --max-epochs N (or pick a "
                          "--preset)")
    check_sampling_steps(cfg)


def _untrained_null_class(cfg: RunConfig) -> str | None:
    """Why a conditional run without label dropout cannot guide its grids and evaluations, or None."""
    t = cfg.train
    if cfg.model.conditional and t.cond_drop_prob == 0 and t.sample_guidance != 1:
        return (f"--cond-drop-prob 0 trains no unconditional prediction (the null class), which the grids' and "
                f"evaluations' guidance W = {t.sample_guidance:g} (--sample-guidance) mixes in")
    return None


def check_sampling_steps(cfg: RunConfig) -> None:
    """The grids' (and --eval-every's) sampler steps against what the sampler takes on this run's schedule. They
    are first used at the first grid or evaluation, hours into a run; the config cannot check them itself, since
    the limit is the diffusion math's (fastddpm.diffusion imports the config)."""
    d, train_cfg = cfg.diffusion, cfg.train
    uses = [("grids", "--sample-steps", run_sampling(cfg, "grids"))]  # a default count is capped there
    if train_cfg.eval_every_images:
        uses.append(("evaluations", "--eval-steps", run_sampling(cfg, "evaluations")))
    for what, flag, (sampler, steps) in uses:
        limit = step_limit(cfg, sampler)  # None: EDM's and flow's samplers, ancestral DDPM
        if limit is not None and steps > limit:
            start = ("" if limit == d.num_timesteps else
                     f" (it starts at timestep {limit - 1}, the noisiest whose half log-SNR is >= {LAMBDA_MIN})")
            field_name = flag[2:].replace("-", "_")
            preset = PRESETS[cfg.preset]() if cfg.preset in PRESETS else None
            # a count the preset set reads as the preset's (the flag may never have been given)
            whose = (f" (preset {cfg.preset}'s default, if the flag was not given)"
                     if preset is not None and getattr(preset.train, field_name) == steps else "")
            raise ConfigError(
                f"{flag} {steps}{whose}: the {what}' sampler {sampler} "
                f"takes at most {limit} steps on this {d.num_timesteps}-timestep {d.schedule} schedule{start}: "
                f"give {flag} {limit} or fewer, or more --num-timesteps")


def _planned_images(cfg: RunConfig, num_images: int, world: int) -> int | None:
    """The run's length in images as configured, before the batch size is settled (None: not known yet)."""
    t = cfg.train
    if t.max_images is not None:
        return t.max_images
    if t.max_steps is not None and t.global_batch_size is not None:  # it sets the per-device batch (later)
        return t.max_steps * t.global_batch_size
    if t.max_steps is not None and isinstance(t.batch_size, int):
        return t.max_steps * t.batch_size * t.accum_steps * max(1, world)
    if t.max_epochs is not None:
        return int(t.max_epochs * num_images)
    return None


def _join_ranks(cfg: RunConfig, dist: DistInfo, device: torch.device, device_reason: str, resume, log,
                run_dir: RunDir) -> tuple[RunConfig, str, Any]:
    """Under torchrun, this rank's place in the job: what FSDP rules out, no progress bar off rank 0, and a worker
    torchrun restarted resumes. Returns (cfg, device reason, resume)."""
    train_cfg = cfg.train
    if train_cfg.parallel == "fsdp" and not dist.enabled:
        launch = "`torchrun --nproc-per-node N -m fastddpm train --parallel fsdp ...` (N=1 works too)"
        if resume is not None:  # the setting may be the resumed run's own (its config.json), not a flag given now
            raise ConfigError(f"this run resumes with train.parallel=fsdp (its config.json, or --parallel), which "
                              f"shards the model across torchrun's processes and writes sharded checkpoints: resume "
                              f"it with {launch}; its ema.safetensors samples in one process")
        raise ConfigError(f"train.parallel=fsdp shards the model across torchrun's processes: launch with {launch}, "
                          f"or drop --parallel fsdp for a single-process run")
    fsdp = dist.enabled and train_cfg.parallel == "fsdp"
    if fsdp and train_cfg.batch_size == "auto":
        raise ConfigError("batch_size=auto measures a full replica of the model, which --parallel fsdp exists to "
                          "avoid: set --batch-size (per device) or --global-batch-size")
    if dist.enabled:
        device_reason += (f"; rank {dist.rank} of {dist.world_size} ({dist.backend}, "
                          f"{'FSDP2 fully_shard' if fsdp else 'DistributedDataParallel'})")
        if not dist.is_main:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(train_cfg, progress=False))
        if dist.restarted and resume is None:
            resume = "latest"
            log("torchrun restarted the workers: resuming from the newest complete checkpoint")
        elif dist.restarted and str(resume) != "latest" and saved(run_dir.checkpoints):
            # the given checkpoint again would go back to it, setting aside every step trained since
            given = resume.path if isinstance(resume, Checkpoint) else resume
            log(f"torchrun restarted the workers: resuming from the newest complete checkpoint in "
                f"{run_dir.checkpoints}" + ("" if isinstance(resume, Checkpoint) else f", not --resume {given} again"))
            resume = "latest"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # graph capture, bf16 checks and new streams use the current device
    return cfg, device_reason, resume


def _absolute_source(cfg: RunConfig, data) -> RunConfig:
    """data.source as config.json keeps it: a path made absolute (`--data imgs` typed in one folder is another
    folder, or none, to a resume or an evaluation started elsewhere); a named dataset (fashion-mnist) as named."""
    if data.meta.get("name") is not None:
        return cfg
    path = str(Path(cfg.data.source).expanduser().resolve())
    return cfg if path == cfg.data.source else dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=path))


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


def _make_batches(cfg: RunConfig, data, device: torch.device, dist: DistInfo, hooks: TrainHooks):
    """This rank's batch source, resident on the device or streamed (choose_placement says which and why).
    Returns (batches, placement, reason)."""
    train_cfg = cfg.train
    placement, reason = choose_placement(data.images, device, train_cfg.data_placement, train_cfg.device_memory_budget,
                                         world_size=dist.world_size)
    conditional = cfg.model.conditional  # the labels travel with the images, dropped to the null class at random
    batches = make_batches(data.images, placement, batch_size=train_cfg.batch_size,
                           num_timesteps=cfg.diffusion.num_timesteps, seed=train_cfg.seed, device=device,
                           continuous=cfg.diffusion.objective != "ddpm",
                           hflip=cfg.data.hflip, rank=dist.rank, world_size=dist.world_size,
                           labels=data.labels if conditional else None,
                           cond_drop_prob=train_cfg.cond_drop_prob if conditional else 0.0,
                           num_classes=cfg.model.num_classes, accum_steps=train_cfg.accum_steps)
    if hooks.wrap_batches is not None:
        batches = hooks.wrap_batches(batches)
    return batches, placement, reason


def _resolve_from_data(cfg: RunConfig, data) -> RunConfig:
    """The model's image shape and classes from the data (config.resolve_model_shape, resolve_classes)."""
    return resolve_classes(resolve_model_shape(cfg, data.images.shape, new_model=False), data.labels,
                           data.class_names, cfg.data.source)


def _find_resume(rd: RunDir, resume, cfg: RunConfig, data, identity: dict, dist: DistInfo, device: torch.device,
                 fsdp: bool, log, said: Spelling) -> Checkpoint | None:
    """The checkpoint to resume (None: a new run). Every rank looks for itself, and all must find the same one
    (2 tiny collectives); it must be in the format this run writes, of the same data and seed (checked before
    the model's shape is taken from the data: other data would otherwise be blamed on a model setting) and of the
    same architecture."""
    resumed = find_resume(rd.path, resume)
    held = saved(rd.checkpoints)
    if resume is None and held:
        raise ConfigError(
            f"{rd.path} already holds a run's checkpoints (steps {step_of(held[0]):,} to {step_of(held[-1]):,} in "
            f"{rd.checkpoints}), which a new run there would mix with its own: continue that run with "
            f"{said('resume', 'latest')}, or start the new one in another {said('out')} (or delete {rd.checkpoints} "
            "first)")
    if resumed is not None and held and rd.checkpoints.resolve() not in resumed.path.resolve().parents:
        # (a checkpoint of this run, set aside with an abandoned branch included: going back to that branch)
        raise ConfigError(
            f"{said('resume', str(resumed.path))} is another run's checkpoint, and {rd.path} already holds a run's "
            f"checkpoints (steps {step_of(held[0]):,} to {step_of(held[-1]):,}): the two runs' checkpoints would mix. "
            f"Continue it into a new {said('out')}, or resume the run in {rd.path} with {said('resume', 'latest')}")
    if str(resume) == "latest" and resumed is None:
        log(f"{said('resume', 'latest')}: no checkpoint in {rd.checkpoints} yet, starting a new run")
    if dist.enabled:
        found_step = resumed.step if resumed is not None else -1
        lowest, highest = -any_rank(-found_step, dist, device), any_rank(found_step, dist, device)
        if lowest != highest:
            raise ConfigError(
                f"the ranks found different checkpoints to resume in {rd.path} (steps {lowest} to {highest}; -1 = "
                f"none): every rank must see the same run directory, so put {said('out')} on a filesystem all nodes "
                "share")
    if resumed is not None:
        resumed.check_resumable(sharded_run=fsdp)
        check_same_inputs(resumed, cfg, identity, log, said)
        check_same_architecture(resolve_model_shape(resumed.config, data.images.shape, new_model=False),
                                _resolve_from_data(_the_runs_class_names(cfg, resumed), data), resumed.path, said)
    return resumed


def _the_runs_class_names(cfg: RunConfig, resumed: Checkpoint) -> RunConfig:
    """A resume given no class names keeps the run's: names given by --class-names to data that only numbers
    its classes are the run's own, also where a resume's --preset starts from a config without them."""
    names = resumed.config.model.class_names
    if cfg.model.class_names or not names:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, class_names=names))


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
    # The largest batch the data fills: every rank's shard holds accum_steps micro-batches of it (one step)
    limit = data.images.shape[0] // (world * train_cfg.accum_steps)
    if limit < 1:
        raise ConfigError(
            f"batch_size=auto: the dataset has {data.images.shape[0]} images, fewer than accum_steps="
            f"{train_cfg.accum_steps} x {world} rank(s), so not even a batch of 1 fills one step: lower "
            f"--accum-steps, or use more images")
    log("batch size: searching for the throughput knee (uncompiled copy of the model, state untouched)")
    trial = make_trial_fn(model, schedule, cfg.diffusion.prediction, precision,
                          image_shape=tuple(data.images.shape[1:]), device=device)
    best, trials = find_batch_size(trial, limit=min(8192, limit), log=log)
    best = -any_rank(-best, dist, device)  # every rank takes the smallest knee: one static shape for all
    note = "auto: " + ", ".join(f"{tr.batch_size}: " + (f"{tr.images_per_s:,.0f} img/s" if tr.images_per_s else "OOM")
                                for tr in trials) + f" -> {best}"
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trials' cached blocks would make the data look like it doesn't fit
    return dataclasses.replace(cfg, train=dataclasses.replace(train_cfg, batch_size=best)), note, "per device"


def _run_record(cfg: RunConfig, choices: Choices, model: UNet, data, dist: DistInfo, images_per_step: int,
                steps_per_epoch: int, total_steps: int) -> dict[str, Any]:
    """What run.json records: the software, every choice set-up made and why, and the run's size."""
    train_cfg = cfg.train
    return {
        "fastddpm": fastddpm.__version__, "torch": torch.__version__, "python": platform.python_version(),
        **choices.record(), "parameters": count_parameters(model),
        "data": {"source": cfg.data.source, "cache": str(data.cache_path), "shape": list(data.images.shape),
                 "placement": choices.placement, "placement_reason": choices.placement_reason},
        "accum_steps": train_cfg.accum_steps, "world_size": dist.world_size, "global_batch": images_per_step,
        "parallel": train_cfg.parallel if dist.enabled else None, "grad_checkpointing": train_cfg.grad_checkpointing,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, "command": sys.argv,
        # `auto` resolved for the objective (config.json keeps "auto"): the samplers this run's grids and
        # --eval-every use, as [sampler, steps]
        "grid_sampling": list(run_sampling(cfg, "grids")), "eval_sampling": list(run_sampling(cfg, "evaluations")),
    }


def _describe(run: Run) -> None:
    """The run's choices, one line each, as run.json records them."""
    cfg, info, log = run.cfg, run.info.record, run.log
    n = cfg.model.num_classes
    classes = f", conditional on {n} class{'es' if n != 1 else ''}" if cfg.model.conditional else ""
    log(f"model: U-Net, {info['parameters']:,} parameters{classes} ({cfg.preset or 'custom'} preset)")
    count = run.data.images.shape[0]
    log(f"data: {count:,} image{'s' if count != 1 else ''} {tuple(run.data.images.shape[1:])} from {cfg.data.source}; "
        f"placement {run.choices.placement} ({run.choices.placement_reason})")
    for line in run.choices.lines(run.dist.world_size, run.images_per_step, cfg.train.accum_steps,
                                  run.steps_per_epoch):
        log(line)
    (grid, grid_steps), t = run_sampling(cfg, "grids"), cfg.train
    guided = f", guided at W = {t.sample_guidance:g}" if cfg.guided(t.sample_guidance) else ""
    log(f"grids: {grid} {grid_steps} steps" + (f" (sampler auto: the {cfg.diffusion.objective} objective's{guided})"
                                               if t.sampler == "auto" else ""))
    state = run.state
    end_images = state.images_seen + max(0, run.total_steps - state.step) * run.images_per_step
    log(f"training to step {run.total_steps:,} ({end_images:,} images); run dir {run.run_dir.path}")
