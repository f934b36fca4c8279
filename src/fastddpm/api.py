"""fastddpm from Python: train a run, load it, sample from it, evaluate it. The same code as the command line.

    import fastddpm

    result = fastddpm.train("cpu-demo", out="runs/demo", max_images=20_000)
    model = fastddpm.load(result.run_dir)             # a run directory, a checkpoint or an ema.safetensors
    images = model.sample(16, seed=0)                  # uint8 (16, 1, 28, 28): a flow model, Heun 10 steps
    pictures = model.sample(4, output="pil")           # or PIL images
    fastddpm.evaluate(result.run_dir, num_samples=2_000)["fid"]
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from fastddpm.config import (API, PRESETS, SPACINGS, ConfigError, RunConfig, check_keyword_types, default_preset,
                             device_setting, load_config_file, not_a_number, resolve_config)

__all__ = ["train", "load", "evaluate", "Model"]

SAMPLE_PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # as `fastddpm sample --precision`


def _silent(*args, **kwargs) -> None:
    pass


def _log(log, where: str):
    """`log` as a function of one line (None: nowhere), or a ConfigError before any work: a non-function (log=True,
    a file name, an open file) was a TypeError from the first line said, after the run's folder was written."""
    if log is None:
        return _silent
    if not callable(log):
        raise ConfigError(f"{where}: log={log!r} is not a function: pass one that takes a line (print, a logger's "
                          "info, a list's append), or None to say nothing")
    return log


def _path(value, name: str, where: str, what: str) -> Path:
    """A path argument as a Path, or a ConfigError naming it and `what` to pass: None, "" and a non-path (a number,
    a Model) were pathlib's TypeError, or "" the working directory taken as the run."""
    if isinstance(value, (str, os.PathLike)) and str(value).strip():
        return Path(value)
    raise ConfigError(f"{where}: {name}={value!r} is not a path: pass {what}, as a str or a pathlib.Path")


_A_MODEL = "a run directory, a checkpoint file, a safetensors export or a diffusers folder"


def _whole(value, name: str, where: str) -> int:
    """An integer argument as an int (a Python or numpy int, a 0-d integer tensor, or a float with no fraction), or
    a ConfigError naming it: 2.5 steps, "3" (text) and True (a bool) are no count."""
    import operator

    if not not_a_number(value):
        try:
            return operator.index(value)
        except TypeError:
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = None
            if number is not None and number.is_integer():
                return int(number)
    raise ConfigError(f"{where}: {name}={value!r} must be a whole number")


def _real(value, name: str, where: str) -> float:
    """A number argument as a float, or a ConfigError naming it (a bool or text is none)."""
    try:
        if not not_a_number(value):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{where}: {name}={value!r} must be a number")


def _one_scale(guidance, where: str, several: str = "") -> float | None:
    """A guidance scale as a float (a Python, numpy or 0-d torch number), or a ConfigError for what is none: a list
    of scales (one call each), a bool, text, an array of one scale."""
    if guidance is None:
        return None
    error = ConfigError(f"{where}: guidance={guidance!r}: one scale, a number; for several, call once per scale"
                        + (f" {several}" if several else ""))
    if not_a_number(guidance):  # float() would read True as 1, "2" as 2 and torch.tensor([2.0]) as 2
        raise error
    try:
        return float(guidance)
    except (TypeError, ValueError):
        raise error from None


def _sampling_choices(cfg: RunConfig, sampler: str, eta, spacing: str | None, precision: str, where: str) -> float:
    """Model.sample's and evaluate's eta (returned as a float), spacing and precision, refused as `fastddpm sample`
    and `fastddpm eval` refuse their --eta, --spacing and --precision (resolve_sampler_args checks eta's range)."""
    eta = _real(eta, "eta", where)
    if precision not in SAMPLE_PRECISIONS:  # resolve_precision reads any other name as fp16 or fp32
        raise ConfigError(f"{where}: precision={precision!r} is not one of {', '.join(SAMPLE_PRECISIONS)}")
    if spacing is not None and spacing not in SPACINGS:
        raise ConfigError(f"{where}: spacing={spacing!r} is not one of {', '.join(SPACINGS)} (or None: the "
                          "sampler's own)")
    if spacing is not None and sampler == "ddpm":
        raise ConfigError(f"{where}: spacing={spacing!r}: sampler='ddpm' walks every one of the "
                          f"{cfg.diffusion.num_timesteps} timesteps; drop spacing, or pick a few-step sampler")
    return eta


def _config(config: str | Path | RunConfig | dict | None, overrides: dict[str, Any], *,
            resumed: RunConfig | None = None, log=print) -> RunConfig:
    """A preset name, a YAML/JSON file, a RunConfig or its dict form; then `overrides`, each either
    "section.field" or a bare field name of exactly one section (max_images -> train.max_images), resolved as
    the command line resolves its flags (fastddpm.config.resolve_config); `resumed`, the config of a checkpoint
    being resumed (a run started from a diffusers folder keeps the model it read then). As `fastddpm train
    --resume` without --preset, a resumed run without a preset (`config` None, or a file that names none) starts
    from its own config, not from the default preset's: a run of another preset would not fit its
    checkpoint, and one of the same preset would lose the settings it was started with."""
    layers = [("fastddpm.train", overrides)]
    if config is None and resumed is not None:
        config = resumed
    elif config is None:
        config, why = default_preset(torch.cuda.is_available())
        log(f"preset: {config} (no config given; {why})")
    if isinstance(config, dict):
        return resolve_config(config, layers=layers, resumed=resumed)
    if isinstance(config, (str, Path)) and Path(config).suffix.lower() in (".yaml", ".yml", ".json"):
        base = resumed if resumed is not None and not load_config_file(config).get("preset") else None
        return resolve_config(base, file=config, layers=layers, resumed=resumed)
    if isinstance(config, (str, Path)) and str(config) not in PRESETS and (
            isinstance(config, Path) or os.sep in str(config) or Path(config).exists()):
        _refuse_config_path(Path(config))
    return resolve_config(config if isinstance(config, RunConfig) else str(config), layers=layers,
                          resumed=resumed)


def _refuse_config_path(path: Path) -> None:
    """A path given as fastddpm.train's config that is no config file: a run's folder (to train like it, or to go
    on with it) most often. It was called an unknown preset."""
    what = ("a folder" if path.is_dir() else "a file that does not end in .yaml, .yml or .json" if path.is_file()
            else "no file or folder")
    go_on = (f"; to continue the run in it, fastddpm.train(out={str(path)!r}, resume='latest')"
             if (path / "config.json").is_file() else "")
    raise ConfigError(f"fastddpm.train: config={str(path)!r} is {what}: pass a preset's name ({', '.join(PRESETS)}), "
                      f"a YAML or JSON config file (a run's own is RUN/config.json), or a RunConfig{go_on}")


def train(config: str | Path | RunConfig | dict | None = None, *, out: str | Path, data: str | None = None,
          resume: str | None = None, log=print, **overrides):
    """Train as `fastddpm train` does and return its TrainResult (run_dir, step, images_seen, last_loss,
    checkpoint, grid). `config`: a preset name, a YAML/JSON file, or a RunConfig (default: as `fastddpm train`,
    seed-1layer where CUDA is available, else cpu-demo-cond; a resumed run, its own config); `data`: any data
    source (default: the config's, fashion-mnist); `resume`: "latest" or a checkpoint; `log`: where the run's
    lines go (print; None: nowhere); `overrides`: config fields, e.g. max_images=20_000, lr=1e-3,
    precision="bf16" (or "train.lr"-style keys), each a value of its field's type (conditional=True, not "yes":
    text is refused where a bool, a number or a list is meant)."""
    from fastddpm.trainer.loop import train as train_loop

    log = _log(log, "fastddpm.train")
    if "preset" in overrides:  # a config field nowhere: the closest field's name would be the hint
        raise ConfigError(f"fastddpm.train: preset={overrides['preset']!r}: the preset is the first argument, "
                          f"fastddpm.train({overrides['preset']!r}, out=...)")
    if data is not None:
        overrides = {"data.source": data, **overrides}
    check_keyword_types(overrides, "fastddpm.train")  # conditional="yes" is text, not True: refused, not read
    from fastddpm.rundir.locate import find_resume

    out = _path(out, "out", "fastddpm.train", "the run's folder (a new one, or a run directory to continue)")
    resumed = find_resume(out, resume, said=API)
    cfg = _config(config, overrides, resumed=resumed.config if resumed is not None else None, log=log)
    # The run seeds torch's global CPU generator for its initial weights and draws from it, and on a GPU its own
    # device's generator (dropout): both forked, so that a notebook's torch.manual_seed sequence continues after
    # the call as it was (the run's own randomness comes from its seed and checkpoints, not from the caller's
    # state). The run's device alone: forking every GPU's would open a context on each. Under torchrun the process
    # is the job's own, and its device is the rank's (fastddpm.distributed.init_distributed).
    from fastddpm.device import resolve_device

    # a config file's device is named by the file in errors (the run resolves it again, knowing no file)
    device = resolve_device(cfg.train.device, setting=device_setting(cfg, config if isinstance(config, (str, Path))
                                                                     else None))[0]
    forked = [device] if device.type == "cuda" and os.environ.get("WORLD_SIZE") is None else []
    with torch.random.fork_rng(devices=forked):
        # the checkpoint found above, not a second search (which could find another and warns twice)
        return train_loop(cfg, out_dir=Path(out), resume=resumed if resumed is not None else resume, log=log,
                          said=API)


@dataclasses.dataclass
class Model:
    """A trained U-Net ready to sample: `net` (EMA weights unless loaded otherwise, eval mode), its RunConfig,
    and the device it is on."""

    net: torch.nn.Module
    cfg: RunConfig
    device: torch.device

    def __repr__(self) -> str:
        # one line: the dataclass's own repr printed every layer of the U-Net and every config field (160 lines for
        # the tiny preset) where a notebook shows `model`; model.net and model.cfg still show them
        m = self.cfg.model
        kind = f"conditional on {m.num_classes} classes" if m.conditional else "unconditional"
        size = sum(p.numel() for p in self.net.parameters())
        return (f"Model({self.cfg.preset or 'no'} preset, {size:,} parameters, {kind}, "
                f"{m.image_channels}x{m.image_size}x{m.image_size} images, {self.cfg.diffusion.objective} objective, "
                f"{self.device})")

    @property
    def classes(self) -> tuple[str, ...] | None:
        """A conditional model's class names, in id order (None for an unconditional one)."""
        m = self.cfg.model
        return tuple(m.class_names) if m.conditional and m.class_names else None

    def sample(self, n: int, *, sampler: str = "auto", steps: int | None = None, seed: int = 0, first_image: int = 0,
               class_: str | int | None = None, guidance: float | None = None, batch_size: int = 256,
               precision: str = "auto", output: str = "uint8", progress: bool = False, eta: float = 0.0,
               spacing: str | None = None):
        """`n` images: uint8 numpy (n, C, H, W), or a list of PIL images with output="pil". The same images as
        `fastddpm sample` with the same seed, whatever either batch size (image k's noise comes from (seed, k); up
        to float rounding in the network's batched arithmetic, bit for bit at the same batch size);
        `first_image=K` draws images K .. K + n - 1 of the seed's sequence (a share of a draw split over processes;
        of one class or none, not with class_="all").
        `class_`: a conditional model's class (name or id; "all" for n / classes of each, n a multiple of the class
        count, or with n below it one image each of n classes spread over the ids), guided with `guidance`
        (default: the run's train.sample_guidance). Without it a conditional model draws its null class, unguided
        (unconditional images), with a UserWarning that says so, as `fastddpm sample` notes it.
        `sampler="auto"` is the model's objective's best (heun, 10 steps, for flow; unipc, 10, for flow guided at
        W > 1; dpmpp-2m-sde, 20, otherwise); `steps=None` its steps, or 20 for a named sampler. `eta`: DDIM's
        (0 deterministic, 1 DDPM-like); `spacing`: the timesteps (trailing, karras, logsnr; None: the sampler's
        own), as `fastddpm sample --eta/--spacing`."""
        from fastddpm.sampling import (check_first_image, class_labels, null_class_note, resolve_sampler_args,
                                       sample_images)

        n, seed, first_image, batch_size = (_whole(v, name, "sample") for v, name in (
            (n, "n"), (seed, "seed"), (first_image, "first_image"), (batch_size, "batch_size")))
        steps = None if steps is None else _whole(steps, "steps", "sample")
        eta = _sampling_choices(self.cfg, sampler, eta, spacing, precision, "sample")
        if n < 1:
            raise ConfigError(f"sample: n={n} must be at least 1")
        if output not in ("uint8", "pil"):
            raise ConfigError(f"sample: output={output!r} is not one of uint8, pil")
        if batch_size < 1:
            raise ConfigError(f"sample: batch_size={batch_size} must be at least 1")
        check_first_image(first_image, class_, said=API)
        m = self.cfg.model
        guidance = _one_scale(guidance, "sample")
        if guidance is not None and not m.conditional:
            raise ConfigError("sample: guidance steers toward a class; this model is unconditional (drop guidance)")
        if guidance is not None and guidance < 0:
            raise ConfigError(f"sample: guidance={guidance} must be >= 0 (1 = plain conditional)")
        if guidance is not None and class_ is None:
            raise ConfigError(f"sample: guidance={guidance} steers toward a class: give class_ (a name, an id or "
                              f"'all') with it; without class_ the model samples its null class, unguided")
        labels, _ = class_labels(m, class_, n, said=API)
        scale = guidance if guidance is not None else (self.cfg.train.sample_guidance if labels is not None else 1.0)
        sampler, steps = resolve_sampler_args(self.cfg, sampler, steps, eta,
                                              guidance=scale if labels is not None else None, said=API)
        unconditional = null_class_note(self.cfg, class_, said=API)
        if unconditional:  # warned, not printed: the API prints nothing of its own (evaluate's notes are warnings)
            warnings.warn(f"sample: {unconditional}", stacklevel=2)
        with torch.inference_mode():
            images = sample_images(self.net, self.cfg, num_images=n, sampler=sampler, steps=steps, seed=seed,
                                   first_image=first_image, batch_size=batch_size, device=self.device,
                                   precision=precision, progress=progress, labels=labels, guidance=scale, eta=eta,
                                   spacing=spacing)
        if output == "uint8":
            return images
        from PIL import Image

        return [Image.fromarray(im[0] if im.shape[0] == 1 else im.transpose(1, 2, 0)) for im in images]


def load(path: str | Path, *, device: str = "auto", weights: str = "ema") -> Model:
    """A run directory (its newest checkpoint, or ema.safetensors), a checkpoint file, or an ema.safetensors or
    `fastddpm export --format safetensors` export (the file or its folder), or a diffusers DDPMPipeline or
    UNet2DModel folder, ready to sample on `device` (auto: CUDA when present), with its EMA (`weights="ema"`) or raw
    ("model") weights."""
    return _load(_path(path, "path", "fastddpm.load", _A_MODEL), device=device, weights=weights)[0]


def _load(path: str | Path, *, device: str, weights: str):
    """load's Model, and the Checkpoint it came from (whose record of the run's data evaluate compares)."""
    from fastddpm.device import resolve_device
    from fastddpm.rundir.locate import locate
    from fastddpm.sampling import load_for_sampling

    if weights not in ("ema", "model"):
        raise ConfigError(f"fastddpm.load: weights={weights!r} is not one of ema, model")
    ckpt = locate(path, weights=weights, what="fastddpm.load:")
    if ckpt.held not in (None, weights):
        raise ConfigError(f"fastddpm.load: {ckpt.path} holds only the {ckpt.held_label} weights: load it with "
                          f"weights={ckpt.held!r}, or load a checkpoints/ckpt_*.pt file for the "
                          f"{'raw' if ckpt.held == 'ema' else 'EMA'} ones")
    dev, _ = resolve_device(device, setting="fastddpm.load: device")
    net, cfg = load_for_sampling(ckpt, device=dev, weights=weights)
    return Model(net=net, cfg=cfg, device=dev), ckpt


def evaluate(path: str | Path, *, num_samples: int = 2_000, sampler: str = "auto",
             steps: int | None = None, seed: int = 0, guidance: float | None = None,
             data: str | None = None, inception: str | None = None, device: str = "auto",
             batch_size: int | None = None, eta: float = 0.0, spacing: str | None = None, precision: str = "auto",
             weights: str = "ema", resize: int | None = None, resize_mode: str | None = None,
             image_mode: str | None = None, skip_bad: bool | None = None, reference_split: str | None = None,
             features: str | None = None, log=print) -> dict:
    """FID, precision/recall and class coverage of a run or checkpoint's samples, as `fastddpm eval` measures
    them (the dataset's feature network unless `inception` names Inception weights). Returns the metrics dict:
    fid, precision, recall, coverage, sampling timings, and for a conditional model class accuracy, its samples
    guided at `guidance` (default: the run's train.sample_guidance, as `fastddpm eval`). `sampler`, `steps`, `eta`,
    `spacing` and `precision` as in Model.sample, `weights` as in load (`fastddpm eval`'s --eta, --spacing,
    --precision and --weights); `resize`, `resize_mode`, `image_mode` and `skip_bad` read the reference data
    another way than the run read it (None: as the run did), `reference_split` ("train", "test"; None: the run's
    split) compares with another split, as `fastddpm eval`'s flags of those names; `inception`: "auto" (find or
    download pytorch-fid's weights) or a local weights file; `features`: "inception" (inception="auto") or
    "fastddpm" (the default), as `fastddpm eval --features`; `log`: where its lines go (print; None: nowhere).
    Reference images other than the run trained on (other `data`, its files changed since, or read with other
    options) are scored, with a UserWarning that says so, as `fastddpm eval` notes it."""
    from fastddpm.eval.evaluate import as_json_safe, evaluator_for_run

    log = _log(log, "evaluate")
    if features not in (None, "fastddpm", "inception"):
        raise ConfigError(f"evaluate: features={features!r} is not one of 'fastddpm', 'inception'")
    if features == "fastddpm" and inception is not None:
        raise ConfigError(f"evaluate: features='fastddpm' and inception={inception!r} contradict each other: drop "
                          "inception for the dataset's own features, or features for Inception from the file")
    if features == "inception" and inception is None:  # `fastddpm eval --features inception`: find the weights
        inception = "auto"
    if inception not in (None, "auto"):  # a missing file before the checkpoint is read, as `fastddpm eval` does
        from fastddpm.eval.inception import inception_file

        inception_file(inception, said=API)

    num_samples, seed = _whole(num_samples, "num_samples", "evaluate"), _whole(seed, "seed", "evaluate")
    steps = None if steps is None else _whole(steps, "steps", "evaluate")
    batch_size = None if batch_size is None else _whole(batch_size, "batch_size", "evaluate")
    model, ckpt = _load(_path(path, "path", "evaluate", _A_MODEL), device=device, weights=weights)
    trained = model.cfg.data  # the data the model learned, which the reference images are compared with
    if ckpt.kind == "diffusers":  # its config's data is a placeholder: data= is what it was trained on
        if data is None:
            raise ConfigError(f"evaluate: {ckpt.path} is a diffusers folder, which records no dataset: pass "
                              "data=SOURCE, the images its model was trained on (data='cifar10' for "
                              "google/ddpm-cifar10-32)")
        trained = dataclasses.replace(trained, source=data)
    cfg = model.cfg
    data_options = {k: v for k, v in (("source", data), ("resize", resize), ("resize_mode", resize_mode),
                                      ("image_mode", image_mode), ("skip_bad", skip_bad)) if v is not None}
    if data_options:  # checked by the data section as a config file's are
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data_options))
    if reference_split not in (None, "train", "test"):
        raise ConfigError(f"evaluate: reference_split={reference_split!r} is not one of train, test (or None: the "
                          f"split the run trained on, {cfg.data.split})")
    if num_samples < 10:
        raise ConfigError(f"evaluate: num_samples={num_samples}: at least 10 (10000 is the usual count)")
    guidance = _one_scale(guidance, "evaluate", several="(as `fastddpm eval --guidance 0,1,2` does)")
    if guidance is not None and not cfg.model.conditional:
        raise ConfigError(f"evaluate: guidance={guidance:g} steers toward a class: it needs a conditional model "
                          "(trained with conditional=True); this one is unconditional: drop guidance")
    if guidance is not None and guidance < 0:
        raise ConfigError(f"evaluate: guidance={guidance} must be >= 0 (1 = plain conditional)")
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"evaluate: batch_size={batch_size} must be at least 1")
    from fastddpm.sampling import resolve_sampler_args

    # a conditional model at the run's own scale unless told, as `fastddpm eval`
    scale = (cfg.train.sample_guidance if guidance is None else guidance) if cfg.model.conditional else None
    eta = _sampling_choices(cfg, sampler, eta, spacing, precision, "evaluate")
    sampler, steps = resolve_sampler_args(cfg, sampler, steps, eta, guidance=scale, said=API)
    from fastddpm.device import resolve_precision

    evaluator = evaluator_for_run(cfg, device=model.device, trained_on=trained.source,
                                  data_given=data is not None, said=API, inception=inception,
                                  reference_split=reference_split, log=log)
    from fastddpm.eval.notes import other_data_note, weak_classifier

    # warned, not logged: log=None silences progress lines, and a score against other images than the model learned
    # must not pass unsaid (a pipeline can also make the warning an error)
    changed = other_data_note(ckpt.meta.get("data"), evaluator, cfg, trained=trained, said=API)
    if changed:
        warnings.warn(changed, stacklevel=2)
    weak = weak_classifier(evaluator.net.info) if evaluator.net.num_classes is not None else None
    if weak:  # as `fastddpm eval` says it
        log(f"note: a weak feature network ({weak}): FIDs in its features rank models poorly; evaluate against "
            "more labelled data (data=SOURCE), or with inception='auto'")
    batch = min(batch_size or (1000 if model.device.type == "cuda" else 250), num_samples)
    with torch.inference_mode():
        metrics, _ = evaluator.evaluate(model.net, cfg, num_samples=num_samples, sampler=sampler, steps=steps,
                                        eta=eta, spacing=spacing, seed=seed, batch_size=batch, device=model.device,
                                        autocast_dtype=resolve_precision(precision, model.device).autocast_dtype,
                                        guidance=scale)
    return as_json_safe({**metrics, "features": evaluator.describe()})
