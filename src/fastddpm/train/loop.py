"""The training loop, top to bottom: set up, then while {step, log, sample, checkpoint, stop?}.

Progress is counted in steps and images seen. Every step's data order, timesteps and noise are functions of
(seed, step) (fastddpm.rng), and all mutable state is in state_dict() objects saved by each checkpoint, so a
resumed run reproduces the uninterrupted one exactly. The only host syncs are on logging steps, labelled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import fastddpm
from fastddpm.config import ConfigError, RunConfig, from_dict, save_config
from fastddpm.diffusion import sample, schedule_from_config, to_uint8
from fastddpm.grid import save_grid
from fastddpm.models import UNet, count_parameters
from fastddpm.rng import derive_seed
from fastddpm.train.batch_finder import find_batch_size, is_oom, make_trial_fn
from fastddpm.train.batches import choose_placement, make_batches
from fastddpm.train.checkpoint import (
    CheckpointError,
    clean_state_dict,
    export_safetensors,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    load_model_state,
    portable_optimizer_state,
    save_checkpoint,
)
from fastddpm.train.metrics import MetricsLog
from fastddpm.train.compile_counters import CompileCounters
from fastddpm.train.distributed import SINGLE, any_rank, barrier, init_distributed, mean_across_ranks, shutdown
from fastddpm.train.runtime import resolve_device, resolve_fast_path, resolve_precision
from fastddpm.train.setup import build_model, build_optimization, make_train_step

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
    after_step: Callable[[int], None] | None = None  # called with the finished step number, on the host
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


def resolve_model_shape(cfg: RunConfig, images_NCHW_shape: tuple[int, ...]) -> RunConfig:
    """Fill model.image_channels / image_size from the data, or check the ones the user set."""
    _, c, h, w = images_NCHW_shape
    if h != w:
        raise ConfigError(f"the data's images are {h}x{w}; the U-Net wants square images: use --resize N")
    m = cfg.model
    for name, have in (("image_channels", c), ("image_size", h)):
        want = getattr(m, name)
        if want is not None and want != have:
            raise ConfigError(
                f"model.{name}={want} but the data has {have}: drop the setting (it comes from the data) "
                + ("or use --resize" if name == "image_size" else "or use --image-mode L|RGB")
            )
    model = dataclasses.replace(m, image_channels=c, image_size=h)
    model.validate_resolved()
    return dataclasses.replace(cfg, model=model)


def check_same_architecture(saved: RunConfig, current: RunConfig, path: Path) -> None:
    """Resuming with a different model or diffusion process cannot be exact: name the field that changed."""
    for section in ("model", "diffusion"):
        a, b = dataclasses.asdict(getattr(saved, section)), dataclasses.asdict(getattr(current, section))
        for key in a:
            if a[key] != b[key]:
                raise ConfigError(
                    f"cannot resume from {path}: {section}.{key} was {a[key]!r} in the checkpoint but is {b[key]!r} "
                    f"now; drop the change, or start a new run directory"
                )


def total_steps_for(cfg: RunConfig, steps_per_epoch: int, images_per_step: int | None = None) -> int:
    t = cfg.train
    if t.max_steps is not None:
        return t.max_steps
    if t.max_images is not None:
        return math.ceil(t.max_images / (images_per_step or t.batch_size))
    if t.max_epochs is not None:
        return math.ceil(t.max_epochs * steps_per_epoch)
    raise ConfigError("say how long to train: --max-steps N, --max-images N or --max-epochs N (or pick a --preset)")


def resolve_resume(resume: str | None, run_dir: Path) -> tuple[Path, dict] | None:
    """`latest` = the newest checkpoint in RUN_DIR that verifies (None if there is none yet); else a path."""
    if resume is None:
        return None
    if resume == "latest":
        return _newest(run_dir / "checkpoints")
    path = Path(resume)
    if path.is_dir() and path.suffix == ".dcp":  # one sharded (FSDP) checkpoint
        from fastddpm.train.fsdp import read_meta

        return path, read_meta(path)
    if path.is_dir():  # a run directory
        found = _newest(path / "checkpoints")
        if found is None:
            raise CheckpointError(f"no usable checkpoint in {path / 'checkpoints'}")
        return found
    return path, load_checkpoint(path)


def _saved_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Every complete checkpoint, .pt files and sharded .dcp directories, oldest first."""
    from fastddpm.train.fsdp import list_sharded

    return sorted(list_checkpoints(ckpt_dir) + list_sharded(ckpt_dir), key=lambda p: int(p.stem.split("_")[1]))


def _newest(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest usable checkpoint: a .pt file, or a sharded .dcp directory of an FSDP run (its metadata only;
    the shards are read once the model is sharded)."""
    from fastddpm.train.fsdp import latest_sharded

    found = [f for f in (load_latest(ckpt_dir), latest_sharded(ckpt_dir)) if f is not None]
    return max(found, key=lambda f: int(f[1]["step"])) if found else None


def split_batch(b, parts: int) -> list:
    """A batch cut into `parts` equal micro-batches (views: the same images, timesteps and noise)."""
    from fastddpm.train.batches import Batch

    return [Batch(x0=x, t=t, noise=n, indices=i) for x, t, n, i in
            zip(b.x0.chunk(parts), b.t.chunk(parts), b.noise.chunk(parts), b.indices.chunk(parts))]


def _split_after_oom(split: int, batch_size: int, step: int, dist, device: torch.device, log) -> int:
    """Out of memory in a step: twice as many micro-batches of half the size, or a clear stop at the minimum."""
    if dist.enabled:
        raise ConfigError(
            f"out of memory at step {step + 1:,} on rank {dist.rank} with micro-batches of {batch_size // split}: "
            f"under torchrun the ranks cannot re-plan alone; restart with a smaller --batch-size (or "
            f"--accum-steps {2 * split} with half the batch) and --resume latest")
    new = split * 2
    if batch_size // split == 1:
        raise ConfigError(
            f"out of memory at step {step + 1:,} even with micro-batches of 1 image: turn on --grad-checkpointing, "
            f"train a smaller model, lower --precision to bf16, or free device memory")
    if batch_size % new:
        raise ConfigError(
            f"out of memory at step {step + 1:,} with micro-batches of {batch_size // split} images, which cannot be "
            f"halved evenly: use a --batch-size divisible by {new}, turn on --grad-checkpointing, or free device "
            f"memory (a smaller --device-memory-budget keeps less data on the GPU)")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"out of memory at step {step + 1:,} with micro-batches of {batch_size // split}: continuing with "
        f"{new} micro-batches of {batch_size // new} per batch (gradient accumulation; the global batch, the data "
        f"and the result are unchanged, the step is slower)")
    return new


def write_grid(ema_model, schedule, cfg: RunConfig, device, precision, path: Path, save: bool = True) -> Path | None:
    """Sample a grid from the EMA weights with a fixed seed, so grids over a run are comparable. `save=False`:
    sample only (an FSDP rank other than 0 takes part in the all-gathers; rank 0 writes)."""
    m = cfg.model
    shape = (cfg.train.num_sample_images, m.image_channels, m.image_size, m.image_size)
    x = sample(ema_model, schedule, shape, sampler=cfg.train.sampler, steps=cfg.train.sample_steps,
               prediction=cfg.diffusion.prediction, seed=derive_seed(cfg.train.seed, "grid"), device=device,
               autocast_dtype=precision.autocast_dtype)
    if hasattr(ema_model, "reshard"):
        # FSDP keeps the root module's gathered weights after a forward (it expects a backward next): free them,
        # or the next grid would run on this grid's copy instead of re-gathering the updated EMA shards.
        ema_model.reshard()
    if not save:
        return None
    scale = max(1, 128 // m.image_size)  # 28x28 digits are too small to judge at 1x
    return save_grid(to_uint8(x).cpu().numpy(), path, scale=min(scale, 4))


def train(cfg: RunConfig, *, out_dir: str | Path, resume: str | tuple[Path, dict] | None = None,
          log=print, hooks: TrainHooks | None = None) -> TrainResult:
    """Train per `cfg` into `out_dir`. `resume`: "latest", a checkpoint path, a run directory, or an already
    loaded (path, state) pair (what resolve_resume returns). SIGTERM/SIGINT at any point, set-up included,
    end the run after the current step with a checkpoint (TrainingInterrupted, exit code 143 / 130)."""
    with _StopFlag() as stop:
        try:
            return _train(cfg, out_dir=out_dir, resume=resume, log=log, stop=stop, hooks=hooks or TrainHooks())
        finally:
            shutdown(stop.dist)


def _train(cfg: RunConfig, *, out_dir: str | Path, resume, log, stop: _StopFlag, hooks: TrainHooks) -> TrainResult:
    from fastddpm.data import prepare

    # ------------------------------------------------------------------ set-up
    run_dir = Path(out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device, device_reason = resolve_device(cfg.train.device)
    dist, device = init_distributed(device, cfg.train.dist_timeout_s)  # under torchrun: this rank's device
    stop.dist = dist
    world = dist.world_size
    fsdp = dist.enabled and cfg.train.parallel == "fsdp"
    if cfg.train.parallel == "fsdp" and not dist.enabled:
        raise ConfigError("train.parallel=fsdp shards the model across torchrun's processes: launch with "
                          "`torchrun --nproc-per-node N -m fastddpm train --parallel fsdp ...` (N=1 works too), or "
                          "drop --parallel fsdp for a single-process run")
    if fsdp and cfg.train.eval_every_images:
        raise ConfigError("--eval-every is not supported with --parallel fsdp yet (evaluation runs on rank 0 alone "
                          "and cannot all-gather the sharded EMA): evaluate the run's ema.safetensors afterwards "
                          "with `fastddpm eval --checkpoint RUN_DIR/ema.safetensors`")
    if fsdp and cfg.train.batch_size == "auto":
        raise ConfigError("batch_size=auto measures a full replica of the model, which --parallel fsdp exists to "
                          "avoid: set --batch-size (per device) or --global-batch-size")
    if dist.enabled:
        device_reason += (f"; rank {dist.rank} of {world} ({dist.backend}, "
                          f"{'FSDP2 fully_shard' if fsdp else 'DistributedDataParallel'})")
        if not dist.is_main:  # rank 0 speaks (and writes) for the job
            log = _quiet
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, progress=False))
        if dist.restarted and resume is None:
            resume = "latest"
            log("torchrun restarted the workers: resuming from the newest complete checkpoint")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # graph capture, bf16 checks and new streams use the current device
    precision = resolve_precision(cfg.train.precision, device)
    if device.type == "cuda":
        # TF32 for the fp32 matmuls/convs that remain outside autocast (10-bit mantissa, fp32 range).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    if not dist.is_main:
        barrier(dist)  # rank 0 builds the uint8 cache first; the others then read it
    data = prepare(cfg.data.source, split=cfg.data.split, resize=cfg.data.resize, resize_mode=cfg.data.resize_mode,
                   image_mode=cfg.data.image_mode, skip_bad=cfg.data.skip_bad,
                   cache_dir=Path(cfg.data.cache_dir) if cfg.data.cache_dir else None, progress=cfg.train.progress)
    if dist.enabled and dist.is_main:
        barrier(dist)
    cfg = resolve_model_shape(cfg, data.images.shape)

    resumed = resume if isinstance(resume, tuple) else resolve_resume(resume, run_dir)
    if resume == "latest" and resumed is None:
        log(f"--resume latest: no checkpoint in {run_dir / 'checkpoints'} yet, starting a new run")
    if dist.enabled:  # each rank looked for itself: they must have found the same checkpoint (2 tiny collectives)
        found_step = int(resumed[1]["step"]) if resumed is not None else -1
        lowest, highest = -any_rank(-found_step, dist, device), any_rank(found_step, dist, device)
        if lowest != highest:
            raise ConfigError(
                f"the ranks found different checkpoints to resume in {run_dir} (steps {lowest} to {highest}; -1 = "
                f"none): every rank must see the same run directory, so put --out on a filesystem all nodes share")
    if resumed is not None:
        check_same_architecture(resolve_model_shape(from_dict(resumed[1]["config"]), data.images.shape), cfg,
                                resumed[0])

    t = cfg.train
    fast = resolve_fast_path(t, device, precision, world_size=world if dist.enabled else 0,
                             parallel="fsdp" if fsdp else "ddp")
    model, schedule = build_model(cfg, device=device, fast=fast, keep_on_cpu=fsdp)
    image_shape = tuple(data.images.shape[1:])

    batch_note = "requested"
    batch_fixed = "per device"
    if t.global_batch_size is not None:
        per_device, rest = divmod(t.global_batch_size, t.accum_steps * world)
        if t.batch_size == "auto" or rest or per_device < 1:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of accum_steps={t.accum_steps} x "
                f"{world} rank(s) = {t.accum_steps * world}, and cannot be combined with batch_size=auto: pick a "
                f"multiple, or fix the per-device --batch-size instead")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, batch_size=per_device))
        t = cfg.train
        batch_fixed, batch_note = "global", f"global batch {t.global_batch_size} / ({t.accum_steps} x {world})"
    if t.batch_size == "auto":
        log("batch size: searching for the throughput knee (uncompiled copy of the model, state untouched)")
        trial = make_trial_fn(model, schedule, cfg.diffusion.prediction, precision, image_shape=image_shape,
                              device=device)
        best, trials = find_batch_size(trial, limit=min(8192, data.images.shape[0] // world), log=log)
        best = -any_rank(-best, dist, device)  # every rank takes the smallest knee: one static shape for all
        batch_note = "auto: " + ", ".join(f"{tr.batch_size}: " + (f"{tr.images_per_s:,.0f} img/s" if tr.images_per_s
                                          else "OOM") for tr in trials) + f" -> {best}"
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, batch_size=best))
        t = cfg.train
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the trials' cached blocks would make the data look like it doesn't fit

    placement, placement_reason = choose_placement(data.images, device, t.data_placement, t.device_memory_budget,
                                                   world_size=world)
    batches = make_batches(data.images, placement, batch_size=t.batch_size, num_timesteps=cfg.diffusion.num_timesteps,
                           seed=t.seed, device=device, hflip=cfg.data.hflip, rank=dist.rank, world_size=world)
    if hooks.wrap_batches is not None:
        batches = hooks.wrap_batches(batches)
    images_per_step = t.batch_size * t.accum_steps * world  # the global batch
    steps_per_epoch = batches.steps_per_epoch // t.accum_steps
    if steps_per_epoch < 1:
        raise ConfigError(f"batch {t.batch_size} x accum_steps {t.accum_steps} is more than the dataset's "
                          f"{batches.num_images} images: lower one of them")
    total_steps = total_steps_for(cfg, steps_per_epoch, images_per_step)

    step, images_seen = 0, 0
    opt = build_optimization(cfg, model, schedule, device=device, precision=precision, fast=fast,
                             resume_state=resumed[1] if resumed is not None else None,
                             ddp=dist.enabled and not fsdp, fsdp=fsdp)
    ema, optimizer, scaler, train_step_fn = opt.ema, opt.optimizer, opt.scaler, opt.step_fn
    # After an out-of-memory step each batch is cut into `micro_split` equal micro-batches (accumulation): the
    # same images, timesteps and noise per step, so the global batch and the run's data are unchanged.
    micro_split = int(resumed[1].get("micro_split", 1)) if resumed is not None else 1
    if micro_split > 1:
        train_step_fn = make_train_step(cfg, model, schedule, optimizer=optimizer, scaler=scaler, ema=ema,
                                        device=device, precision=precision, fast=fast,
                                        accum_steps=t.accum_steps * micro_split,
                                        forward_model=train_step_fn.forward_model if dist.enabled else None)
    evaluator = None
    if t.eval_every_images and dist.is_main:
        # Built before the clock starts: training the dataset's feature network (once, then cached) and the real
        # data's statistics are set-up, not time-to-quality.
        from fastddpm.eval.during_training import TrainingEvaluator

        evaluator = TrainingEvaluator(cfg, run_dir=run_dir, device=device, autocast_dtype=precision.autocast_dtype,
                                      log=log)
    if resumed is not None:
        path, state = resumed
        torch.set_rng_state(state["rng"]["torch_cpu"])
        if device.type == "cuda" and state["rng"].get("torch_cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["torch_cuda"], device)
        step, images_seen = int(state["step"]), int(state["images_seen"])
        log(f"resumed from {path} at step {step:,} ({images_seen:,} images)")
        saved_world = int(state.get("world_size", 1))
        if saved_world != world:
            saved_batch = state.get("global_batch")
            log(f"note: the checkpoint was written by {saved_world} rank{'s' if saved_world > 1 else ''}, this run has "
                f"{world}: the global batch is {images_per_step} (was {saved_batch}; "
                + ("kept, --global-batch-size is fixed" if batch_fixed == "global" else
                   "per-device batch fixed; set --global-batch-size to keep the global one")
                + "), and the data order from here differs from an uninterrupted run")

    if dist.is_main:
        save_config(cfg, run_dir / "config.json")
    run_info = {
        "fastddpm": fastddpm.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "device": str(device), "device_reason": device_reason, "precision": precision.name,
        "precision_reason": precision.reason, "parameters": count_parameters(model),
        "data": {"source": cfg.data.source, "cache": str(data.cache_path), "shape": list(data.images.shape),
                 "placement": placement, "placement_reason": placement_reason},
        "batch_size": t.batch_size, "batch_size_reason": batch_note, "accum_steps": t.accum_steps,
        "world_size": world, "global_batch": images_per_step, "batch_fixed": batch_fixed,
        "parallel": ("fsdp" if fsdp else "ddp") if dist.enabled else None,
        "fast_path": fast.reasons, "grad_checkpointing": t.grad_checkpointing,
        "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, "command": sys.argv,
    }
    if dist.is_main:
        (run_dir / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
    log(f"model: U-Net, {count_parameters(model):,} parameters ({cfg.preset or 'custom'} preset)")
    log(f"data: {data.images.shape[0]:,} images {image_shape} from {cfg.data.source}; placement {placement} "
        f"({placement_reason})")
    log(f"batch: {t.batch_size} x {t.accum_steps} accumulation" + (f" x {world} ranks" if world > 1 else "")
        + f" = {images_per_step} images/step ({batch_note}); {steps_per_epoch:,} steps/epoch")
    log(f"device: {device} ({device_reason}); precision: {precision.name} ({precision.reason})")
    for line in fast.lines():
        log(line)
    log(f"training to step {total_steps:,} ({total_steps * images_per_step:,} images); run dir {run_dir}")

    def checkpoint_state() -> dict:
        if fsdp:  # the tensors go to the shards (write_checkpoint); this is the metadata
            weights = {}
        else:
            weights = {"model": clean_state_dict(model.state_dict()), "ema": clean_state_dict(ema.state_dict()),
                       "optimizer": portable_optimizer_state(optimizer)}
        return {
            **weights, "scaler": scaler.state_dict() if scaler is not None else None,
            "step": step, "images_seen": images_seen, "config": cfg.to_dict(),
            "world_size": world, "global_batch": images_per_step, "micro_split": micro_split,
            "rng": {"torch_cpu": torch.get_rng_state(),
                    "torch_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
        }

    def write_checkpoint() -> Path | None:
        """Rank 0 writes (the state is the same on every rank); the others return None at once. Under FSDP every
        rank writes its shards, and rank 0 the metadata and the EMA's full weights."""
        if fsdp:
            from fastddpm.train.fsdp import full_state_dict, save_sharded

            meta = {k: v for k, v in checkpoint_state().items() if k not in ("model", "ema", "optimizer")}
            path = save_sharded(run_dir / "checkpoints", step, model=model, ema_model=ema.model, optimizer=optimizer,
                                meta=meta, is_main=dist.is_main, keep=t.keep_checkpoints)
            ema_full = full_state_dict(ema.model)  # a collective: the full weights land on rank 0
            if dist.is_main:
                export_safetensors(ema_full, run_dir / "ema.safetensors",
                                   {"config": cfg.to_dict(), "step": step, "images_seen": images_seen,
                                    "format": "fastddpm-ema-1"})
            return path  # on every rank: the loop's "was a checkpoint written" must agree across ranks
        if not dist.is_main:
            return None
        path = save_checkpoint(run_dir / "checkpoints", step, checkpoint_state(), keep=t.keep_checkpoints)
        export_safetensors(clean_state_dict(ema.state_dict()), run_dir / "ema.safetensors",
                           {"config": cfg.to_dict(), "step": step, "images_seen": images_seen,
                            "format": "fastddpm-ema-1"})
        return path

    # ------------------------------------------------------------------ loop
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    compile_counters = CompileCounters(enabled=fast.compile)
    loss_sum = torch.zeros((), device=device)  # accumulated on the device: no sync per step
    loss_count = 0
    last_loss: float | None = None
    last_ckpt: Path | None = None
    last_grid: Path | None = None
    t_log, images_at_log = time.perf_counter(), images_seen
    t_start = t_log
    bar = None
    if t.progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, leave=True)
        log = bar.write
        if evaluator is not None:
            evaluator.log = log

    while step < total_steps:
        micro = [batches.get(step * t.accum_steps + k) for k in range(t.accum_steps)]
        if micro_split > 1:
            micro = [part for b in micro for part in split_batch(b, micro_split)]
        lr = t.lr * min(1.0, (images_seen + images_per_step) / t.warmup_images) if t.warmup_images else t.lr
        try:
            loss = train_step_fn(micro, lr=lr, step=step)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is handled; the rest re-raise
            if not is_oom(e):
                raise
            del micro, e  # drop the failed step's activations before trying again
            micro_split = _split_after_oom(micro_split, t.batch_size, step, dist, device, log)
            train_step_fn = make_train_step(cfg, model, schedule, optimizer=optimizer, scaler=scaler, ema=ema,
                                            device=device, precision=precision, fast=fast,
                                            accum_steps=t.accum_steps * micro_split)
            run_info["micro_split"] = micro_split
            if dist.is_main:
                (run_dir / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
            continue  # the same step again: nothing was updated (the update and EMA come after the backward)
        loss_sum += loss
        loss_count += 1
        step += 1
        images_seen += images_per_step
        if step == min(total_steps, 3):
            compile_counters.mark_warm()
        if hooks.after_step is not None:
            hooks.after_step(step)

        logging_step = step % t.log_every == 0 or step == total_steps
        stop_code = stop.exit_code
        if dist.enabled:  # every rank stops at the same step: agree on it (a collective; on a GPU only when logging)
            stop_code = any_rank(stop_code or 0, dist, device) or None if (
                logging_step or device.type == "cpu") else None
        if logging_step or device.type == "cpu":  # on a CPU the check costs nothing: stop at once
            bad = train_step_fn.first_bad_step()  # note: host-device sync, on logging steps only
            if bad is not None:
                if bar is not None:
                    bar.close()
                saved = _saved_checkpoints(run_dir / "checkpoints")
                last_ckpt = saved[-1] if saved else None
                raise FloatingPointError(
                    f"the loss or the gradients became NaN/Inf at step {bad + 1:,}; that step's update and all "
                    f"later ones were skipped, so the weights and EMA keep their values from step {bad:,}. "
                    f"Try a lower --lr (now {t.lr:g}), keep --grad-clip on, or --precision fp32/bf16 instead "
                    f"of fp16; then resume from the last checkpoint with --resume latest ({last_ckpt or 'none'})"
                )
            # fp16: the GradScaler skips an overflowing step and halves its scale; that is routine. A scale below
            # 1 means the gradients overflow even unscaled: a diverged run that would otherwise skip every step
            # silently from here on.
            if scaler is not None and scaler.get_scale() < 1.0:  # note: host-device sync, as above
                if bar is not None:
                    bar.close()
                saved = _saved_checkpoints(run_dir / "checkpoints")
                raise FloatingPointError(
                    f"the fp16 loss scale fell to {scaler.get_scale():.3g} by step {step:,}: the gradients are "
                    f"NaN/Inf at every scale, so every recent step was skipped (not an fp16 overflow). Try "
                    f"--precision bf16 or fp32, or a lower --lr (now {t.lr:g}); then resume from the last checkpoint "
                    f"with --resume latest ({saved[-1] if saved else 'none'})"
                )
        if logging_step:
            mean_across_ranks(loss_sum, dist)
            last_loss = loss_sum.item() / loss_count  # note: host-device sync, on logging steps only
            now = time.perf_counter()
            img_per_s = (images_seen - images_at_log) / max(now - t_log, 1e-9)
            metrics.write({"step": step, "images_seen": images_seen, "epoch": images_seen / data.images.shape[0],
                           "loss": last_loss, "images_per_s": img_per_s, "lr": lr,
                           "wall_s": now - t_start, **compile_counters.report(),
                           **({"loss_scale": scaler.get_scale()} if scaler is not None else {})})
            if bar is not None:
                bar.set_postfix(loss=f"{last_loss:.4f}", img_s=f"{img_per_s:,.0f}", refresh=False)
            loss_sum.zero_()
            loss_count = 0
            t_log, images_at_log = now, images_seen
        if bar is not None:
            bar.update(1)

        done = step == total_steps
        # (Under FSDP every rank samples: each block's forward all-gathers its shards. Rank 0 writes.)
        if (dist.is_main or fsdp) and t.sample_every_images and not done and (
                images_seen // t.sample_every_images > (images_seen - images_per_step) // t.sample_every_images):
            last_grid = write_grid(ema.model, schedule, cfg, device, precision,
                                   run_dir / "samples" / f"grid_{images_seen:09d}.png", save=dist.is_main)
            log(f"step {step:,}: wrote {last_grid}")
        if evaluator is not None and stop_code is None and (done or evaluator.due(images_seen, images_per_step)):
            eval_s = evaluator.run(ema.model, step=step, images_seen=images_seen,
                                   epoch=images_seen / data.images.shape[0], t_start=t_start, metrics=metrics)
            t_start += eval_s  # evaluation is not training: keep it out of wall_s and images_per_s
            t_log += eval_s
        if done or (t.checkpoint_every and step % t.checkpoint_every == 0) or stop_code is not None:
            last_ckpt = write_checkpoint()
        if stop_code is not None:
            barrier(dist)  # no rank exits (and makes torchrun kill the others) before rank 0 has written
            if bar is not None:
                bar.close()
            log(f"stopped by signal at step {step:,}; checkpoint {last_ckpt}; resume with --resume latest")
            raise TrainingInterrupted(stop_code, last_ckpt)

    if bar is not None:
        bar.close()
    if last_ckpt is None:  # resumed at or past the end: nothing trained, still leave weights and a grid
        last_ckpt = write_checkpoint()
    stop_code = any_rank(stop.exit_code or 0, dist, device) or None
    if stop_code is not None:  # a signal after the last step: the checkpoint is written, skip the grid
        barrier(dist)
        log(f"stopped by signal after the last step; checkpoint {last_ckpt}")
        raise TrainingInterrupted(stop_code, last_ckpt)
    if hooks.final_outputs and (dist.is_main or fsdp):
        last_grid = write_grid(ema.model, schedule, cfg, device, precision, run_dir / "samples" / "final.png",
                               save=dist.is_main)
    if fast.compile:
        log(f"compile: {compile_counters.report()}")
    if fast.cuda_graphs == "capture":
        run_info["cuda_graphs_used"] = train_step_fn.graph is not None
        run_info["cuda_graphs_failure"] = train_step_fn.graph_failed
        if dist.is_main:
            (run_dir / "run.json").write_text(json.dumps(run_info, indent=2) + "\n")
        if train_step_fn.graph_failed:
            log(f"cuda graphs: not used ({train_step_fn.graph_failed})")
    log(f"done: step {step:,}, {images_seen:,} images, loss {last_loss}; grid {last_grid}; "
        f"weights {run_dir / 'ema.safetensors'}")
    return TrainResult(run_dir=run_dir, step=step, images_seen=images_seen, last_loss=last_loss,
                       checkpoint=last_ckpt, grid=last_grid)


def load_for_sampling(path: str | Path, device: torch.device | str = "cpu", weights: str = "ema"):
    """Load a model from a checkpoint (.pt, or an FSDP run's sharded .dcp directory), an ema.safetensors export,
    or a run directory.
    Returns (model in eval mode, RunConfig)."""
    from fastddpm.train.checkpoint import load_safetensors

    path = Path(path)
    if path.is_dir() and path.suffix != ".dcp":  # a run directory
        found = _newest(path / "checkpoints")
        if found is not None and found[1].get("sharded") and weights == "ema" and (path / "ema.safetensors").is_file():
            found = None  # an FSDP run: its gathered EMA export is the cheap read
        if found is None:
            st = path / "ema.safetensors"
            if not st.is_file():
                raise CheckpointError(f"{path} holds no checkpoint and no ema.safetensors")
            path = st
        else:
            path = found[0]
    if path.is_dir() and path.suffix == ".dcp":  # a sharded checkpoint of an FSDP run, gathered here
        from fastddpm.train.fsdp import read_sharded_checkpoint

        state = read_sharded_checkpoint(path)
        cfg = from_dict(state["config"])
        model = UNet(cfg.model)
        load_model_state(model, state["ema" if weights == "ema" else "model"], what=f"{path} ({weights} weights)")
        return model.to(device).eval(), cfg
    if path.suffix == ".safetensors":
        if weights != "ema":
            raise CheckpointError(f"{path} holds only the EMA weights; use --weights ema or pass a .pt checkpoint")
        state_dict, meta = load_safetensors(path)
        if "config" not in meta:
            raise CheckpointError(f"{path} has no fastddpm config in its metadata; it was not written by fastddpm")
        cfg = from_dict(json.loads(meta["config"]))
    else:
        state = load_checkpoint(path)
        cfg = from_dict(state["config"])
        state_dict = state["ema" if weights == "ema" else "model"]
    model = UNet(cfg.model)
    load_model_state(model, state_dict, what=f"{path} ({weights} weights)")
    return model.to(device).eval(), cfg


def sample_to_files(model, cfg: RunConfig, *, num_images: int, sampler: str, steps: int, eta: float, seed: int,
                    batch_size: int, device, out_grid: Path, out_npz: Path | None, precision: str = "auto",
                    progress: bool = True) -> np.ndarray:
    """Sample `num_images` in batches; write a PNG grid (up to 256 images) and an .npz of uint8 (N, C, H, W)."""
    device = torch.device(device)
    prec = resolve_precision(precision, device)
    schedule = schedule_from_config(cfg.diffusion)
    m = cfg.model
    chunks = []
    bar = None
    if progress:
        from tqdm import tqdm

        per_batch = cfg.diffusion.num_timesteps if sampler == "ddpm" else steps
        bar = tqdm(total=math.ceil(num_images / batch_size) * per_batch, unit="model-call", dynamic_ncols=True)
    for i, start in enumerate(range(0, num_images, batch_size)):
        n = min(batch_size, num_images - start)
        x = sample(model, schedule, (n, m.image_channels, m.image_size, m.image_size), sampler=sampler,
                   steps=steps, eta=eta, prediction=cfg.diffusion.prediction, seed=derive_seed(seed, "sample", i),
                   device=device, autocast_dtype=prec.autocast_dtype, progress=bar)
        chunks.append(to_uint8(x).cpu().numpy())
    if bar is not None:
        bar.close()
    images = np.concatenate(chunks)
    save_grid(images[:256], out_grid, scale=min(4, max(1, 128 // m.image_size)))
    if out_npz is not None:
        out_npz.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_npz.with_name(f".{out_npz.stem}.tmp.npz")
        np.savez(tmp, images=images)
        tmp.replace(out_npz)
    return images
