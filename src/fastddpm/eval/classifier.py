"""The in-tool feature network: a small CNN classifier trained by fastddpm on the dataset's own train split.

Inception-v3 features (FID's standard) mean little for 28x28 grayscale digits or garments, and need a weights
file this package does not ship. For such data fastddpm trains its own feature network, once per dataset:

    [conv3x3 -> BatchNorm -> ReLU -> maxpool2] x 3  ->  adaptive pool to <= 4x4  ->  Linear -> ReLU (features)
                                                                                 ->  Linear (class logits)

FID, precision and recall are computed in the 128-d penultimate features (the ReLU output that feeds the
logits), and the logits give the class coverage of the samples. Its test accuracy is measured on the test split
(or a held-out 10% of the train split when the source has none) and reported with every number it produces.
Such FIDs are labelled "fastddpm-features": comparable between runs on the same dataset (same cache
fingerprint, same recipe), never with published Inception FIDs.

Training is cheap by design: ~100k parameters, 4 epochs of AdamW with a one-cycle learning rate (measured on
Fashion-MNIST: 64 s on 2 CPU cores, 91.9% test accuracy; benchmarks/RESULTS.md). The uint8 images live on the training
device (the GPU when there is one) and each step gathers its batch there, as fastddpm's trainer does.

The weights are cached as <cache_dir>/features/<slug>-<key>.safetensors, the key a hash of the prepared
dataset caches' names and fingerprints (train and test) and of the recipe: a changed dataset retrains it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastddpm.data import DataError, PreparedData
from fastddpm.rng import derive_seed, seed_torch

CLASSIFIER_FORMAT = "fastddpm-features-1"  # bump when the architecture or training code changes meaning
FEATURES_NAME = "fastddpm-features"
FEATURES_LABEL = "fastddpm-features (not comparable to published Inception FID)"


@dataclass(kw_only=True, frozen=True)
class ClassifierRecipe:
    """How the feature network is built and trained. Every field is part of its cache key."""

    widths: tuple[int, int, int] = (16, 32, 64)  # channels of the three conv stages
    feature_dim: int = 128  # the penultimate layer: FID's feature space
    epochs: float = 4.0  # passes over the (capped) train split
    min_steps: int = 200  # small datasets still get this many steps (repeated epochs)
    batch_size: int = 128
    lr: float = 3e-3  # AdamW peak learning rate (one-cycle: 15% linear warm-up, cosine to zero)
    weight_decay: float = 5e-4
    # Label smoothing keeps the loss, and so the gradients, away from zero once a small dataset is fitted: squared
    # gradients of ~1e-20 are float32 denormals, which made CPU training ~4x slower (measured on 2,000 images).
    label_smoothing: float = 0.1
    max_train_images: int = 100_000  # a fixed random subset of larger datasets
    holdout_share: float = 0.1  # held out of the train split when the source has no test split
    seed: int = 0


class FeatureClassifier(nn.Module):
    def __init__(self, *, in_channels: int, image_size: int, num_classes: int, widths: tuple[int, ...] = (16, 32, 64),
                 feature_dim: int = 128):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
            c = w
        side = max(1, min(4, image_size // 2 ** len(widths)))  # 28 -> 3x3, 32 -> 4x4, 256 -> 4x4
        layers += [nn.AdaptiveAvgPool2d(side), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(c * side * side, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    @staticmethod
    def normalize(x_u8: torch.Tensor) -> torch.Tensor:
        return x_u8.to(torch.float32).div(127.5).sub(1.0)  # uint8 -> [-1, 1], as the diffusion data

    def features_and_logits(self, x_BCHW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = F.relu(self.fc(self.body(x_BCHW)))  # (B, feature_dim): the penultimate layer
        return feats, self.head(feats)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.features_and_logits(x_BCHW)[1]


class UnlabelledDataError(DataError):
    """The data has no labels to train the feature classifier on: the fix is Inception features, not other data."""


class TooFewClassesError(UnlabelledDataError):
    """The data's labels name one class: a classifier of one class learns nothing (its cross-entropy is zero
    whatever its weights), so its features are its random initial ones. The fix is the same: Inception features."""


def check_classes_to_learn(data: PreparedData, where: str) -> None:
    """A TooFewClassesError where the labelled images of `data` hold fewer than 2 classes (after the
    UnlabelledDataError of data without labels)."""
    num_classes_of(data, where)
    labels = np.asarray(data.labels)
    present = np.unique(labels[labels >= 0])
    if len(present) < 2:
        names = list(data.class_names)
        name = names[present[0]] if present[0] < len(names) else str(present[0])
        raise TooFewClassesError(
            f"{where} has one class ({name!r}), so fastddpm cannot train its feature network (a classifier) for "
            "it: a classifier of one class learns nothing, and its features would be random. Fix: evaluate with "
            "Inception features: `fastddpm eval --features inception` or fastddpm.evaluate(inception='auto') "
            "(finds or downloads pytorch-fid's weights), --inception PATH (a local pt_inception-2015-12-05 weights "
            "file or a TorchScript feature extractor), or in training --eval-inception auto; or evaluate against "
            "data of 2 or more classes")


def num_classes_of(data: PreparedData, where: str) -> int:
    labels = np.asarray(data.labels)
    if labels.size == 0 or (labels < 0).all():
        raise UnlabelledDataError(
            f"{where} has no labels, so fastddpm cannot train its feature network (a classifier) for it. Fix: "
            "evaluate with Inception features: `fastddpm eval --features inception` or "
            "fastddpm.evaluate(inception='auto') (finds or downloads pytorch-fid's weights), --inception PATH (a "
            "local pt_inception-2015-12-05 weights file or a TorchScript feature extractor), or in training "
            "--eval-inception auto; or prepare a labelled copy (an image folder root/<label>/*.png)"
        )
    return max(len(data.class_names), int(labels.max()) + 1)


def _dataset_identity(data: PreparedData | None) -> dict | None:
    if data is None:
        return None
    return {"cache": data.cache_path.name, "fingerprint": data.meta.get("fingerprint"),
            "num_images": data.num_images, "transform": data.meta.get("transform")}


def cache_file(train: PreparedData, test: PreparedData | None, recipe: ClassifierRecipe, cache_root: Path) -> Path:
    key_blob = json.dumps({"format": CLASSIFIER_FORMAT, "train": _dataset_identity(train),
                           "test": _dataset_identity(test), "recipe": dataclasses.asdict(recipe)}, sort_keys=True)
    key = hashlib.sha256(key_blob.encode()).hexdigest()[:16]
    slug = train.cache_path.name.rsplit("-", 1)[0]  # the prepared cache's readable part, e.g. fashion-mnist-train
    return Path(cache_root) / "features" / f"{slug}-{key}.safetensors"


def _split(train: PreparedData, test: PreparedData | None, recipe: ClassifierRecipe):
    """(train images, train labels, test images, test labels, where the test set came from), uint8 numpy."""
    g = torch.Generator().manual_seed(derive_seed(recipe.seed, "feature-net-split"))
    labels = np.asarray(train.labels)
    keep = np.flatnonzero(labels >= 0)
    t_keep = np.flatnonzero(np.asarray(test.labels) >= 0) if test is not None else np.zeros(0, np.int64)
    if len(t_keep):
        test_x, test_y = np.asarray(test.images[t_keep]), np.asarray(test.labels)[t_keep]
        test_where = f"the test split ({len(t_keep):,} images)"
    else:  # no test split, or one without labels: the accuracy is measured on held-out training images
        perm = keep[torch.randperm(len(keep), generator=g).numpy()]
        n_hold = max(1, int(round(len(perm) * recipe.holdout_share)))
        hold, keep = np.sort(perm[:n_hold]), np.sort(perm[n_hold:])
        test_x, test_y = np.asarray(train.images[hold]), labels[hold]
        why = "no test split" if test is None else "the test split has no labels"
        test_where = f"a held-out {recipe.holdout_share:.0%} of the train split ({n_hold:,} images; {why})"
    if len(keep) > recipe.max_train_images:
        keep = np.sort(keep[torch.randperm(len(keep), generator=g).numpy()[:recipe.max_train_images]])
    return np.asarray(train.images[keep]), labels[keep], test_x, test_y, test_where


@torch.no_grad()
def accuracy(model: FeatureClassifier, images_u8: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000) -> float:
    model.eval()
    correct = 0
    for s in range(0, images_u8.shape[0], batch_size):
        logits = model(model.normalize(images_u8[s:s + batch_size]))
        correct += int((logits.argmax(1) == labels[s:s + batch_size]).sum())  # note: host sync, once per batch
    return correct / max(1, images_u8.shape[0])


def train_classifier(train: PreparedData, test: PreparedData | None, *, recipe: ClassifierRecipe,
                     device: torch.device, log: Callable[[str], None] = print) -> tuple[FeatureClassifier, dict]:
    """Train the feature network from scratch; returns (model in eval mode, info with test accuracy)."""
    where = f"the dataset {train.meta.get('source', train.cache_path)}"
    check_classes_to_learn(train, where)
    num_classes = num_classes_of(train, where)
    train_x, train_y, test_x, test_y, test_where = _split(train, test, recipe)
    n = train_x.shape[0]
    batch = min(recipe.batch_size, n)
    steps = max(recipe.min_steps, math.ceil(recipe.epochs * n / batch))
    t0 = time.perf_counter()
    # The whole uint8 split lives on the device; a step gathers its batch there (no loader, no host work).
    x_dev = torch.from_numpy(np.ascontiguousarray(train_x)).to(device)
    y_dev = torch.from_numpy(train_y.astype(np.int64)).to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_torch(derive_seed(recipe.seed, "feature-net-init"), device)
        model = FeatureClassifier(in_channels=train.channels, image_size=train.height, num_classes=num_classes,
                                  widths=recipe.widths, feature_dim=recipe.feature_dim).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    warmup = max(1, int(0.15 * steps))
    perm_gen = torch.Generator()
    model.train()
    perm = None
    per_epoch = n // batch
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        if k == 0:
            perm_gen.manual_seed(derive_seed(recipe.seed, "feature-net-epoch", epoch))
            perm = torch.randperm(n, generator=perm_gen).to(device)
        idx = perm[k * batch:(k + 1) * batch]
        # One-cycle: linear warm-up to the peak, then cosine to zero.
        lr = recipe.lr * ((step + 1) / warmup if step < warmup
                          else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(model(model.normalize(x_dev[idx])), y_dev[idx], label_smoothing=recipe.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    train_s = time.perf_counter() - t0
    test_acc = accuracy(model, torch.from_numpy(np.ascontiguousarray(test_x)).to(device),
                        torch.from_numpy(test_y.astype(np.int64)).to(device))
    model.eval()
    info = {"name": FEATURES_NAME, "format": CLASSIFIER_FORMAT, "test_accuracy": test_acc, "test_set": test_where,
            "test_images": int(test_x.shape[0]), "test_split": test_where.startswith("the test split"),
            "train_images": int(n), "steps": steps, "train_seconds": round(train_s, 2), "device": str(device),
            "num_classes": num_classes, "in_channels": train.channels, "image_size": train.height,
            "recipe": dataclasses.asdict(recipe), "train_data": _dataset_identity(train),
            "test_data": _dataset_identity(test)}
    log(f"feature network: trained on {n:,} images in {train_s:.1f} s ({steps:,} steps, {device}); "
        f"test accuracy {test_acc:.2%} on {test_where}")
    return model, info


def load_or_train_classifier(train: PreparedData, test: PreparedData | None, *, device: torch.device,
                             cache_root: Path, recipe: ClassifierRecipe = ClassifierRecipe(),
                             log: Callable[[str], None] = print) -> tuple[FeatureClassifier, dict, Path]:
    """The cached feature network for this dataset, training (and caching) it first if needed.
    Returns (model in eval mode on `device`, info (with 'cached': bool), path of the weights file)."""
    from fastddpm.data.cache import build_lock
    from fastddpm.rundir.files import load_safetensors, save_safetensors

    # before the cache too: a network cached by a version that trained on one class is as random
    check_classes_to_learn(train, f"the dataset {train.meta.get('source', train.cache_path)}")
    path = cache_file(train, test, recipe, cache_root)
    with build_lock(path.with_suffix(""), say=log):  # one trainer per dataset across processes
        built = {"train": train.built, "test": test.built if test is not None else None}
        if path.is_file() and not _built_from(path, built, train, test):
            log(f"feature network: {train.cache_path.name} was rebuilt after {path.name} was trained; retraining")
        elif path.is_file():
            state, meta = load_safetensors(path)
            info = json.loads(meta["info"])
            model = FeatureClassifier(in_channels=info["in_channels"], image_size=info["image_size"],
                                      num_classes=info["num_classes"], widths=tuple(info["recipe"]["widths"]),
                                      feature_dim=info["recipe"]["feature_dim"])
            model.load_state_dict(state)
            log(f"feature network: {path} (test accuracy {info['test_accuracy']:.2%} on {info['test_set']})")
            _say_if_weak(info, log)
            return model.to(device).eval(), {**info, "cached": True}, path
        log(f"feature network: none cached for {train.cache_path.name}; training one (once per dataset)")
        model, info = train_classifier(train, test, recipe=recipe, device=device, log=log)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(model.state_dict(), path, {"info": info, "format": CLASSIFIER_FORMAT, "data_built": built})
        _say_if_weak(info, log)
        return model, {**info, "cached": False}, path


# a feature network whose held-out accuracy is closer to chance than this share of the way from chance to 100%
# separates the classes little (10 classes: under 32.5%; 2: under 62.5%)
WEAK_FEATURES = 0.25


def weak_features(info: dict) -> str | None:
    """A warning when the feature network barely recognises the data's classes (images that do not look like
    their labels, labels that are noise): FID in its features then says little; None when it does its job."""
    k, acc = info["num_classes"], info["test_accuracy"]
    if acc >= 1 / k + WEAK_FEATURES * (1 - 1 / k):
        return None
    return (f"warning: the feature network recognises only {acc:.1%} of {info['test_set']}'s images (chance: "
            f"{1 / k:.1%} for {k} classes): its features tell these classes apart poorly, so FID, precision/recall "
            "and class accuracy measured in them say little; measure in Inception-v3's features instead (fastddpm "
            "eval --features inception, train --eval-inception auto, fastddpm.evaluate(inception='auto'))")


def _say_if_weak(info: dict, log) -> None:
    said = weak_features(info)
    if said:
        log(said)


def _built_from(path: Path, built: dict, train: PreparedData, test: PreparedData | None) -> bool:
    """Whether the cached network was trained on these builds of the train and test caches."""
    from fastddpm.rundir.files import read_safetensors_metadata

    recorded = json.loads(read_safetensors_metadata(path).get("data_built", "{}"))
    return all(d.computed_from_this_build(recorded.get(k), path)
               for k, d in (("train", train), ("test", test)) if d is not None)
