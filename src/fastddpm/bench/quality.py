"""`fastddpm bench quality`: time to quality, not only images per second.

1. reference  the seed's recipe as it is (preset seed-1layer: Adam 1e-4, batch 192, 40 epochs, epsilon, linear
              schedule), trained once with `fastddpm train --eval-every`; the FID of its EMA weights at the end is
              the target. (It runs on fastddpm's fast path: the recipe, not the machinery, sets the quality.)
2. fast       the same U-Net with a fast recipe (default: batch 512, lr 4e-4 with 50k images of warm-up, EMA 0.999),
              evaluated every `fast_eval_every_images`; reported: the training wall time (compile included,
              evaluation excluded) of the first evaluation at or below the target. Target on one H100: <= 60 s.
3. options    (optional) each named option on top of the fast recipe, trained for as many images as the fast
              run needed, FID at the end: at equal images these options cost the same per step, so this is FID
              at (about) equal wall time, which is recorded next to it. With --fast-from, the reference, target
              and fast run come from an earlier quality.json and only the options train (so a GPU session can
              spread the options over several calls).

Every evaluation uses the same feature network, sample count, sampler and noise, so FIDs compare across runs.
One sampler for all suits the DDPM options but not every objective: an option whose objective `auto` samples with
another sampler than the fast recipe's (flow matching: Heun-10, or UniPC-10 when guided) is also scored, at the end,
with that sampler and its steps, from the same weights, features and noise seed; the report shows both FIDs with
their network calls.
Time resolution is the evaluation interval (time-to-target is the first evaluation that reaches it).
Writes OUT/quality.json, quality.md and quality.png; environment with every number. Each run is written to
OUT/quality.partial.json as it finishes: the same command again into the same OUT (after a time limit cut a call
short, say) reuses the runs finished there with the same config, device and torch, and trains the rest
(--remeasure trains them all again). A --num-images draw is kept in the cache folder, named by its images: its
feature network (trained once, ~130 s on a CPU) and reference statistics serve every call that draws them, whatever
its --out.
This module imports no torch at the top, so `fastddpm --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastddpm.bench import store
from fastddpm.config import (CLI, DEFAULT_SAMPLER, ConfigError, RunConfig, apply_overrides, get_preset,
                             resolve_sampling)
from fastddpm.data.cache import default_cache_dir, describe_identity, same_images

SCHEMA = "fastddpm-bench-quality-1"
FAST_RECIPE = ("train.batch_size=512", "train.lr=4e-4", "train.warmup_images=50000", "train.ema_decay=0.999")
OPTIONS: dict[str, tuple[str, ...]] = {
    "min-snr-5": ("train.min_snr_gamma=5",),
    "v-prediction": ("diffusion.prediction=v",),
    "cosine": ("diffusion.schedule=cosine",),
    "no-ema-warmup": ("train.ema_warmup=false",),
    "no-lr-warmup": ("train.warmup_images=0",),
    "lr-x2": ("train.lr=8e-4",),
    # the objectives (fastddpm.diffusion.continuous) on the same recipe and U-Net
    "edm": ("diffusion.objective=edm",),
    "flow": ("diffusion.objective=flow",),
}
# --quick: the CPU check that the pipeline works (tiny U-Net, 256 images); its numbers mean nothing.
QUICK = dict(preset="tiny", num_images=256, eval_samples=32, eval_steps=4, reference_epochs=1.0,
             reference_eval_every_images=256, fast_overrides=("train.batch_size=32", "train.lr=2e-3"),
             fast_max_images=512, fast_eval_every_images=256)


@dataclass(kw_only=True)
class QualitySettings:
    """Every field is a flag of `fastddpm bench quality`."""

    data: str = "fashion-mnist"  # MNIST-format data with labels (the feature network is trained on them)
    preset: str = "seed-1layer"
    num_images: int | None = None  # cap the dataset (None: all of it)
    eval_samples: int = 5000
    eval_sampler: str = DEFAULT_SAMPLER  # the evaluation samples' sampler: one for every run compared (DDPM's best)
    eval_steps: int = 50  # its steps
    reference_epochs: float | None = None  # None: the preset's own length (seed-1layer: 40 epochs)
    reference_eval_every_images: int = 600_000
    reference_from: str | None = None  # a previous quality.json: reuse its reference (target) instead of training
    target_fid: float | None = None  # or give the target directly
    fast_overrides: tuple[str, ...] = FAST_RECIPE
    sets: tuple[str, ...] = ()  # --set SECTION.FIELD=VALUE: every run's (reference, fast, options), under the recipes
    fast_max_images: int = 1_200_000
    fast_eval_every_images: int = 120_000
    options: tuple[str, ...] = ()
    fast_from: str | None = None  # an earlier quality.json with a fast run: reuse it and its target; train options
    reference_only: bool = False  # stop after the reference (a GPU session measures it in its own call)
    remeasure: bool = False  # train again the runs an earlier call finished into the same folder
    device: str = "auto"
    seed: int = 0
    quick: bool = False

    def __post_init__(self) -> None:
        self.sets = tuple(self.sets)  # argparse's append gives a list; recorded and compared as the others
        unknown = [o for o in self.options if o not in OPTIONS]
        if unknown:
            raise ConfigError(f"bench quality: unknown option(s) {', '.join(unknown)}; "
                              f"choose from {', '.join(OPTIONS)}")
        for name in ("target_fid", "reference_epochs"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # an FID is > 0; a target of 0 or less is never reached
                raise ConfigError(f"bench quality: --{name.replace('_', '-')} {value} must be > 0")
        if self.reference_from is not None and self.target_fid is not None:
            raise ConfigError("bench quality: give --reference-from or --target-fid, not both")
        if self.reference_only and (self.reference_from is not None or self.target_fid is not None):
            raise ConfigError("bench quality: --reference-only trains the reference; "
                              "drop --reference-from/--target-fid")
        for item in self.fast_overrides:
            if item.split("=", 1)[0] in ("train.eval_inception", "eval_inception"):
                # the target is the reference's FID: scored in other features than the fast run's, it compares
                # with nothing
                raise ConfigError(f"bench quality: --fast {item} would score the fast run and the options in other "
                                  "features than the reference, whose FID is their target: give it to every run with "
                                  f"--set {item}")
        if self.fast_from is not None:
            if self.reference_from is not None or self.target_fid is not None or self.reference_only:
                raise ConfigError("bench quality: --fast-from reuses that file's reference and target; drop "
                                  "--reference-from / --target-fid / --reference-only")
            if not self.options:
                raise ConfigError("bench quality: --fast-from reuses the fast run, so only --options are left to "
                                  f"train: name some, from {', '.join(OPTIONS)}")


_SAID = CLI.setting("inception", "train.eval_inception")  # --set train.eval_inception=PATH is how it is given


def _check_features(cfg: RunConfig, log) -> None:
    """Load the Inception file that --set train.eval_inception names (or find it, for auto) before any run trains,
    its errors naming the setting as given: each run's trainer would find a bad file only after the runs before it
    had trained, and name it as `train --eval-inception`, a flag this command does not have."""
    if not cfg.train.eval_inception:
        return
    import torch

    from fastddpm.eval.inception import load_found_inception, load_inception
    from fastddpm.eval.inception_weights import FIND

    if cfg.train.eval_inception == FIND:
        load_found_inception(torch.device("cpu"), cache_root=Path(cfg.data.cache_dir) if cfg.data.cache_dir else None,
                             log=log, said=_SAID)
    else:
        load_inception(cfg.train.eval_inception, torch.device("cpu"), said=_SAID)


def _overrides(items) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"bench quality: {item!r} is not SECTION.FIELD=VALUE")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def _data_source(s: QualitySettings, cache_root: Path, log) -> tuple[str, dict]:
    """The source the runs train on: s.data, or num_images of it (and a quarter as many of its test split, at
    least 64), drawn across it, as an .npz in the cache folder (`cache_root`, the runs' data.cache_dir); and the
    identity of s.data's training images (PreparedData.identity), by which a reused result's data is compared."""
    import numpy as np

    from fastddpm.data import DataError, prepare

    train = prepare(s.data, split="train", cache_dir=cache_root, progress=False)
    classes = np.unique(train.labels[train.labels >= 0])
    if len(classes) < 2:
        raise ConfigError(f"bench quality --data {s.data}: "
                          + ("its images have no labels" if not len(classes) else "its images are all one class")
                          + ", and FID here is measured in fastddpm-features, a classifier trained on the data's "
                          "classes: give data of two or more classes (class folders, an .npz with labels)")
    if s.num_images is None:
        return s.data, train.identity()

    def subset(data, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        # drawn across the whole set, in its order: the first n of class folders (read class by class) are one
        # class, whose feature network cannot be trained
        index = np.sort(np.random.default_rng(seed).choice(data.num_images, n, replace=False))
        return np.array(data.images[index]), np.asarray(data.labels[index])

    n = min(s.num_images, train.num_images)
    arrays = dict(zip(("x_train", "y_train"), subset(train, n, seed=0)))
    if train.class_names:
        arrays["class_names"] = np.array(train.class_names)
    try:
        test = prepare(s.data, split="test", cache_dir=cache_root, progress=False)
        k = min(max(n // 4, 64), test.num_images)
        arrays.update(zip(("x_test", "y_test"), subset(test, k, seed=1)))
    except DataError:
        pass
    # Named by its content, beside the caches derived from it: its prepared cache, and so the feature network
    # (cached by that cache's name and fingerprint, the file's path and mtime) and the reference statistics, are
    # the same for every call that draws these images, whatever its --out (written into --out, each new folder
    # trained the network again). Another --data capped at the same count names another file; an existing file is
    # left as it is, since a rewrite's new mtime is a new fingerprint.
    digest = hashlib.sha256()
    for key in sorted(arrays):
        digest.update(f"{key}{arrays[key].dtype}{arrays[key].shape}".encode())
        digest.update(np.ascontiguousarray(arrays[key]).tobytes())
    path = cache_root / "subsets" / f"data-n{n}-{digest.hexdigest()[:12]}.npz"
    if path.is_file():
        log(f"data: {n:,} images of {s.data}, drawn across it: {path} (drawn before)")
        return str(path), train.identity()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp.npz")  # whole, or not there
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    log(f"data: {n:,} images of {s.data}, drawn across it -> {path}")
    return str(path), train.identity()


def _read_earlier(path: str, flag: str) -> dict:
    """An earlier quality.json named by --reference-from / --fast-from, or a ConfigError that names it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"bench quality: {flag} {path}: cannot read it ({e.strerror or e}); give the quality.json "
                          "an earlier `fastddpm bench quality` wrote") from None
    except ValueError as e:
        raise ConfigError(f"bench quality: {flag} {path} is not JSON ({e}); give the quality.json an earlier "
                          "`fastddpm bench quality` wrote") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ConfigError(f"bench quality: {flag} {path} has schema {schema!r}, not {SCHEMA!r}: give the "
                          "quality.json an earlier `fastddpm bench quality` wrote")
    return data


_SUBSET = re.compile(r"data-n\d+-[0-9a-f]{12}\.npz")  # _data_source's --num-images draw, named by its content


def _check_same_data(previous: dict, s: QualitySettings, given: str, identity: dict | None, source: str) -> None:
    """A reused reference or fast run must have trained on the same dataset: FIDs of two datasets do not compare.
    Compared by the images (`identity`, PreparedData.identity: count, shape, classes, sampled pixels) where the
    earlier result recorded them: the same images at any path are one dataset, two folders both named train/ are
    two. A result written before that is compared by the dataset's name (the last part of the path: a named
    dataset reached through a local copy, e.g. .data/fashion-mnist, is fashion-mnist)."""
    theirs = previous.get("settings", {}).get("data")
    recorded = previous.get("data_identity")
    drawn = [Path(str(p)).name for p in (previous.get("data_source"), source)]
    if all(_SUBSET.fullmatch(name) for name in drawn) and drawn[0] != drawn[1]:
        # the same dataset, other images of it: a quality.json of a version that took the first N drew other ones
        raise ConfigError(f"bench quality: {given} trained on {drawn[0]} (--num-images of --data {theirs}), this run "
                          f"on {drawn[1]}: other images, so its FIDs do not compare (an earlier fastddpm took the "
                          "first N images; it now draws them across the data): measure a reference on this draw")
    if recorded and identity:
        if not same_images(recorded, identity, labels=True):  # FID's feature network is trained on the labels
            raise ConfigError(f"bench quality: {given} was measured on --data {theirs} ({describe_identity(recorded)}),"
                              f" this run's --data {s.data} holds other images ({describe_identity(identity)}): FIDs "
                              "compare only on one dataset; pass its --data, or measure a reference on this one")
        return
    if theirs is not None and Path(str(theirs)).name.lower() != Path(s.data).name.lower():
        raise ConfigError(f"bench quality: {given} was measured on --data {theirs}, this run has --data {s.data}: "
                          "FIDs compare only on one dataset; pass its --data, or measure a reference on this one")


def _recorded(previous: dict, key: str):
    """A setting of an earlier quality.json. Files written before eval_sampler was a setting name it only in the
    reference run's config (the sampler its evaluations used)."""
    if key == "eval_sampler" and key not in previous["settings"]:
        return (previous["reference"].get("config") or {}).get("train", {}).get("eval_sampler", "ddim")
    if key == "sets":  # files written before --set: none
        return previous["settings"].get(key, [])
    return previous["settings"][key]


def _config(s: QualitySettings, source: str, extra: dict) -> RunConfig:
    base = {"data.source": source, "train.progress": False, "train.seed": s.seed, "train.device": s.device,
            "train.checkpoint_every": None, "train.sample_every_images": None,
            "train.eval_samples": s.eval_samples, "train.eval_sampler": s.eval_sampler,
            "train.eval_steps": s.eval_steps}
    return apply_overrides(get_preset(s.preset), {**base, **_overrides(s.sets), **extra}, source="bench quality")


class FinishedRuns:
    """The runs of an earlier call of the same bench into the same folder, written after each run finished
    (quality.partial.json, or quality.json once a call completed): a call cut off by a time limit keeps its finished
    runs, and the same command again trains only the rest. A run is reused when the device, torch and its resolved
    config are equal (the config holds every setting that changes its result); the partial file is written
    atomically after every run."""

    def __init__(self, out: Path, env: dict, log, *, remeasure: bool = False):
        self.partial, self.log = out / "quality.partial.json", log
        self.device = store.canonical(store.device_identity(env))
        self.runs: dict[str, dict] = {}
        if remeasure:
            return
        for path in (out / "quality.json", self.partial):  # the partial file is the newer of the two
            try:
                data = json.loads(path.read_text()) if path.is_file() else {}
            except ValueError:
                continue
            if data.get("schema") != SCHEMA or store.canonical(store.device_identity(data["environment"])) \
                    != self.device:
                continue
            runs = [data.get("reference"), data.get("fast"), *(data.get("options") or [])]
            self.runs.update({r["name"]: r for r in runs if r and "config" in r and r.get("evals") is not None})

    def take(self, name: str, cfg: RunConfig) -> dict | None:
        row = self.runs.get(name)
        if row is not None and store.canonical(row["config"]) == store.canonical(cfg.to_dict()):
            self.log(f"  [{name}] reused from {self.partial.parent} (an earlier call's finished run, same config)")
            return row
        return None

    def save(self, env: dict, s: QualitySettings, **runs) -> None:
        store.write_json(self.partial, {"schema": SCHEMA, "complete": False, "environment": env,
                                        "settings": dataclasses.asdict(s), **runs})


def _train_run(name: str, cfg: RunConfig, out_dir: Path, log) -> dict:
    from fastddpm.rundir.layout import RunDir
    from fastddpm.rundir.metrics import read_metrics
    from fastddpm.trainer.loop import train

    run_dir = out_dir / name
    if run_dir.exists():  # an earlier bench's (or an interrupted one's): a time to quality is measured whole
        log(f"  [{name}] removing {run_dir}, an earlier run of this bench's: trained again from scratch")
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    result = train(cfg, out_dir=run_dir, log=lambda m: log(f"  [{name}] {m}"))
    total_s = time.perf_counter() - t0
    records = read_metrics(RunDir(run_dir).metrics)
    evals = [r for r in records if r.get("event") == "eval"]
    losses = [r for r in records if "loss" in r]
    return {"name": name, "run_dir": str(run_dir), "config": cfg.to_dict(), "evals": evals,
            "final_fid": evals[-1]["fid"] if evals else None, "images_seen": result.images_seen,
            "train_wall_s": losses[-1]["wall_s"] if losses else None, "process_s": total_s,
            "images_per_s_last": losses[-1]["images_per_s"] if losses else None}


def own_sampling(cfg: RunConfig, base: RunConfig) -> tuple[str, int] | None:
    """The (sampler, steps) `auto` picks for cfg's objective (at its evaluation's guidance), where the option moved
    the objective to one that `auto` samples with another sampler than base's (flow against DDPM) and its
    evaluations (the sampler all the runs share, --eval-sampler) did not already use it; else None."""
    def auto(c: RunConfig) -> tuple[str, int]:
        return resolve_sampling("auto", None, c.diffusion.objective, guided=c.guided(c.train.sample_guidance))

    own = auto(cfg)
    return own if own[0] not in (auto(base)[0], cfg.eval_sampling()[0]) else None


def _score_own_sampler(row: dict, sampling: tuple[str, int], log) -> dict:
    """The FID of a finished run's EMA weights at its objective's own sampler: the evaluation --eval-every made at
    its end (same sample count, feature network, noise seed, precision and batch), with another sampler."""
    import torch

    from fastddpm.device import resolve_device, resolve_precision
    from fastddpm.eval.during_training import evaluation_choices
    from fastddpm.eval.evaluate import Evaluator, summary_line
    from fastddpm.sampling import load_for_sampling

    sampler, steps = sampling
    device, _ = resolve_device(row["config"]["train"]["device"])
    net, cfg = load_for_sampling(row["run_dir"], device=device)
    t = cfg.train
    evaluator = Evaluator.for_config(cfg, device=device, inception=t.eval_inception, log=log)
    with torch.inference_mode():
        metrics, _ = evaluator.evaluate(net, cfg, sampler=sampler, steps=steps, device=device,
                                        autocast_dtype=resolve_precision(t.precision, device).autocast_dtype,
                                        **evaluation_choices(cfg))
    log(f"  [{row['name']}] at its own sampler, {sampler}-{steps}: {summary_line(metrics)}")
    return {"sampler": sampler, "steps": steps, "nfe": metrics["sampling"]["nfe"], "fid": metrics["fid"],
            "precision": metrics["precision"], "recall": metrics["recall"],
            **({"class_accuracy": metrics["class_accuracy"]} if "class_accuracy" in metrics else {})}


def time_to_target(evals: list[dict], target: float) -> dict | None:
    """The first evaluation at or below the target FID: {wall_s, images_seen, fid}, or None."""
    for r in evals:
        if r["fid"] <= target:
            return {"wall_s": r["wall_s"], "images_seen": r["images_seen"], "fid": r["fid"], "step": r["step"]}
    return None


def default_out_dir() -> Path:
    return Path("runs") / f"bench-quality-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def run_quality(s: QualitySettings, out_dir: str | Path | None = None, *, argv: list[str] | None = None,
                log: Callable[[str], None] = print) -> dict:
    from fastddpm.device import resolve_device
    from fastddpm.measure import environment_record
    from fastddpm.rundir.files import check_writable_dir, make_writable_dir

    device, _ = resolve_device(s.device, setting="--device")
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    check_writable_dir(out, flag="bench quality --out", fix=store.OUT_FIX)  # made once the data is checked
    env = environment_record(device, argv)
    log(f"bench quality: {s.preset} on {env['device_name']} ({device}); torch {env['torch']}; "
        f"commit {str(env['git_commit'])[:12]}; {s.eval_samples:,} {s.eval_sampler}-{s.eval_steps} samples "
        "per evaluation")
    if device.type != "cuda":
        log("note: CPU run: the numbers describe this CPU and a check of the pipeline, not GPU time-to-quality")
    for extra in (s.fast_overrides, *(OPTIONS[name] for name in s.options)):  # refused before any work
        _config(s, s.data, {**_overrides(s.fast_overrides), **_overrides(extra)})
    base_cfg = _config(s, s.data, {})
    _check_features(base_cfg, log)
    cache_root = Path(base_cfg.data.cache_dir) if base_cfg.data.cache_dir else default_cache_dir()
    source, identity = _data_source(s, cache_root, log)
    make_writable_dir(out, flag="bench quality --out", fix=store.OUT_FIX)
    for flag, given in (("--fast-from", s.fast_from), ("--reference-from", s.reference_from)):
        if given is not None:  # before anything is trained
            _check_same_data(_read_earlier(given, flag), s, given, identity, source)
    finished = FinishedRuns(out, env, log, remeasure=s.remeasure)

    def train_run(name: str, cfg: RunConfig, **done) -> dict:
        row = finished.take(name, cfg)
        if row is None:
            row = _train_run(name, cfg, out, log)
            row["run"] = store.run_record(env)
        finished.save(env, s, **done, **({name: row} if name in ("reference", "fast") else {}))
        return row

    # 1. the reference: the preset's recipe as it is, FID at its end = the target.
    reused_fast = None
    if s.fast_from is not None:
        previous = _read_earlier(s.fast_from, "--fast-from")
        if previous.get("fast") is None:
            raise ConfigError(f"bench quality: {s.fast_from} holds no fast run (a --reference-only file?): "
                              "use it with --reference-from instead")
        for key in ("preset", "num_images", "eval_samples", "eval_sampler", "eval_steps", "seed", "sets",
                    "fast_overrides", "fast_max_images", "fast_eval_every_images"):
            theirs, ours = _recorded(previous, key), getattr(s, key)
            if json.dumps(theirs) != json.dumps(ours):
                raise ConfigError(f"bench quality: {s.fast_from} was measured with {key}={theirs!r}, this run has "
                                  f"{ours!r}: options compare with the fast run only at equal settings")
        reference, reused_fast = previous["reference"], {**previous["fast"], "reused_from": s.fast_from}
        log(f"reference and fast run: from {s.fast_from}: target FID {previous['target_fid']:.3f}")
    elif s.reference_from is not None:
        previous = _read_earlier(s.reference_from, "--reference-from")
        for key in ("preset", "num_images", "eval_samples", "eval_sampler", "eval_steps", "seed", "sets"):
            theirs = _recorded(previous, key)
            if json.dumps(theirs) != json.dumps(getattr(s, key)):
                fix = (f"--{key.replace('_', '-')} {theirs}" if key != "sets" else
                       " ".join(f"--set {item}" for item in theirs) or "no --set")
                raise ConfigError(f"bench quality: {s.reference_from} was measured with {key}={theirs!r}, this run "
                                  f"has {getattr(s, key)!r}: FIDs compare only at equal settings; pass {fix}")
        reference = previous["reference"]
        log(f"reference: from {s.reference_from}: FID {reference['final_fid']:.3f}")
    elif s.target_fid is not None:
        reference = {"name": "reference", "given_target": True, "final_fid": s.target_fid}
    else:
        extra = {"train.eval_every_images": s.reference_eval_every_images}
        if s.reference_epochs is not None:
            extra.update({"train.max_steps": None, "train.max_images": None, "train.max_epochs": s.reference_epochs})
        cfg = _config(s, source, extra)
        log(f"reference: {s.preset}'s recipe (batch {cfg.train.batch_size}, lr {cfg.train.lr:g}, "
            f"{cfg.diffusion.schedule} schedule, {cfg.diffusion.prediction})")
        reference = train_run("reference", cfg)
        log(f"reference: final FID {reference['final_fid']:.3f} after {reference['train_wall_s']:.1f} s of training")
    target = float(reference["final_fid"])
    if s.reference_only:
        result = {"schema": SCHEMA, "benchmark": "quality", "environment": env, "settings": dataclasses.asdict(s),
                  "data_source": source, "data_identity": identity, "target_fid": target, "reference": reference,
                  "fast": None, "options": [],
                  "features": reference["evals"][-1]["features_label"], "speedup_vs_reference": None}
        store.write_json(out / "quality.json", result)
        finished.partial.unlink(missing_ok=True)
        store.atomic_write_text(out / "quality.md", report_markdown(result))
        result["chart"] = write_chart(result, out / "quality.png", log)
        log(f"wrote {out}/quality.json (the reference only; use it with --reference-from)")
        result["out_dir"] = str(out)
        return result

    # 2. the fast recipe: the wall time to reach the target.
    if reused_fast is not None:
        fast, hit = reused_fast, reused_fast["time_to_target"]
    else:
        fast_cfg = _config(s, source, {**_overrides(s.fast_overrides), "train.max_steps": None,
                                       "train.max_epochs": None, "train.max_images": s.fast_max_images,
                                       "train.eval_every_images": s.fast_eval_every_images})
        log(f"fast: {', '.join(s.fast_overrides)}; up to {s.fast_max_images:,} images, evaluated every "
            f"{s.fast_eval_every_images:,}")
        fast = train_run("fast", fast_cfg, reference=reference)
        hit = time_to_target(fast["evals"], target)
        fast["time_to_target"] = hit
    if hit:
        log(f"fast: reached FID <= {target:.3f} after {hit['wall_s']:.1f} s of training ({hit['images_seen']:,} "
            f"images; FID {hit['fid']:.3f})")
    else:
        log(f"fast: did not reach FID {target:.3f} within {s.fast_max_images:,} images (best "
            f"{min(r['fid'] for r in fast['evals']):.3f})")

    # 3. options at equal images.
    option_rows = []
    base_cfg = _config(s, source, _overrides(s.fast_overrides))  # the fast recipe: its objective, DDPM
    images_for_options = hit["images_seen"] if hit else s.fast_max_images
    for name in s.options:
        cfg = _config(s, source, {**_overrides(s.fast_overrides), **_overrides(OPTIONS[name]),
                                  "train.max_steps": None, "train.max_epochs": None,
                                  "train.max_images": images_for_options,
                                  "train.eval_every_images": images_for_options})
        log(f"option {name}: {', '.join(OPTIONS[name])} on the fast recipe, {images_for_options:,} images")
        row = train_run(f"option-{name}", cfg, reference=reference, fast=fast, options=option_rows)
        row["overrides"] = list(OPTIONS[name])
        own = own_sampling(cfg, base_cfg)
        if own is not None and "own_sampler" not in row:
            row["own_sampler"] = _score_own_sampler(row, own, log)
        option_rows.append(row)
        finished.save(env, s, reference=reference, fast=fast, options=option_rows)

    result = {"schema": SCHEMA, "benchmark": "quality", "environment": env, "settings": dataclasses.asdict(s),
              "data_source": source, "data_identity": identity, "target_fid": target, "reference": reference,
              "fast": fast, "options": option_rows,
              "features": fast["evals"][0]["features_label"] if fast["evals"] else None}
    ref_wall = reference.get("train_wall_s")
    result["speedup_vs_reference"] = (ref_wall / hit["wall_s"] if hit and ref_wall and hit["wall_s"] > 0 else None)
    store.write_json(out / "quality.json", result)
    finished.partial.unlink(missing_ok=True)  # quality.json holds every run now
    store.atomic_write_text(out / "quality.md", report_markdown(result))
    result["chart"] = write_chart(result, out / "quality.png", log)
    log("")
    log(report_markdown(result))
    log(f"wrote {out}/quality.json, quality.md" + (", quality.png" if result["chart"] else ""))
    result["out_dir"] = str(out)
    return result


def report_markdown(r: dict) -> str:
    env = r["environment"]
    ref, fast = r["reference"], r["fast"]
    hit = fast.get("time_to_target") if fast else None
    lines = [f"# Time to quality: {r['settings']['preset']} on {r['data_source']}", "",
             f"{env['device_name']} ({env['device']}), torch {env['torch']}, commit {str(env['git_commit'])[:12]}, "
             f"{env['date_utc']}. FID in {r['features']}, {r['settings']['eval_samples']:,} samples, "
             f"{_recorded(r, 'eval_sampler')} {r['settings']['eval_steps']} steps.", "",
             "| run | recipe | images | train wall s | final FID | time to target s | images to target |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines.append(f"| reference | {r['settings']['preset']} as is | {store.fmt(ref.get('images_seen'), ',')} | "
                 f"{store.fmt(ref.get('train_wall_s'), '.1f')} | {store.fmt(ref.get('final_fid'), '.3f')} (target) | "
                 f"{store.fmt(ref.get('train_wall_s'), '.1f')} | {store.fmt(ref.get('images_seen'), ',')} |")
    if fast:
        lines.append(f"| fast | {', '.join(r['settings']['fast_overrides'])} | {store.fmt(fast['images_seen'], ',')} | "
                     f"{store.fmt(fast['train_wall_s'], '.1f')} | {store.fmt(fast['final_fid'], '.3f')} | "
                     f"{store.fmt(hit['wall_s'] if hit else None, '.1f')} | "
                     f"{store.fmt(hit['images_seen'] if hit else None, ',')} |")
    for o in r["options"]:
        lines.append(f"| option {o['name'].removeprefix('option-')} | fast + {', '.join(o['overrides'])} | "
                     f"{store.fmt(o['images_seen'], ',')} | {store.fmt(o['train_wall_s'], '.1f')} | "
                     f"{store.fmt(o['final_fid'], '.3f')} | "
                     f"- | - |")
    own = [o for o in r["options"] if o.get("own_sampler")]
    if own:
        from fastddpm.config import ConfigError, from_dict
        from fastddpm.diffusion import network_calls, schedule_from_config

        shared = f"{_recorded(r, 'eval_sampler')} {r['settings']['eval_steps']}"
        # as eval records its nfe: the timesteps the sampler's own spacing really walks on the recorded schedule
        # (a record whose config this version no longer reads: the count for distinct timesteps, an upper bound)
        try:
            schedule = schedule_from_config(from_dict(own[0]["config"]).diffusion)
        except (ConfigError, KeyError, TypeError):
            schedule = None
        shared_calls = network_calls(_recorded(r, "eval_sampler"), r["settings"]["eval_steps"],
                                     own[0]["config"]["diffusion"]["num_timesteps"], schedule=schedule)
        lines += ["", "Options whose objective samples best with another sampler, scored again with it (same "
                  "weights, features and noise):", "",
                  f"| option | FID at {shared} ({shared_calls} calls) | its own sampler | calls | FID |",
                  "| --- | --- | --- | --- | --- |"]
        for o in own:
            m = o["own_sampler"]
            lines.append(f"| {o['name'].removeprefix('option-')} | {store.fmt(o['final_fid'], '.3f')} | "
                         f"{m['sampler']} {m['steps']} | {m['nfe']} | {store.fmt(m['fid'], '.3f')} |")
    if fast and fast.get("reused_from"):
        lines += ["", f"The reference and fast rows are reused from {fast['reused_from']}; only the options trained "
                  "in this run."]
    speedup = r["speedup_vs_reference"]
    lines += ["", f"Speed-up in wall time to the target: {'n/a' if speedup is None else f'{speedup:.2f}x'} "
              "(reference's training time to its end / fast run's time to the target; compile included, "
              "evaluation excluded)."]
    return "\n".join(lines) + "\n"


def write_chart(r: dict, path: Path, log) -> str | None:
    from fastddpm import charts
    from fastddpm.eval.curve import cumulative_wall_s

    fig = charts.figure(7.5, 4.5)
    ax = fig.subplots()
    for run in [r["reference"], r["fast"] or {}, *r["options"]]:
        evals = run.get("evals") or []
        if evals:
            ax.plot(cumulative_wall_s(evals), [e["fid"] for e in evals], marker="o", label=run["name"])
    ax.axhline(r["target_fid"], color="grey", linestyle="--", label=f"target {r['target_fid']:.3f}")
    ax.set_xlabel("training wall time, s (compile included, evaluation excluded)")
    ax.set_ylabel("FID")
    charts.log_y(ax)
    ax.set_title(f"time to quality on {r['environment']['device_name']}\n{r['features']}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return str(charts.save(fig, path))
