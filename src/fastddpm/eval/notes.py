"""The notes `fastddpm eval` prints beside its scores: a feature network too weak to trust, where its accuracy was
measured, reference images other than the ones the checkpoint's run trained on, per-class FIDs that float rounding
moves. Each is a sentence that says what the number can and cannot tell."""

from __future__ import annotations

from pathlib import Path

from fastddpm.config import CLI, Spelling

# Below either, the dataset's own classifier is too weak a feature space to trust its FID (it reached 87% on 2,000
# Fashion-MNIST images, over 90% on the full set)
WEAK_FEATURES_ACCURACY = 0.5
WEAK_FEATURES_IMAGES = 1_000


def weak_classifier(info: dict) -> str | None:
    """Why the dataset's classifier (fastddpm-features, and the judge of class accuracy) is too weak to trust, or
    None: under WEAK_FEATURES_ACCURACY on its test images, or trained on fewer than WEAK_FEATURES_IMAGES."""
    trained_images = info.get("train_images", WEAK_FEATURES_IMAGES)
    if info["test_accuracy"] < WEAK_FEATURES_ACCURACY or trained_images < WEAK_FEATURES_IMAGES:
        return (f"test accuracy {info['test_accuracy']:.1%}{accuracy_measured_on(info)}, trained on "
                f"{trained_images:,} images")
    return None


def accuracy_measured_on(info: dict) -> str:
    """Where the classifier's accuracy was measured, with the count (" on 14 held-out training images"): 100% on
    14 images says little, and images held out of the train split are no test split. Empty for a network cached
    before the count was recorded and without a record of where."""
    if "test_images" in info:
        where = "test-split" if info.get("test_split") else "held-out training"
        n = info["test_images"]
        return f" on {n:,} {where} image{'s' if n != 1 else ''}"
    return f" on {info['test_set']}" if info.get("test_set") else ""


def other_data_note(saved: dict | None, evaluator, cfg, *, trained, said: Spelling = CLI) -> str | None:
    """A note when the reference images are not the ones the checkpoint's run trained on: the source's files
    changed since (a resume is refused on them), or other data was given. Said, not refused: scoring a model on
    other data can be what the user means, but the score then says how close the samples come to that data.
    None when they are the same images (from any path), when the checkpoint recorded no data (an
    ema.safetensors, a checkpoint older than the record) or when another split is the reference. The sentence
    names its settings as `said` spells them (`--data SOURCE` for `fastddpm eval`, data='SOURCE' for the API)."""
    from fastddpm.data.cache import describe_identity, same_images

    data = evaluator.reference_data
    if not saved or data is None or (evaluator.ref.meta.get("split") or trained.split) != trained.split:
        return None
    labels = bool(cfg.model.conditional)  # an unconditional model read the pixels alone
    now = data.identity()
    if same_images(saved, now, labels=labels):
        return None
    key = "pixels_sha256" if not labels and "pixels_sha256" in saved else "sample_sha256"
    digest = "pixel digest" if key == "pixels_sha256" else "digest of pixels and labels"
    was_source, source = saved.get("source"), cfg.data.source
    same_place = was_source == source or (was_source is not None and Path(source).exists()
                                          and Path(source).resolve() == Path(was_source).resolve())
    # with the run's own reading options, other images at the same place are its files changed since
    read_as = [k for k in ("resize", "resize_mode", "image_mode") if getattr(cfg.data, k) != getattr(trained, k)]
    how = ("this evaluation reads other data" if not same_place else
           f"this evaluation reads {source} with other options "
           f"({' '.join(said(k.replace('_', '-'), getattr(cfg.data, k)) for k in read_as)})" if read_as else
           f"the images at {source} changed since the checkpoint was written")
    fix = (f"leave out {' and '.join(said(k.replace('_', '-')) for k in read_as)}" if same_place and read_as else
           f"evaluate against a copy of those images ({said('data', 'SOURCE')})")
    return (f"{how}: the checkpoint's run trained on {was_source} ({describe_identity(saved)}) with "
            f"sampled {digest} {saved.get(key)}, this evaluation's reference is {source} "
            f"({describe_identity(now)}) with {now.get(key)}. The scores measure the samples against other images "
            f"than the model learned; for its score on its own data, {fix}.")


def per_class_fid_notes(num_samples: int, real_counts, dim: int, class_names) -> list[str]:
    """Where per-class FIDs cannot be trusted: a class's covariance from no more images than the features have
    dimensions is singular, and its FID moves with float rounding. The samples' side is fixed by sampling more;
    the real side (a class with few training images) is not."""
    notes = []
    k = len(real_counts)
    per_class = num_samples // k
    if per_class <= dim:
        notes.append(f"note: per-class FID from {per_class} samples a class, no more than the features' {dim} "
                     "dimensions: each class's covariance is singular and its FID moves with float rounding (two runs "
                     f"can differ in the first digits); compare classes at --num-samples {(dim + 1) * k:,} or more")
    few = [c for c, n in enumerate(real_counts) if 2 <= n <= dim]
    if few:
        named = ", ".join(f"{class_names[c] if c < len(class_names) else c} ({int(real_counts[c])})" for c in few[:8])
        more = f" and {len(few) - 8} more" if len(few) > 8 else ""
        notes.append(f"note: {len(few)} class(es) have no more real images than the features' {dim} dimensions: "
                     f"{named}{more}; their reference covariance is singular, so their per-class FID stays unstable "
                     "at any --num-samples: compare those classes by class accuracy")
    return notes
