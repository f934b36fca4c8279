"""One evaluation: sample from a model, embed the samples, and score them against the real data's statistics.

    sample_uint8   EMA weights, full batches (one static shape: compiled once), autocast, uint8 like saved PNGs
    score          FID (exact Frechet distance, float64), precision/recall (k = 3), class coverage
    Evaluator      a feature network + the reference statistics, built once and reused (CLI and training)

Sampling randomness comes from its own generators, sample k's from (seed, "eval-sample", k): an evaluation never
touches the global RNG or the training streams, so it cannot change a run it is part of, and its samples do not
depend on the batch size nor on how many processes share the sampling and the feature extraction
(Evaluator.evaluate's `rank` and `world_size`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fastddpm.config import CLI, ConfigError, RunConfig, Spelling, default_spacing
from fastddpm.data import DataError
from fastddpm.diffusion import network_calls, sample, schedule_from_config, to_uint8
from fastddpm.eval.features import (
    ClassReference,
    Extracted,
    FeatureNet,
    ReferenceStats,
    build_feature_net,
    check_compatible,
    class_reference_stats,
    extract,
    extracted_from,
    reference_stats,
)
from fastddpm.eval.classifier import TooFewClassesError, UnlabelledDataError, num_classes_of
from fastddpm.eval.frechet import frechet_distance
from fastddpm.eval.precision_recall import DEFAULT_K, class_coverage, precision_recall
from fastddpm.rng import derive_seed


# as --num-samples: a covariance and 3-NN radii need a few images on each side
MIN_REFERENCE_IMAGES = 10


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quiet(*args, **kwargs) -> None:
    """The log of a rank other than 0 of a shared evaluation: rank 0 speaks for the group."""


def balanced_labels(num_images: int, num_classes: int) -> torch.Tensor:
    """Class i % K for image i: every class equally often (to within one), the classes of each batch mixed."""
    return torch.arange(num_images) % num_classes


def batches_per_rank(num_samples: int, batch_size: int, world_size: int = 1) -> tuple[int, int]:
    """(batches each of `world_size` processes draws, the batch size they draw): `num_samples` in batches of at
    most `batch_size`, every process as many. Shared, the batch shrinks to the smallest that takes as many
    batches: 12 samples in batches of up to 500 on 2 processes are a batch of 6 each, not 2 of 12."""
    rounds = math.ceil(num_samples / (batch_size * world_size))
    if world_size > 1:
        batch_size = math.ceil(num_samples / (rounds * world_size))
    return rounds, batch_size


class EvaluationStopped(Exception):
    """A stop signal arrived while an evaluation was sampling (sample_uint8's `should_stop`): nothing was scored."""


@torch.no_grad()
def sample_uint8(model, cfg: RunConfig, *, num_samples: int, sampler: str, steps: int, eta: float, seed: int,
                 batch_size: int, device: torch.device, autocast_dtype: torch.dtype | None,
                 progress: bool = False, guidance: float | None = None, spacing: str | None = None,
                 rank: int = 0, world_size: int = 1, gather: bool = True,
                 should_stop: Callable[[], bool] | None = None) -> tuple[torch.Tensor | None, dict]:
    """`num_samples` images as uint8 (N, C, H, W) on the CPU, and timings. Every batch is full (the tail of the
    last one is dropped), so a compiled model sees one shape. A conditional model samples every class equally
    often (image i has class i % K, see balanced_labels) with classifier-free guidance `guidance`.

    Shared by `world_size` processes of a torch.distributed group (torchrun), each calls it with its `rank`: it
    draws batches rank, rank + world_size, ...; every rank draws as many batches (an FSDP model's forward is a
    collective), each of at most `batch_size`, and rank 0 gathers the samples, the same as one process draws
    (sample k's noise is its own). Ranks other than 0 get None for the images. With `gather` False every rank
    keeps its own batches instead (batches rank, rank + world_size, ..., one after the other), and the timings
    are its own. `should_stop` is asked before each batch: True ends the sampling with EvaluationStopped (one
    process only: ranks that stopped apart would wait for each other's batches)."""
    schedule = schedule_from_config(cfg.diffusion).to(device)
    m = cfg.model
    rounds, batch_size = batches_per_rank(num_samples, batch_size, world_size)
    num_batches = rounds * world_size
    shape = (batch_size, m.image_channels, m.image_size, m.image_size)
    bar = None
    if progress and rank == 0:
        from fastddpm.progress import progress_bar

        per_batch = network_calls(sampler, steps, cfg.diffusion.num_timesteps, schedule=schedule, spacing=spacing)
        bar = progress_bar(num_batches // world_size * per_batch, unit="model-call", desc="sampling")
    labels = balanced_labels(num_batches * batch_size, m.num_classes) if m.conditional else None
    chunks = []
    _sync(device)
    t0 = time.perf_counter()
    first_batch_s = None
    for i in range(rank, num_batches, world_size):
        if should_stop is not None and should_stop():
            if bar is not None:
                bar.close()
            raise EvaluationStopped(f"stopped after {len(chunks)} of {num_batches} sample batches")
        x = sample(model, schedule, shape, sampler=sampler, steps=steps, eta=eta, prediction=cfg.diffusion.prediction,
                   spacing=spacing, seed=derive_seed(seed, "eval-sample"), first_image=i * batch_size,
                   device=device, autocast_dtype=autocast_dtype,
                   progress=bar, num_classes=m.num_classes, guidance=1.0 if guidance is None else guidance,
                   labels=labels[i * batch_size:(i + 1) * batch_size] if labels is not None else None)
        chunks.append(to_uint8(x).cpu())  # note: device -> host copy, a sync per batch
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - t0
    if world_size > 1 and gather:  # the gather is part of the sampling's time: rank 0 has the samples after it
        images = _gather_batches(torch.stack(chunks), num_batches, rank, world_size, device)
        wall_s = time.perf_counter() - t0
    else:
        wall_s = time.perf_counter() - t0
        images = torch.cat(chunks)
    if bar is not None:
        bar.close()
    # per image drawn: every batch is full, so ceil(N / B) * B images took wall_s
    timing = {"wall_s": wall_s, "samples_per_s": num_batches * batch_size / max(wall_s, 1e-9),
              "first_batch_s": first_batch_s,
              "batches": num_batches, "batch_size": batch_size, "drawn": num_batches * batch_size}
    if world_size > 1:
        timing["processes"] = world_size
    if rounds > 1:  # the first batch carries compile / warm-up time; the rest is the steady state
        timing["steady_samples_per_s"] = (rounds - 1) * world_size * batch_size / max(wall_s - first_batch_s, 1e-9)
    if world_size > 1 and not gather:
        return images, timing
    return (images[:num_samples] if images is not None else None), timing


def _gather_batches(mine_NBCHW: torch.Tensor, num_batches: int, rank: int, world_size: int,
                    device: torch.device) -> torch.Tensor | None:
    """Rank 0 receives every rank's batches (rank r holds batches r, r + world_size, ...) in batch order; the
    others get None. NCCL moves CUDA tensors only, gloo CPU ones."""
    import torch.distributed as dist

    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = mine_NBCHW.to(on)
    gathered = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, gathered, dst=0)
    if rank != 0:
        return None
    # batch i is rank i % W's (i // W)-th
    ordered = torch.stack(gathered, dim=1).reshape(num_batches, *mine.shape[1:]).cpu()
    return ordered.reshape(-1, *mine.shape[2:])


def score(images_u8: torch.Tensor, net: FeatureNet, ref: ReferenceStats, *, k: int = DEFAULT_K,
          batch_size: int = 500, labels: torch.Tensor | None = None, classifier: FeatureNet | None = None,
          classes: ClassReference | None = None, class_names: tuple[str, ...] = ()) -> dict:
    """FID, precision/recall and (classifier features) class coverage of uint8 samples against `ref`. With the
    classes the samples were asked for (`labels`, a conditional model): class accuracy, the share that the
    dataset's `classifier` assigns to the asked class, and per-class FID against `classes`."""
    t0 = time.perf_counter()
    ex = extract(net, images_u8, batch_size=batch_size,
                 labels=labels.numpy() if labels is not None and classes is not None else None)
    asked_pred = None
    if labels is not None:
        asked_pred = ex.pred if classifier is None or classifier is net else extract(classifier, images_u8).pred
    out = _scores(ex, net, ref, k=k, labels=labels, asked_pred=asked_pred, classes=classes, class_names=class_names)
    out["score_s"] = time.perf_counter() - t0
    return out


def _scores(ex: Extracted, net: FeatureNet, ref: ReferenceStats, *, k: int, labels: torch.Tensor | None,
            asked_pred: np.ndarray | None, classes: ClassReference | None, class_names: tuple[str, ...]) -> dict:
    """score's numbers from the samples' features `ex`, and (a conditional model) the dataset classifier's
    predictions `asked_pred` of the samples asked for classes `labels`."""
    mu, sigma = ex.stats.mean_cov()
    fid = frechet_distance(mu, sigma, ref.mu, ref.sigma)
    # Equal-sized sets, as in Kynkaanniemi et al.: the reference subset is a random order, a prefix is random.
    m = min(ex.feats.shape[0], ref.pr_feats.shape[0])
    pr = precision_recall(ref.pr_feats[:m], ex.feats[:m], k=k, device=net.device)
    out = {"fid": fid, "precision": pr["precision"], "recall": pr["recall"], "pr_k": k, "pr_num_images": m,
           "num_samples": int(ex.feats.shape[0]), "features": net.name, "features_label": net.label}
    if ex.pred is not None:
        out["coverage"] = class_coverage(ex.pred, net.num_classes)
    if labels is not None:
        pred, asked = asked_pred, labels.numpy()
        out["class_accuracy"] = float((pred == asked).mean())
        out["class_accuracy_by_class"] = {class_names[c] if c < len(class_names) else str(c):
                                          float((pred[asked == c] == c).mean()) for c in np.unique(asked)}
        if classes is not None:
            out["per_class_fid"] = {
                class_names[c] if c < len(class_names) else str(c):
                frechet_distance(*ex.class_stats[c].mean_cov(), classes.mu[c], classes.sigma[c])
                for c in sorted(ex.class_stats)
                if ex.class_stats[c].n >= 2 and c < len(classes.counts) and classes.counts[c] >= 2}
    return out


def data_class_names(data, num_classes: int) -> tuple[str, ...]:
    """The data's class names by id, "0", "1", ... where it has none (as training names a model's classes)."""
    names = tuple(str(n) for n in data.class_names)[:num_classes]
    return names + tuple(str(i) for i in range(len(names), num_classes))


def check_class_names(model_names, data_names, *, where: str) -> None:
    """A ConfigError where the model's class names and the reference data's differ. Class accuracy and per-class
    FID pair the two by id, so other names under the same ids score the wrong classes. Integer names ("0", "1",
    ... or folders 1/, 2/, 3/: the names of data without names) say nothing, and are never compared. Names are
    compared ignoring case, as --class matches them ("Cat" and "cat" are one class), but for names that differ
    from another of their side only in case (there case tells the classes apart, and is compared)."""
    model_names, data_names = tuple(model_names), tuple(data_names)

    def keys(names: tuple[str, ...]) -> list[str]:
        folded = [n.casefold() for n in names]
        return [f if folded.count(f) == 1 else n for n, f in zip(names, folded)]

    folded, data_folded = keys(model_names), keys(data_names)
    if (folded == data_folded or all(n.isdigit() for n in model_names)
            or all(n.isdigit() for n in data_names)):
        return
    shown = f"the model's classes by id are {list(model_names)}, the reference data's ({where}) {list(data_names)}"
    if sorted(folded) == sorted(data_folded):
        raise ConfigError(f"the same class names with other ids: {shown}; class accuracy and per-class FID pair "
                          "classes by id, so they would score each class against another: evaluate against the "
                          "data the model was trained on (--data SOURCE), or data that numbers its classes as it did")
    raise ConfigError(f"other classes: {shown}; class accuracy and per-class FID pair classes by id, so they would "
                      "be meaningless: evaluate against the data the model was trained on (--data SOURCE), or a "
                      f"folder whose class folders have the model's names ({', '.join(model_names)})")


@dataclass(kw_only=True)
class Evaluator:
    """A feature network and the reference statistics of the real data in it; for a conditional model also the
    dataset's classifier (class accuracy) and the per-class statistics (per-class FID)."""

    net: FeatureNet
    ref: ReferenceStats | None  # None: a rank other than 0 of a shared evaluation (it extracts, rank 0 scores)
    classifier: FeatureNet | None = None
    classes: ClassReference | None = None
    # The reference data's classes: its names by id (the model's where the data's are integers: after
    # check_class_names, names on both sides are the same), and its true labels' histogram (None: no labels).
    # ref.label_histogram is the classifier's predictions on the same images, not the labels.
    class_names: tuple[str, ...] = ()
    label_histogram: list[int] | None = None
    # The reference split as prepared (None on a rank other than 0): `fastddpm eval` compares it with the data the
    # checkpoint recorded, so a score against other images than the model learned is said.
    reference_data: object | None = None

    @classmethod
    def for_config(cls, cfg: RunConfig, *, device: torch.device, inception: str | None = None,
                   reference_split: str | None = None, log: Callable[[str], None] = print,
                   progress: bool = False, reference: bool = True, said: Spelling = CLI) -> "Evaluator":
        """Feature net for cfg.data (trained once and cached, or Inception from a file) and the statistics of
        the reference split (default: the split the model was trained on). `reference` False: the feature
        networks alone, for the ranks other than 0 of a shared evaluation (built after rank 0 has cached them).
        `said`: how the Inception file's errors spell `inception` (`--inception PATH`, inception='PATH')."""
        from pathlib import Path

        from fastddpm.data import prepare

        d = cfg.data
        cache_root = Path(d.cache_dir) if d.cache_dir else None
        split = reference_split or d.split
        data = prepare(d.source, split=split, resize=d.resize, resize_mode=d.resize_mode, image_mode=d.image_mode,
                       skip_bad=d.skip_bad, cache_dir=cache_root, progress=progress)
        check_compatible(cfg.model, data, where=f"({d.source}, split {split})")
        if data.num_images < MIN_REFERENCE_IMAGES:  # before a classifier trains on it
            raise ConfigError(
                f"the reference data ({d.source}, split {split}) has {data.num_images} image(s): FID needs a "
                f"covariance and precision/recall each image's {DEFAULT_K} nearest neighbours, so at least "
                f"{MIN_REFERENCE_IMAGES} (thousands for a meaningful FID); evaluate against the data the model was "
                "trained on (--data SOURCE)")
        labels = np.asarray(data.labels)
        labelled = labels[labels >= 0]
        label_histogram = np.bincount(labelled, minlength=len(data.class_names)).tolist() if labelled.size else None
        class_names = data_class_names(data, len(label_histogram or ()))
        if all(n.isdigit() for n in class_names) and len(cfg.model.class_names) == len(class_names):
            class_names = tuple(cfg.model.class_names)
        if cfg.model.conditional and labelled.size:  # before a classifier trains on it
            num_classes = num_classes_of(data, f"{d.source}, split {split}")
            if num_classes != cfg.model.num_classes:
                # class accuracy and per-class FID would score ids the classifier cannot predict
                raise ConfigError(
                    f"the model is conditional on {cfg.model.num_classes} classes but the reference data "
                    f"({d.source}, split {split}) has {num_classes}: evaluate against the data the model was "
                    "trained on (--data SOURCE)")
            check_class_names(cfg.model.class_names, data_class_names(data, num_classes),
                              where=f"{d.source}, split {split}")
        # Building modules draws their initial weights from the global RNG: fork it, so that setting up an
        # evaluation inside a training run leaves the run's RNG state (saved in its checkpoints) as it was.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            classifier = classes = None
            if cfg.model.conditional:
                # first, so that data without labels fails before Inception statistics are computed
                try:
                    classifier = build_feature_net(d, device=device, inception=None, cache_root=cache_root,
                                                   log=log, progress=progress, prepared={split: data})
                except UnlabelledDataError as e:
                    # UnlabelledDataError's own fix, Inception features, would not help: class accuracy needs the
                    # dataset's classifier whatever the feature space of FID
                    one = isinstance(e, TooFewClassesError)
                    has = "only one class" if one else "none"
                    fix = ("labelled data of 2 or more classes" if one
                           else "a labelled copy (an image folder root/<label>/*.png)")
                    raise DataError(
                        f"the model is conditional: its class accuracy is measured by a classifier trained on the "
                        f"labels of {d.source}, which has {has} (--features inception does not change that): "
                        f"evaluate against the labelled data the model was trained on (--data SOURCE), or prepare "
                        f"{fix}") from None
            net = classifier if classifier is not None and not inception else build_feature_net(
                d, device=device, inception=inception, cache_root=cache_root, log=log, progress=progress,
                prepared={split: data}, said=said)
            if not reference:
                return cls(net=net, ref=None, classifier=classifier, class_names=class_names,
                           label_histogram=label_histogram)
            ref = reference_stats(data, net, cache_root=cache_root, log=log, progress=progress)
            if net.num_classes is not None and cfg.model.conditional:
                # per-class covariances in the classifier's 128-d features only
                classes = class_reference_stats(data, net, cache_root=cache_root, log=log)
        return cls(net=net, ref=ref, classifier=classifier, classes=classes, class_names=class_names,
                   label_histogram=label_histogram, reference_data=data)

    def check_same_as_rank_0(self, rank: int, world_size: int) -> None:
        """Under torchrun, on every rank once each has built its Evaluator (a collective): a ConfigError where
        this rank's feature networks are not rank 0's. Each rank loads the network rank 0 trained or found and
        cached; a rank that cannot see that cache (another node, a node-local FASTDDPM_CACHE) would train or
        find its own, and rank 0 would score features from two networks."""
        if world_size == 1:
            return
        import torch.distributed as dist

        mine = (self.net.identity, None if self.classifier in (None, self.net) else self.classifier.identity)
        box = [mine]
        dist.broadcast_object_list(box, src=0)
        if box[0] != mine:
            raise ConfigError(f"rank {rank}'s feature network {mine} is not rank 0's {box[0]}: each rank loads the "
                              "one rank 0 cached, so every node must see rank 0's cache folder: a FASTDDPM_CACHE "
                              "(or the run's data.cache_dir) on a filesystem every node shares")

    def describe(self) -> dict:
        info = {k: v for k, v in self.net.info.items() if k not in ("recipe", "train_data", "test_data")}
        return {"name": self.net.name, "label": self.net.label,
                "comparable_to_published_inception_fid": self.net.comparable_to_inception_fid, **info}

    def evaluate(self, model, cfg: RunConfig, *, num_samples: int, sampler: str = "ddim", steps: int = 50,
                 eta: float = 0.0, seed: int = 0, batch_size: int = 500, device: torch.device,
                 autocast_dtype: torch.dtype | None = None, progress: bool = False,
                 guidance: float | None = None, spacing: str | None = None,
                 rank: int = 0, world_size: int = 1, should_stop: Callable[[], bool] | None = None
                 ) -> tuple[dict, torch.Tensor] | None:
        """(metrics + sampling timings, the uint8 samples). A conditional model is sampled class-balanced with
        classifier-free guidance `guidance` (default 1: plain conditional) and scored for its classes too.

        Shared by the `world_size` ranks of a torch.distributed group (`fastddpm eval` under torchrun,
        `--eval-every`), each calling it with its `rank` and the same arguments: each draws its share of the
        samples and extracts their features, rank 0 gathers both and scores them (the numbers one process gets,
        up to float rounding) and returns; the other ranks, whose Evaluator has no reference (for_config's
        `reference` False), get None."""
        m = cfg.model
        assert self.ref is not None or world_size > 1, "an Evaluator built with reference=False scores nothing"
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            images, timing = sample_uint8(model, cfg, num_samples=num_samples, sampler=sampler, steps=steps, eta=eta,
                                          seed=seed, batch_size=batch_size, device=device,
                                          autocast_dtype=autocast_dtype, progress=progress, guidance=guidance,
                                          spacing=spacing, rank=rank, world_size=world_size, gather=False,
                                          should_stop=should_stop)
            if world_size > 1:
                shared = self._score_shared(images, timing, cfg, num_samples=num_samples, rank=rank,
                                            world_size=world_size, device=device)
                if shared is None:
                    return None
                metrics, images = shared
            else:
                labels = balanced_labels(images.shape[0], m.num_classes) if m.conditional else None
                metrics = score(images, self.net, self.ref, labels=labels, classifier=self.classifier,
                                classes=self.classes, class_names=m.class_names)
        T = cfg.diffusion.num_timesteps
        metrics["sampling"] = {"sampler": sampler, "steps": T if sampler == "ddpm" else steps,
                               "spacing": spacing or default_spacing(sampler, cfg.diffusion.objective),
                               "nfe": network_calls(sampler, steps, T, schedule=schedule_from_config(cfg.diffusion),
                                                    spacing=spacing),
                               "eta": eta, "seed": seed, **timing}
        if m.conditional:
            metrics["guidance"] = 1.0 if guidance is None else guidance
        return metrics, images

    def _score_shared(self, mine: torch.Tensor, timing: dict, cfg: RunConfig, *, num_samples: int, rank: int,
                      world_size: int, device: torch.device) -> tuple[dict, torch.Tensor] | None:
        """Each rank's features of its own samples (`mine`, its batches one after the other), gathered with the
        samples by rank 0 in batch order and scored there: the feature network's work is shared as the sampling
        is (50,000 Inception passes on one GPU can take as long as the sampling on eight)."""
        m = cfg.model
        t0 = time.perf_counter()
        ex = extract(self.net, mine)
        asked = None  # the dataset classifier's predictions, where it is not the feature network itself
        if m.conditional and self.classifier is not None and self.classifier is not self.net:
            asked = extract(self.classifier, mine).pred
        num_batches, batch = timing["batches"], timing["batch_size"]

        def gathered(t: torch.Tensor | np.ndarray | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = torch.as_tensor(t)
            return _gather_batches(t.reshape(num_batches // world_size, batch, *t.shape[1:]), num_batches, rank,
                                   world_size, device)

        images, feats, pred, asked = gathered(mine), gathered(ex.feats), gathered(ex.pred), gathered(asked)
        if rank != 0:
            return None
        images, feats = images[:num_samples], feats[:num_samples]
        pred = pred[:num_samples].numpy() if pred is not None else None
        labels = balanced_labels(num_samples, m.num_classes) if m.conditional else None
        all_ex = extracted_from(feats, pred, device=self.net.device,
                                labels=labels.numpy() if labels is not None and self.classes is not None else None)
        asked_pred = None
        if labels is not None:
            asked_pred = pred if asked is None else asked[:num_samples].numpy()
        metrics = _scores(all_ex, self.net, self.ref, k=DEFAULT_K, labels=labels, asked_pred=asked_pred,
                          classes=self.classes, class_names=m.class_names)
        metrics["score_s"] = time.perf_counter() - t0  # this rank's features, the gather and the scores
        return metrics, images


def evaluator_for_run(cfg: RunConfig, *, device: torch.device, trained_on: str, data_given: bool,
                      said: Spelling = CLI, **for_config) -> Evaluator:
    """Evaluator.for_config for a checkpoint's evaluation (`fastddpm eval`, fastddpm.evaluate): a DataError about
    the run's own data (`data_given` False: a source moved or deleted since training) adds where the run trained
    (`trained_on`) and the way to evaluate against another copy of it, spelt by `said` (--data SOURCE,
    data='SOURCE')."""
    try:
        return Evaluator.for_config(cfg, device=device, said=said, **for_config)
    except DataError as e:
        if not data_given and not isinstance(e, UnlabelledDataError):  # other data would have no labels either
            raise DataError(f"{e}\n(The checkpoint was trained on data.source={trained_on!r}; pass "
                            f"{said('data', 'SOURCE')} to evaluate against another copy of that data.)") from None
        raise


def summary_line(metrics: dict) -> str:
    """One line for logs: FID, precision/recall, coverage (and guidance and class accuracy), and the features."""
    text = (f"FID {metrics['fid']:.3f}, precision {metrics['precision']:.3f}, recall {metrics['recall']:.3f} "
            f"({metrics['num_samples']:,} samples")
    if "class_accuracy" in metrics:
        text = f"guidance {metrics['guidance']:g}: class accuracy {metrics['class_accuracy']:.1%}, " + text
    cov = metrics.get("coverage")
    if cov is not None:
        text += f"; classes present {cov['classes_present']:.0%}, entropy ratio {cov['entropy_ratio']:.3f}"
    return text + f") in {metrics['features_label']}"


def as_json_safe(obj):
    if isinstance(obj, dict):
        return {k: as_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
