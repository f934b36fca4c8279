"""Evaluation shared by the ranks of a torchrun job: each draws its share of the samples, rank 0 gathers them in
order and scores them, and the samples are the ones a single process draws (sample k's noise is its own). Under
FSDP (whose forward needs every rank) `--eval-every` runs now instead of being refused."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from fastddpm.config import apply_overrides, get_preset, resolve_model_shape
from fastddpm.eval.evaluate import sample_uint8
from fastddpm.models import build_unet

from eval_fixtures import fmnist_splits  # noqa: F401 - a session fixture (a real train/test slice)
from test_distributed import torchrun, train_args

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo process groups on Linux and macOS")

SAMPLING = dict(num_samples=10, sampler="dpmpp-2m-sde", steps=2, eta=0.0, seed=4, batch_size=3,
                device=torch.device("cpu"), autocast_dtype=None, guidance=2.0)
# 7 samples in batches of at most 500 over 2 ranks: one batch of 4 a rank, not one of 7 and one wasted
SHRUNK = {**SAMPLING, "num_samples": 7, "batch_size": 500}


def _conditional_model():
    cfg = apply_overrides(get_preset("tiny"), {"model.conditional": True})
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=3, class_names=("a", "b", "c")))
    cfg = resolve_model_shape(cfg, (1, 1, 12, 12))
    torch.manual_seed(0)
    return build_unet(cfg.model).eval(), cfg


# 13 samples in batches of 4 over 2 ranks: 2 batches a rank, 16 drawn, the last 3 dropped
EVALUATION = {**SAMPLING, "num_samples": 13, "batch_size": 4}


class _PooledFeatures(torch.nn.Module):
    """A feature network whose features do not depend on the batch, bit for bit: the image's 3x3 average pools
    (16 numbers for 12x12), and as the logits of 3 classes the first 3 of them."""

    def normalize(self, x):
        return x.float() / 255

    def features_and_logits(self, x):
        feats = torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
        return feats, feats[:, :3]


def _pooled_evaluator(reference: bool):
    """An Evaluator on _PooledFeatures: with reference statistics of 60 random 'real' feature vectors (20 a
    class) for rank 0 and one process, without for the other ranks."""
    from fastddpm.eval.evaluate import Evaluator
    from fastddpm.eval.features import ClassReference, FeatureNet, ReferenceStats
    from fastddpm.eval.frechet import mean_cov

    net = FeatureNet(name="pooled", label="pooled", comparable_to_inception_fid=False, module=_PooledFeatures(),
                     device=torch.device("cpu"), identity="pooled", info={}, num_classes=3)
    if not reference:
        return Evaluator(net=net, ref=None, classifier=net)
    real = torch.rand(60, 16, generator=torch.Generator().manual_seed(0))
    mu, sigma = mean_cov(real)
    per_class = [mean_cov(real[torch.arange(60) % 3 == c]) for c in range(3)]
    ref = ReferenceStats(mu=mu, sigma=sigma, num_images=60, pr_feats=real, label_histogram=None, meta={})
    classes = ClassReference(mu=np.stack([m for m, _ in per_class]), sigma=np.stack([c for _, c in per_class]),
                             counts=np.array([20, 20, 20]))
    return Evaluator(net=net, ref=ref, classifier=net, classes=classes)


def _rank(rank: int, world_size: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                         world_size=world_size)
    try:
        model, cfg = _conditional_model()
        images, timing = sample_uint8(model, cfg, rank=rank, world_size=world_size, **SAMPLING)
        shrunk, shrunk_timing = sample_uint8(model, cfg, rank=rank, world_size=world_size, **SHRUNK)
        scored = _pooled_evaluator(reference=rank == 0).evaluate(model, cfg, rank=rank, world_size=world_size,
                                                                  **EVALUATION)
        if rank == 0:
            torch.save({"images": images, "timing": timing, "shrunk": shrunk, "shrunk_timing": shrunk_timing,
                        "scored": scored}, out_path)
        else:
            assert images is None and shrunk is None and scored is None
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_draw_the_samples_one_process_draws_in_order(tmp_path):
    """10 samples in batches of 3 over 2 ranks: 4 batches (2 a rank, an FSDP forward needs every rank at each),
    gathered in batch order; a conditional model, so that an image in the wrong place would carry another class's
    noise and label. Then a shared evaluation, features extracted on each rank, scored as one process scores."""
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    shared = torch.load(out, weights_only=False)
    model, cfg = _conditional_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the CPU's sums then run in the same order
    try:
        alone, timing = sample_uint8(model, cfg, **SAMPLING)
        one_batch, _ = sample_uint8(model, cfg, **SHRUNK)
        scored_alone = _pooled_evaluator(reference=True).evaluate(model, cfg, **EVALUATION)
    finally:
        torch.set_num_threads(threads)
    # Scored: every rank extracted its own samples' features, rank 0 gathered them in batch order and dropped the
    # padding. Features that do not depend on the batch give one process's numbers exactly, the per-class ones
    # (sample i asks for class i % 3) included, which an image or feature out of place would change.
    (metrics, images), (metrics_alone, images_alone) = shared["scored"], scored_alone
    assert images.shape == (13, 1, 12, 12) and torch.equal(images, images_alone)
    for key in ("fid", "precision", "recall", "class_accuracy", "class_accuracy_by_class", "per_class_fid"):
        assert metrics[key] == metrics_alone[key], key
    assert len(metrics["per_class_fid"]) == 3 and metrics["sampling"]["processes"] == 2
    assert shared["images"].shape == alone.shape == (10, 1, 12, 12)
    assert torch.equal(shared["images"], alone)
    assert shared["timing"]["batches"] == 4 and shared["timing"]["drawn"] == 12 and shared["timing"]["processes"] == 2
    assert timing["batches"] == 4 and "processes" not in timing  # one process: ceil(10 / 3) = 4 batches too
    t = shared["shrunk_timing"]
    assert (t["batches"], t["batch_size"], t["drawn"]) == (2, 4, 8) and shared["shrunk"].shape == (7, 1, 12, 12)
    # batches of 4 against one of 7: the same samples up to float rounding in the network's batched sums
    diff = (shared["shrunk"].int() - one_batch.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory, fmnist_splits):  # noqa: F811
    """A 2-step FSDP run of a conditional model on 2 gloo ranks with --eval-every: (its run directory, torchrun's
    output). Conditional, so that the scores depend on the order of the gathered samples and features (class
    accuracy: sample i asks for class i % 10), which FID and precision/recall do not."""
    out = tmp_path_factory.mktemp("fsdp-eval") / "run"
    r = torchrun(2, train_args(fmnist_splits, out, "--max-steps", "2", "--parallel", "fsdp", "--eval-every", "16",
                               "--eval-samples", "12", "--eval-steps", "2", "--conditional"),
                 env_extra={"FASTDDPM_CACHE": os.environ["FASTDDPM_CACHE"]})
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r.stdout


@pytest.mark.slow
def test_fsdp_evaluates_during_training_as_one_process_would(fsdp_run):
    """--eval-every under --parallel fsdp (it was refused: rank 0 alone could not run the sharded EMA): both ranks
    sample, rank 0 scores; the last evaluation is the one a single process makes of the final EMA weights."""
    from fastddpm.eval.during_training import evaluation_choices
    from fastddpm.eval.evaluate import Evaluator
    from fastddpm.sampling import load_for_sampling

    out, stdout = fsdp_run
    assert "samples from the EMA weights, shared by 2 processes" in stdout
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [rec["images_seen"] for rec in records] == [16, 32]
    assert records[-1]["sampling"]["processes"] == 2 and records[-1]["sampling"]["drawn"] == 12

    model, cfg = load_for_sampling(out / "ema.safetensors")
    evaluator = Evaluator.for_config(cfg, device=torch.device("cpu"), log=lambda *a: None)
    sampler, steps = cfg.eval_sampling()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        alone, _ = evaluator.evaluate(model, cfg, sampler=sampler, steps=steps, device=torch.device("cpu"),
                                      **evaluation_choices(cfg))
    finally:
        torch.set_num_threads(threads)
    assert np.isclose(records[-1]["fid"], alone["fid"], rtol=1e-4), (records[-1]["fid"], alone["fid"])
    assert np.isclose(records[-1]["precision"], alone["precision"]) and np.isclose(records[-1]["recall"],
                                                                                    alone["recall"])
    assert records[-1]["class_accuracy"] == alone["class_accuracy"]


def _eval_args(checkpoint, out, *extra) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--out", str(out), "--device", "cpu", "--no-progress", "--compile",
            "off", "--num-samples", "12", "--sampler", "ddim", "--steps", "2", *extra]


@pytest.mark.slow
def test_eval_under_torchrun_scores_the_samples_one_process_draws(fsdp_run, tmp_path, capsys):
    """`torchrun -m fastddpm eval`: each rank samples half (batches of 6, rank r the r-th), rank 0 gathers, scores
    and writes; the scores are the ones a single process gets from the same batches. The checkpoint is the FSDP
    run's sharded one (.dcp), read by every rank without a collective."""
    from fastddpm.cli import main

    run, _ = fsdp_run
    sharded = sorted((run / "checkpoints").glob("ckpt_*.dcp"))[-1]
    env = {"FASTDDPM_CACHE": os.environ["FASTDDPM_CACHE"]}
    r = torchrun(2, _eval_args(sharded, tmp_path / "shared"), env_extra=env, entry=["-m", "fastddpm", "eval"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "batch 6 on each of 2 processes" in r.stdout
    assert r.stdout.count("wrote ") == 1, r.stdout  # rank 0 alone writes and reports
    shared_json, = (tmp_path / "shared").glob("eval_*.json")
    shared = json.loads(shared_json.read_text())
    assert shared["sampling"]["processes"] == 2 and shared["sampling"]["drawn"] == 12
    assert shared["checkpoint"]["file"].endswith(".dcp")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        assert main(["eval", *_eval_args(sharded, tmp_path / "alone", "--batch-size", "6")]) == 0
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    alone_json, = (tmp_path / "alone").glob("eval_*.json")
    assert alone_json.name == shared_json.name  # the same evaluation: how many processes is not part of its name
    alone = json.loads(alone_json.read_text())
    assert "processes" not in alone["sampling"]
    for key in ("fid", "precision", "recall"):
        assert np.isclose(shared[key], alone[key], rtol=1e-6), (key, shared[key], alone[key])
    (row,), (alone_row,) = shared["guidance"], alone["guidance"]
    assert row["class_accuracy_by_class"] == alone_row["class_accuracy_by_class"]
    assert row["per_class_fid"].keys() == alone_row["per_class_fid"].keys()  # values: singular covariances, so
    # float rounding moves them (the exact comparison is test_two_ranks_draw_the_samples_one_process_draws_in_order)
    assert (tmp_path / "shared" / shared_json.with_suffix(".png").name).read_bytes() == \
        alone_json.with_suffix(".png").read_bytes()  # the samples, in order


@pytest.mark.slow
def test_eval_under_torchrun_ends_every_rank_with_rank_0s_setup_error(fsdp_run, tmp_path):
    """Rank 0 alone prepares the reference data; when it cannot (here, no such data), every rank stops with exit
    code 2 and rank 0's message, instead of the others waiting for samples to gather."""
    run, _ = fsdp_run
    missing = tmp_path / "no-such-data.npz"
    r = torchrun(2, _eval_args(run, tmp_path / "out", "--data", str(missing)), timeout=120,
                 env_extra={"FASTDDPM_CACHE": os.environ["FASTDDPM_CACHE"]}, entry=["-m", "fastddpm", "eval"])
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "FutureWarning" not in text  # the group's shutdown reads no deprecated object
    assert f"error: {missing}: no such file or folder" in text, text  # rank 0's, printed before the others stop
    assert "rank 1: stopped, since rank 0 could not set up the evaluation" in text, text
    assert "exitcode  : 2" in text  # torchrun's summary: the DataError's code, on both ranks
    assert not (tmp_path / "out").exists()
    # a choice every rank refuses alike on the checkpoint they agreed on: said by the node's first process alone
    r = torchrun(2, _eval_args(run, tmp_path / "out", "--sampler", "ddpm"), timeout=120,
                 env_extra={"FASTDDPM_CACHE": os.environ["FASTDDPM_CACHE"]}, entry=["-m", "fastddpm", "eval"])
    text = r.stdout + r.stderr
    assert r.returncode != 0 and text.count("error: --steps 2: --sampler ddpm walks every one") == 1, text
