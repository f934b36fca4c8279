"""Sampling from a trained model: load its weights from whatever a run left, draw images, write them.

The diffusion math (DDPM, DDIM, the ODE solvers) is fastddpm.diffusion.samplers; this module is everything around it
that a user touches: `fastddpm sample`, the trainer's grids and the evaluator's loader all come through here.

    load_for_sampling   whatever fastddpm.rundir.locate takes (a run directory, a .pt checkpoint, an FSDP run's .dcp,
                        an ema.safetensors export) -> (model in eval mode, RunConfig)
    sample_to_files     N images in batches -> a PNG grid and an .npz of uint8 (N, C, H, W)
    write_grid          the trainer's grid: a fixed seed, so grids across a run are comparable
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from fastddpm.config import CLI, SAMPLERS, ConfigError, RunConfig, Spelling, class_index, resolve_sampling
from fastddpm.device import Precision, resolve_precision
from fastddpm.diffusion import network_calls, sample, schedule_from_config, to_uint8
from fastddpm.diffusion.continuous import CONTINUOUS_SAMPLERS
from fastddpm.diffusion.ode_solvers import LAMBDA_MIN
from fastddpm.diffusion.samplers import max_steps
from fastddpm.progress import progress_bar
from fastddpm.grid import save_grid
from fastddpm.models import build_unet
from fastddpm.rng import derive_seed
from fastddpm.rundir.locate import Checkpoint, locate
from fastddpm.rundir.state_dicts import load_model_state


def check_sampler_args(sampler: str, steps: int, eta: float, num_timesteps: int, objective: str = "ddpm", *,
                       guidance: float | None = None, said: Spelling = CLI) -> None:
    """`sample`'s and `eval`'s sampler flags against the model, and the classifier-free guidance scale `guidance`
    (None: none given): a ConfigError naming the argument as `said` spells it (the flag, or the API's parameter)
    and the fix."""
    if sampler not in SAMPLERS:
        raise ConfigError(f"{said('sampler', sampler)} is not one of auto, {', '.join(SAMPLERS)}")
    if not (math.isfinite(eta) and 0.0 <= eta <= 1.0):
        raise ConfigError(f"{said('eta', eta)} must be a number in [0, 1] (0: deterministic DDIM, 1: DDPM's variance; "
                          "Song et al. 2021, eq. 16)")
    if guidance is not None and not (math.isfinite(guidance) and guidance >= 0):
        raise ConfigError(f"{said('guidance', guidance)} must be a finite number >= 0 (0: unconditional, 1: plain "
                          "conditional, above 1: guided)")
    if objective != "ddpm":
        if sampler not in CONTINUOUS_SAMPLERS:
            raise ConfigError(f"{said('sampler', sampler)} walks DDPM's discrete timesteps; this {objective} model "
                              f"samples with {', '.join(CONTINUOUS_SAMPLERS)} (ancestral sampling: "
                              f"{said('sampler', 'ddim')} with {said('eta', 1)})")
        if steps < 1:
            raise ConfigError(f"{said('steps', steps)} must be >= 1")
    elif sampler != "ddpm" and not 1 <= steps <= num_timesteps:
        raise ConfigError(f"{said('steps', steps)} must be between 1 and {num_timesteps}")
    if eta != 0.0 and sampler != "ddim":
        kind = {"dpmpp-2m-sde": "stochastic by construction (the reverse SDE)",
                "ddpm": "ancestral, stochastic by construction (DDIM's eta 1 on every timestep)"}.get(
                    sampler, "deterministic")
        raise ConfigError(f"{said('eta')} is DDIM's: {said('sampler', sampler)} is {kind} (use "
                          f"{said('sampler', 'ddim')} for {said('eta')})")


def check_null_class_trained(cfg: RunConfig, guidance: float | None, said: Spelling = CLI) -> None:
    """A conditional model trained with cond_drop_prob 0 never saw its null class: its unconditional prediction is
    that of an untrained embedding row, so samples without a class (`guidance` None) and guided ones (W != 1, which
    mix in that prediction; Ho & Salimans 2022, eq. 6) draw from it. Refused, naming what draws well."""
    if not (cfg.model.conditional and cfg.train.cond_drop_prob == 0) or guidance == 1:
        return
    asked = "samples without a class" if guidance is None else f"guidance W = {guidance:g}"
    raise ConfigError(f"{asked}: this model was trained with cond_drop_prob 0, so its null class (no class), which "
                      f"{'they draw' if guidance is None else 'guidance mixes in'}, learned nothing: draw a "
                      f"{said('class')} at {said('guidance', 1)} (train with cond_drop_prob 0.1 for guidance)")


def step_limit(cfg: RunConfig, sampler: str) -> int | None:
    """The most steps `sampler` takes on this run's DDPM schedule (a step in log-SNR from its noisiest timesteps is
    ill-conditioned), or None where there is no limit: EDM's and flow's samplers, and ancestral DDPM (which walks
    all T timesteps whatever the count)."""
    d = cfg.diffusion
    if d.objective != "ddpm" or sampler not in SAMPLERS or sampler == "ddpm":
        return None
    return max_steps(schedule_from_config(d), sampler)


def resolve_sampler_args(cfg: RunConfig, sampler: str, steps: int | None, eta: float = 0.0, *,
                         guidance: float | None = None, said: Spelling = CLI) -> tuple[str, int]:
    """`sample`'s, `eval`'s and the API's sampler and steps for this model, its samples drawn at classifier-free
    guidance scale `guidance` (None: without class labels): `auto` and unset steps resolved for its objective and
    whether it is guided (fastddpm.config.resolve_sampling), then checked (check_sampler_args; errors spell the
    arguments as `said` does)."""
    d = cfg.diffusion
    check_null_class_trained(cfg, guidance, said)
    if sampler == "ddpm" and d.objective != "ddpm":  # said first: dropping --steps would not make it run
        check_sampler_args(sampler, d.num_timesteps, eta, d.num_timesteps, d.objective, guidance=guidance, said=said)
    if sampler == "ddpm" and steps is not None and steps != d.num_timesteps:
        raise ConfigError(f"{said('steps', steps)}: {said('sampler', 'ddpm')} walks every one of the "
                          f"{d.num_timesteps} timesteps and takes no step count; drop {said('steps')}, or pick a "
                          "few-step sampler (ddim, dpmpp-2m, dpmpp-2m-sde, unipc, heun)")
    given = steps
    sampler, steps = resolve_sampling(sampler, steps, d.objective, guided=cfg.guided(guidance))
    limit = step_limit(cfg, sampler)
    if limit is not None:  # the schedule's limit, said first
        if given is None:  # the default count, on a schedule too short for it: as many as it takes
            steps = min(steps, limit)
        if steps > limit == d.num_timesteps:
            raise ConfigError(f"{said('steps', steps)} must be between 1 and {d.num_timesteps}, the model's timesteps")
        if steps > limit:
            raise ConfigError(
                f"{said('steps', steps)}: {said('sampler', sampler)} takes at most {limit} steps on this "
                f"{d.schedule} schedule: it starts at timestep {limit - 1}, the noisiest whose half log-SNR is >= "
                f"{LAMBDA_MIN} (a step in log-SNR or sigma from the later ones is ill-conditioned); ddim and euler "
                f"walk all {d.num_timesteps}")
    check_sampler_args(sampler, steps, eta, d.num_timesteps, d.objective, guidance=guidance, said=said)
    return sampler, steps


def run_sampling(cfg: RunConfig, use: str) -> tuple[str, int]:
    """A training run's (sampler, steps) for its grids (`use` "grids") or its --eval-every ("evaluations"):
    `auto` resolved for its objective (RunConfig.grid_sampling / eval_sampling), and the default step count capped
    to what the sampler takes on a DDPM schedule too short for it, as `sample` and `eval` cap theirs. A count
    given is kept: the trainer refuses one too large at its start."""
    sampler, steps = cfg.grid_sampling() if use == "grids" else cfg.eval_sampling()
    given = cfg.train.sample_steps if use == "grids" else cfg.train.eval_steps
    limit = step_limit(cfg, sampler)
    if given is None and limit is not None:
        steps = min(steps, limit)
    return sampler, steps


def compile_for_sampling(model, device: torch.device):
    """The U-Net compiled for a sampler's loop: one static shape (every batch full), and on CUDA each step's
    forward replayed as a CUDA graph (mode="reduce-overhead"): a sampler's step is one small forward whose kernel
    launches would otherwise cost as much as its math. The samplers never keep a network output across calls (a
    replay overwrites it); they keep x0_hat and eps, computed from it."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else None
    return torch.compile(model, dynamic=False, mode=mode)


def grid_scale(image_size: int) -> int:
    """Upscaling of grid images: 28x28 digits are too small to judge at 1x."""
    return min(4, max(1, 128 // image_size))


def load_for_sampling(source: str | Path | Checkpoint, device: torch.device | str = "cpu", weights: str = "ema"):
    """The U-Net of a run directory, a checkpoint (.pt, or an FSDP run's sharded .dcp directory), an
    ema.safetensors export (any path `fastddpm.rundir.locate` takes) or an already located Checkpoint, with its
    EMA or raw `weights`. Returns (model in eval mode on `device`, RunConfig)."""
    ckpt = source if isinstance(source, Checkpoint) else locate(source, weights=weights)
    cfg = ckpt.config
    # building the U-Net draws initial weights, which the checkpoint's then replace, from the global RNG: forked,
    # so that loading a model leaves the caller's torch.manual_seed sequence (a notebook's, a training run's) as it was
    with torch.random.fork_rng(devices=[]):
        model = build_unet(cfg.model)
    state = ckpt.weights(weights)
    if ckpt.kind == "diffusers":  # a UNet2DModel's weights, under its names
        from fastddpm.models.diffusers_names import from_diffusers_state_dict

        try:
            state = from_diffusers_state_dict(model, state, flip_sin_to_cos=ckpt.meta["flip_sin_to_cos"])
        except ConfigError as e:
            raise ConfigError(f"{ckpt.meta['named_by']} {ckpt.path}: {e}") from None
    load_model_state(model, state, what=f"{ckpt.path} ({weights} weights)")
    return model.to(device).eval(), cfg


def class_labels(model_cfg, wanted: str | int | None, num_images: int, *,
                 said: Spelling = CLI) -> tuple[np.ndarray | None, int | None]:
    """The class of each image `fastddpm sample --class` asks for: None (unconditional, or a conditional model's
    null class), one class (a name or an id, see class_index), or "all": num_images // num_classes images of every
    class, class by class; with fewer images than classes, num_images classes spread evenly over the ids, one image
    each (as the training grid, grid_labels), so that no more images are drawn than were asked for. A count above
    the classes that is no multiple of them is refused (it drew fewer images than asked, without a word). Returns
    (labels (N,) int64 or None, images per class for an "all" grid's rows, or None where the rows are not
    classes). `fastddpm sample` and Model.sample both call it, so they draw the same labels and refuse alike."""
    if wanted is None:
        return None, None
    if _every_class(wanted):
        if not model_cfg.conditional:
            class_index(model_cfg, wanted, said=said)  # raises: an unconditional model has no classes
        classes = model_cfg.num_classes
        if num_images > classes and num_images % classes:
            fewer = num_images // classes * classes
            raise ConfigError(
                f"{said('class', 'all')} with {said('num-images', num_images)}: 'all' draws the same number of images "
                f"of each of the model's {classes} classes, and {num_images} is no multiple of {classes} (it would "
                f"draw {fewer}): give {said('num-images')} {fewer} or {fewer + classes}, or below {classes} for one "
                f"image each of that many classes spread over the ids")
        labels, per_class = grid_labels(num_images, classes)
        return labels.numpy().astype(np.int64), per_class
    return np.full(num_images, class_index(model_cfg, wanted, said=said), dtype=np.int64), None


def null_class_note(cfg: RunConfig, wanted: str | int | None, *, said: Spelling = CLI) -> str | None:
    """What a conditional model draws without a class, said where `fastddpm sample` (a note on stderr) and
    Model.sample (a UserWarning) draw it: the null class, unguided, which is legitimate for a classifier-free
    model but is not what a user who trained on classes expects to see. None with a class, or for an unconditional
    model."""
    if not cfg.model.conditional or wanted is not None:
        return None
    how = "class_ (a name, an id or 'all')" if said.api else said("class", "NAME|ID|all")
    return (f"no {said('class')}: these images are unconditional (the model's null class, unguided); {how} draws its "
            f"{cfg.model.num_classes} classes with guidance at W = {cfg.train.sample_guidance:g}, the run's "
            "sample_guidance")


def _every_class(wanted: str | int | None) -> bool:
    return isinstance(wanted, str) and wanted.strip().lower() == "all"


def check_first_image(first_image: int, wanted: str | int | None, *, said: Spelling = CLI) -> None:
    """`fastddpm sample --first-image` (the API: Model.sample's first_image) with the --class it is drawn for: a
    ConfigError naming the fix. With --class all the image count lays the classes out, so the ranges of a split
    draw would not add up to the draw whole."""
    first = said("first-image", first_image)
    if first_image < 0:
        raise ConfigError(f"{first} must be >= 0 (the index of the first image to draw)")
    if first_image and _every_class(wanted):
        by_class = said("class", "NAME") + ("" if said.api else f", each with its own {said('first-image')} ranges")
        raise ConfigError(f"{first} with {said('class', 'all')}: {said('num-images')} decides each image's class, so "
                          f"the ranges of a split draw would not add up to the draw whole; split it by class instead "
                          f"({by_class}), or draw it in one {'call' if said.api else 'process'}")


def sample_images(model, cfg: RunConfig, *, num_images: int, sampler: str, steps: int, seed: int, batch_size: int,
                  device, first_image: int = 0, precision: str = "auto", eta: float = 0.0, progress: bool = True,
                  labels: np.ndarray | None = None, guidance: float = 1.0, spacing: str | None = None) -> np.ndarray:
    """`num_images` as uint8 (N, C, H, W): images `first_image` .. + N - 1 of the seed's sequence, in batches of
    `batch_size`, image k from (seed, k) whatever the batch size (diffusion.sample); or one per entry of `labels`
    (a conditional model's class ids), guided with scale `guidance`. `fastddpm sample` and the Python API's
    Model.sample both draw here: the same seed gives the same images, and a draw of more images with the same
    labels begins with those of a draw of fewer."""
    device = torch.device(device)
    prec = resolve_precision(precision, device)
    schedule = schedule_from_config(cfg.diffusion)
    model_cfg = cfg.model
    if labels is not None:
        num_images = len(labels)
    chunks = []
    bar = None
    if progress:  # a bar on a terminal or in a notebook, plain lines in a log file
        per_batch = network_calls(sampler, steps, cfg.diffusion.num_timesteps, schedule=schedule, spacing=spacing)
        bar = progress_bar(math.ceil(num_images / batch_size) * per_batch, unit="model-call")
    for start in range(0, num_images, batch_size):
        n = min(batch_size, num_images - start)
        shape = (n, model_cfg.image_channels, model_cfg.image_size, model_cfg.image_size)
        y = torch.from_numpy(labels[start:start + n]) if labels is not None else None
        x = sample(model, schedule, shape, sampler=sampler, steps=steps, eta=eta, prediction=cfg.diffusion.prediction,
                   spacing=spacing, seed=derive_seed(seed, "sample"), first_image=first_image + start, device=device,
                   autocast_dtype=prec.autocast_dtype,
                   progress=bar, labels=y, guidance=guidance, num_classes=model_cfg.num_classes)
        chunks.append(to_uint8(x).cpu().numpy())
    if bar is not None:
        bar.close()
    return np.concatenate(chunks)


def sample_to_files(model, cfg: RunConfig, *, num_images: int, sampler: str, steps: int, eta: float, seed: int,
                    batch_size: int, device, first_image: int = 0, out_grid: Path, out_npz: Path | None,
                    precision: str = "auto", progress: bool = True, labels: np.ndarray | None = None,
                    guidance: float = 1.0, per_class_row: int | None = None,
                    spacing: str | None = None) -> np.ndarray:
    """sample_images, then a PNG grid (up to 256 images; with `per_class_row`, the images drawn class by class
    `per_class_row` at a time: one row per class, named, of its first images, as many as keep the grid near 256 but
    at least one) and an .npz of uint8 (N, C, H, W) with the labels beside them."""
    images = sample_images(model, cfg, num_images=num_images, sampler=sampler, steps=steps, seed=seed,
                           first_image=first_image, batch_size=batch_size, device=device, precision=precision,
                           eta=eta, progress=progress, labels=labels, guidance=guidance, spacing=spacing)
    model_cfg = cfg.model
    scale = grid_scale(model_cfg.image_size)
    if per_class_row:
        # every image in the rows would make the grid as wide as the count: --num-images 100000 over 10 classes is
        # 10 rows of 10,000 28x28 images, at 4x a PNG 1.2 million pixels wide (1.4 GB in memory)
        rows = len(images) // per_class_row
        cols = min(per_class_row, max(1, 256 // rows))
        by_class = images[:rows * per_class_row].reshape(rows, per_class_row, *images.shape[1:])
        shown = by_class[:, :cols].reshape(-1, *images.shape[1:])
        save_grid(shown, out_grid, nrow=cols, scale=scale, row_labels=list(model_cfg.class_names))
    else:
        save_grid(images[:256], out_grid, scale=scale)
    if out_npz is not None:
        out_npz.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_npz.with_name(f".{out_npz.stem}.tmp.npz")
        np.savez(tmp, images=images, **({"labels": labels, "guidance": guidance} if labels is not None else {}))
        tmp.replace(out_npz)
    return images


def grid_labels(num_images: int, num_classes: int) -> tuple[torch.Tensor, int | None]:
    """The classes of a conditional model's training grid, at most `num_images` of them (the grid is one batch,
    twice that under guidance, drawn mid-training): one row per class of num_images // num_classes images; with
    fewer images than classes, num_images classes spread evenly over the ids, one image each. Returns (labels (N,),
    images per row, or None where the rows are not classes)."""
    if num_images < num_classes:
        return torch.arange(num_images) * num_classes // num_images, None
    per_class = num_images // num_classes
    return torch.arange(num_classes).repeat_interleave(per_class), per_class


def reshard(model) -> None:
    """After an FSDP model's forward outside training (a grid, an evaluation): FSDP keeps the root module's
    gathered weights after a forward (it expects a backward next): free them, or the next forward would run on
    this copy instead of re-gathering the updated EMA shards. Nothing for a plain module."""
    if hasattr(model, "reshard"):
        model.reshard()


def write_grid(ema_model, schedule, cfg: RunConfig, device, precision: Precision, path: Path,
               save: bool = True) -> Path | None:
    """Sample a grid from the EMA weights with a fixed seed, so grids over a run are comparable. `save=False`:
    sample only (an FSDP rank other than 0 takes part in the all-gathers; rank 0 writes)."""
    model_cfg = cfg.model
    n, labels, per_class = cfg.train.num_sample_images, None, None
    if model_cfg.conditional:  # at the run's guidance scale
        labels, per_class = grid_labels(n, model_cfg.num_classes)
        n = len(labels)
    shape = (n, model_cfg.image_channels, model_cfg.image_size, model_cfg.image_size)
    sampler, steps = run_sampling(cfg, "grids")
    x = sample(ema_model, schedule, shape, sampler=sampler, steps=steps,
               prediction=cfg.diffusion.prediction, seed=derive_seed(cfg.train.seed, "grid"), device=device,
               autocast_dtype=precision.autocast_dtype, labels=labels, guidance=cfg.train.sample_guidance,
               num_classes=model_cfg.num_classes)
    reshard(ema_model)
    if not save:
        return None
    return save_grid(to_uint8(x).cpu().numpy(), path, nrow=per_class, scale=grid_scale(model_cfg.image_size),
                     row_labels=list(model_cfg.class_names) if per_class else None)
