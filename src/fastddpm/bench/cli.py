"""`fastddpm bench throughput`: the command-line face of fastddpm.bench.

The top-level CLI calls `add_bench_parser(subparsers)` and, for `bench`, `run_bench(args)`.
`python -m fastddpm.bench.cli bench throughput ...` runs the same thing standalone.
Building the parser imports no torch, so `fastddpm --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

# plain dataclasses: no torch import
from fastddpm.config import DEFAULT_SAMPLER, PRESETS, SAMPLERS, SPACINGS, positive_int

_BENCH_DESCRIPTION = """\
Benchmarks of the training step, honest and self-describing: warmed up before timing, timed
with CUDA events, repeated (median and spread), MFU against a peak measured in the same run,
and the device, driver, library versions, git commit and command written next to every number.

  throughput   images/s, step time, compile time, MFU, peak memory, recompiles and input wait
               for each preset x batch size, with the trainer's own fast path
  ladder       the seed's optimisation ladder, one change per rung (PNG files -> workers ->
               RAM -> AMP -> batch 192 -> compile -> resident -> fused -> CUDA graphs ->
               auto batch -> the layouts auto picks on a GPU), then the MLP ladder of seed 002
  quality      time to quality: wall time (compile included) for a fast recipe to reach the FID
               that the seed's recipe reaches at its end; options compared by FID at equal images
  samplers     FID (and class accuracy) against network calls per image for every sampler at
               5-100 steps, DDPM-1000 as the reference, on a trained checkpoint
"""

_SAMPLERS_DESCRIPTION = """\
Image quality against sampling cost. For each sampler x step count, and DDPM over all T steps
as the reference point, draw --num-samples images from the checkpoint's EMA weights and score
them as `fastddpm eval` does: FID, precision/recall and, for a conditional model, class
accuracy (class-balanced, at one guidance scale). Every point starts from the same noise for
the same seed, so samplers differ only by their steps. Cost: network calls per image (NFE)
and samples/s. FID at a few thousand samples has a seed-to-seed spread as large as the gaps
between good samplers: --spread-points are drawn again with --spread-seeds and reported as
mean and min-max. With --samplers or --steps and no --spread-points, only the default spread
points inside the grid asked for are drawn again (maybe none).
"""

_SAMPLERS_EPILOG = """\
examples:
  fastddpm bench samplers runs/quickstart                    # the table of RESULTS.md: 2,000 samples a point
  fastddpm bench samplers runs/cond --guidance 2             # a conditional model, class accuracy too
  fastddpm bench samplers runs/quickstart --samplers dpmpp-2m --steps 8,10,12 --no-ddpm  # these 3 points
  fastddpm bench samplers runs/quickstart --samplers dpmpp-2m --steps 8,10,12 --no-ddpm --spread-points dpmpp-2m-10
  fastddpm bench samplers runs/quickstart --quick            # 20 samples at 2 and 4 steps: a pipeline check

Writes OUT/samplers.json, samplers.csv, samplers.md after every point and samplers.png (FID vs
NFE, needs matplotlib) at the end; OUT defaults to RUN_DIR/bench-samplers. Points already in OUT
with the same checkpoint, settings, device and torch are reused (--remeasure draws them again).
Exit codes: 0 at least one point measured, 1 none, 2 bad flags or checkpoint.
"""

_LADDER_EPILOG = """\
examples:
  fastddpm bench ladder                                # seed-1layer on all of fashion-mnist
  fastddpm bench ladder --num-images 20000 --workers 4 --out runs/ladder-h100
  fastddpm bench ladder --quick                        # tiny preset, 96 images, a few steps (CI, CPU)
  fastddpm bench ladder --rungs 0,1,2,3,3b,4,5 --out runs/ladder   # then, into the same folder:
  fastddpm bench ladder --rungs 6,7,8,9 --skip-mlp --out runs/ladder

--quick sets --preset tiny --num-images 96 --warmup-steps 1 --steps 2 --repeats 2, divides every
rung's batch by 4 (64 -> 16, 192 -> 48), and the MLP ladder to 1 epoch on 2,000 images; flags
given explicitly still win. On a CPU the CUDA rungs (fp16, bf16, CUDA graphs) are reported as
skipped with the reason, and so is compile under --quick; on a GPU without native bf16 (before
Ampere, sm80) so are bf16 (3b) and CUDA graphs (8, which need bf16 there).
Writes OUT/ladder.json, ladder.md, ladder.csv, mlp.csv after every rung, and ladder.png (needs
matplotlib) at the end. Rungs already measured in OUT with the same settings, data, device and
torch are reused (--remeasure measures them again); --rungs measures only the rungs named, so a
ladder can be split over several runs into one folder.
Exit codes: 0 at least one rung is measured, 1 none is, 2 bad flags or config.
"""

_THROUGHPUT_DESCRIPTION = """\
Time the trainer's step (model + AdamW + EMA + TrainStep, built exactly as `fastddpm train`
builds them) on synthetic uint8 images (1x28x28, 60,000 resident on the device, or streamed
from a memory-mapped file with --data-placement stream), for each preset x batch size.

Per variant: compile / warm-up time (the first --warmup-steps steps, timed on their own);
steady-state step time over --repeats repeats of --steps steps (CUDA events; perf_counter on
a CPU, where the numbers describe that CPU and are not GPU claims), as median [min-max];
images/s and its ratio to the first variant; MFU = FlopCounterMode FLOPs of one step / median
step time / the matmul peak measured in this run in the step's own dtype (bf16 or fp16 under
autocast, TF32 for fp32 on CUDA, fp32 on a CPU; an 8192^3 matmul on CUDA, the faster of a
matmul and a 3x3 oneDNN convolution on a CPU), printed next to it;
peak memory (CUDA); recompiles after warm-up and graph breaks; and the share of the step
spent producing the batch. A variant that fails (out of memory, a compile error) is recorded
as failed with its reason, and the others still run.

The results are rewritten after every variant. Run the same command into the same --out again
(after a time limit killed it, say) and the variants measured there with the same settings,
device and torch are reused, not measured again (--remeasure measures them all).
"""

_THROUGHPUT_EPILOG = """\
examples:
  fastddpm bench throughput                                   # seed-1layer,seed-2layer x 64,192,512,1024
  fastddpm bench throughput --presets seed-1layer --batch-sizes 192,512 --out runs/bench-h100
  fastddpm bench throughput --compile off --cuda-graphs off   # the eager baseline, same table
  fastddpm bench throughput --data-placement stream           # pinned, double-buffered host->device copies
  fastddpm bench throughput --quick                           # tiny preset, batch 8,16: < 1 min on a CPU (CI)
  fastddpm bench throughput --device cpu                      # cpu-demo at 64: fp32/bf16 x eager/compile side by side
  fastddpm bench throughput --device cpu --presets seed-1layer --choices fp32-eager,auto-auto   # the CPU default

--quick sets --presets tiny --batch-sizes 8,16 --warmup-steps 2 --steps 3 --repeats 2 (no choices);
flags given explicitly still win.

Writes OUT/throughput.json (every number, the environment and all settings) and
OUT/throughput.md (the table below plus the environment), and prints the table:
  | preset | batch | images/s | x first | step ms median [min-max] | compile s |
  | MFU % (peak dtype) | % of roofline (binds) | peak mem GiB | recompiles | graph breaks | input wait % |
  | status |
Exit codes: 0 at least one variant ran, 1 every variant failed, 2 bad flags or config.
"""

def _given(args: argparse.Namespace, quick: dict, names: tuple[str, ...]) -> dict:
    """A command's settings: --quick's values (when given), then every flag of `names` given explicitly."""
    base = dict(quick) if args.quick else {}
    base.update({name: getattr(args, name) for name in names if getattr(args, name) is not None})
    return base


def _csv_list(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def _csvints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in _csv_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _csvpositive_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(positive_int(item) for item in _csv_list(text))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers: {e}") from None


def _add_throughput_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tp = commands.add_parser("throughput", help="images/s, compile time, MFU, memory per preset x batch size",
                             description=_THROUGHPUT_DESCRIPTION, epilog=_THROUGHPUT_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    what = tp.add_argument_group("what to benchmark")
    what.add_argument("--presets", type=_csv_list, default=None, metavar="A,B",
                      help=f"presets to benchmark, from {', '.join(PRESETS)} (default seed-1layer,seed-2layer on a "
                           "GPU, cpu-demo on a CPU)")
    what.add_argument("--batch-sizes", type=_csvpositive_ints, default=None, metavar="N,M",
                      help="images per step; every preset runs at each (default 64,192,512,1024 on a GPU, 64 on a "
                           "CPU)")
    what.add_argument("--choices", type=_csv_list, default=None, metavar="A,B",
                      help="precision / compile / layout choices side by side, each PRECISION-MODE[-cl][-lo][-gc][-ma]"
                           "[-apN] (PRECISION auto|fp32|bf16|fp16, MODE eager|compile|auto, -cl channels_last, -lo "
                           "Inductor's layout optimization forced, -gc gradient checkpointing: peak memory vs step "
                           "time, -ma Inductor's max-autotune, -apN attention heads padded to N): every preset and "
                           "batch runs each, and `x first` compares them (default on a CPU without --presets: "
                           "fp32-eager,"
                           "bf16-eager,bf16-compile,fp32-compile,bf16-eager-cl; otherwise none: one variant per "
                           "--precision and --compile)")
    what.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                      help="autocast precision, as `train --precision` (default auto: bf16 on GPUs that have it; on a "
                           "CPU bf16 where it has native bf16, else fp32)")
    what.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                      help="torch.compile the loss and the update (default auto: on for CUDA)")
    what.add_argument("--cuda-graphs", choices=("auto", "off", "capture", "reduce-overhead"), default="auto",
                      help="CUDA graphs for the step (default auto: capture the whole step on CUDA)")
    what.add_argument("--data-placement", choices=("device", "stream"), default="device",
                      help="device: the uint8 dataset resident on the device (default); stream: pinned, "
                           "double-buffered copies from a memory-mapped file")
    what.add_argument("--device", default="auto", metavar="DEVICE",
                      help="auto (CUDA when present, default), cpu, cuda, cuda:N")
    what.add_argument("--image-shape", type=_csvpositive_ints, default=None, metavar="C,H,W",
                      help="the synthetic images' shape (default: the presets' data: 3,32,32 for ddpm-cifar10, "
                           "1,28,28 for the MNIST-sized ones)")
    timing = tp.add_argument_group("how long to time it")
    timing.add_argument("--warmup-steps", type=positive_int, default=None, metavar="N",
                        help="steps timed as compile / warm-up, before the steady state (default 10)")
    timing.add_argument("--steps", type=positive_int, default=None, metavar="N",
                        help="steps per timed repeat (default 50)")
    timing.add_argument("--repeats", type=positive_int, default=None, metavar="R",
                        help="timed repeats; the median is reported with [min-max] (default 5)")
    timing.add_argument("--quick", action="store_true",
                        help="the CI run: tiny preset, batch 8,16, warm-up 2, 2 x 3 steps (< 1 min on a CPU)")
    out = tp.add_argument_group("output")
    out.add_argument("--out", default=None, metavar="DIR",
                     help="output folder for throughput.json / .md (default runs/bench-throughput-<UTC time>); "
                          "variants already measured there with the same settings, device and torch are reused")
    out.add_argument("--remeasure", action="store_true",
                     help="measure every variant, even those already in DIR/throughput.json")
    return tp


def _add_ladder_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    lp = commands.add_parser("ladder", help="the seed's optimisation ladder: one change per rung, images/s each",
                             description="Seed 000's DDPM ladder (rungs 0-5) and past it (6-9), each rung adding "
                                         "one change, on the same model and images; then seed 002's MLP ladder.",
                             epilog=_LADDER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    lp.add_argument("--data", default=None, metavar="SOURCE", help="any fastddpm data source (default fashion-mnist)")
    lp.add_argument("--preset", default=None, choices=tuple(PRESETS), help="the model (default seed-1layer)")
    lp.add_argument("--num-images", type=positive_int, default=None, metavar="N", help="cap the dataset")
    lp.add_argument("--steps", type=positive_int, default=None, metavar="N", help="steps per timed repeat (50)")
    lp.add_argument("--warmup-steps", type=positive_int, default=None, metavar="N", help="warm-up steps (10)")
    lp.add_argument("--repeats", type=positive_int, default=None, metavar="R", help="timed repeats (3)")
    lp.add_argument("--workers", type=int, default=None, metavar="N",
                    help="DataLoader workers from rung 1 on (default min(8, CPU count))")
    lp.add_argument("--device", default="auto", metavar="DEVICE", help="auto (default), cpu, cuda, cuda:N")
    lp.add_argument("--mlp-epochs", type=positive_int, default=None, metavar="N", help="MLP epochs (5)")
    lp.add_argument("--rungs", type=_csv_list, default=None, metavar="K,..",
                    help="measure only these rungs (keys 0,1,2,3,3b,4,5,6,7,8,9; default all); the others are "
                         "reused from OUT/ladder.json or shown as not run")
    lp.add_argument("--skip-mlp", action="store_true",
                    help="run only the DDPM ladder (MLP rows already in OUT are kept)")
    lp.add_argument("--remeasure", action="store_true", help="measure again the rungs already in OUT/ladder.json")
    lp.add_argument("--quick", action="store_true",
                    help="tiny model, 96 images, batches / 4, a few steps: about a minute on a CPU")
    lp.add_argument("--out", default=None, metavar="DIR", help="run folder (default runs/bench-ladder-<UTC time>)")
    return lp


def ladder_settings(args: argparse.Namespace):
    from fastddpm.bench.ladder import QUICK, LadderSettings

    base = _given(args, QUICK, ("data", "preset", "num_images", "steps", "warmup_steps", "repeats", "workers",
                                "mlp_epochs", "rungs"))
    return LadderSettings(**base, device=args.device, mlp=not args.skip_mlp, quick=args.quick,
                          remeasure=args.remeasure)


def _run_ladder(args: argparse.Namespace) -> int:
    from fastddpm.bench.ladder import default_out_dir, run_ladder

    args.out = args.out or default_out_dir()  # named here, so that a Ctrl-C can say where the rungs are
    result = run_ladder(ladder_settings(args), args.out)
    return 0 if any(r["status"] == "ok" for r in result["rungs"]) else 1


_QUALITY_EPILOG = """\
examples:
  fastddpm bench quality --out runs/quality-h100                       # reference (40 epochs), then fast
  fastddpm bench quality --target-fid 3.2 --options min-snr-5,cosine   # skip the reference, compare options
  fastddpm bench quality --reference-only --out runs/quality-ref              # then:
  fastddpm bench quality --reference-from runs/quality-ref/quality.json --out runs/quality-fast   # then:
  fastddpm bench quality --fast-from runs/quality-fast/quality.json --options min-snr-5,cosine
  fastddpm bench quality --quick                                       # tiny U-Net, 256 images: a CPU check

--quick sets --preset tiny --num-images 256 --eval-samples 32 --eval-steps 4 --reference-epochs 1,
evaluates every 256 images, and trains the fast recipe (batch 32, lr 2e-3) for 512 images; flags given
explicitly still win. FIDs are in the feature space of `fastddpm eval` (the
dataset's own classifier unless the runs use --set train.eval_inception=PATH).
Writes OUT/quality.json, quality.md, quality.png (matplotlib) and one run directory per training run.
Exit codes: 0 done (whether or not the target was reached; see quality.json), 2 bad flags or config.
"""


def _add_quality_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from fastddpm.bench import quality  # no torch import: the parser stays fast
    from fastddpm.bench.quality import FAST_RECIPE, OPTIONS

    qp = commands.add_parser("quality", help="time to quality: wall time to reach the seed recipe's final FID",
                             description=quality.__doc__,
                             epilog=_QUALITY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    qp.add_argument("--data", default=None, metavar="SOURCE", help="labelled data (default fashion-mnist)")
    qp.add_argument("--preset", default=None, choices=tuple(PRESETS), help="the model and reference recipe "
                    "(default seed-1layer)")
    qp.add_argument("--num-images", type=positive_int, default=None, metavar="N",
                    help="cap the dataset: N images drawn across it (and a quarter as many test images)")
    qp.add_argument("--eval-samples", type=positive_int, default=None, metavar="N",
                    help="samples per evaluation (default 5000)")
    qp.add_argument("--eval-sampler", default=None, choices=SAMPLERS,
                    help=f"the evaluation samples' sampler (default {DEFAULT_SAMPLER}: one sampler for every run "
                         "compared, DDPM's best; a flow option is also scored with its own)")
    qp.add_argument("--eval-steps", type=positive_int, default=None, metavar="K", help="its steps (default 50)")
    qp.add_argument("--reference-epochs", type=float, default=None, metavar="E",
                    help="length of the reference run (default: the preset's, 40 epochs)")
    qp.add_argument("--reference-eval-every", dest="reference_eval_every_images", type=positive_int, default=None,
                    metavar="N", help="images between the reference run's evaluations (default 600000)")
    qp.add_argument("--reference-from", default=None, metavar="FILE",
                    help="reuse the reference of an earlier quality.json instead of training it again")
    qp.add_argument("--target-fid", type=float, default=None, metavar="X", help="skip the reference: this target")
    qp.add_argument("--fast", dest="fast_overrides", type=_csv_list, default=None, metavar="S.F=V,..",
                    help=f"the fast recipe's overrides of the preset (default {','.join(FAST_RECIPE)})")
    qp.add_argument("--set", dest="sets", action="append", default=None, metavar="SECTION.FIELD=VALUE",
                    help="a setting of every run, the reference's included (repeatable), e.g. "
                         "train.eval_inception=PATH for Inception FID; the recipes' own settings win")
    qp.add_argument("--fast-max-images", type=positive_int, default=None, metavar="N",
                    help="the fast run's length (default 1200000)")
    qp.add_argument("--fast-eval-every", dest="fast_eval_every_images", type=positive_int, default=None,
                    metavar="N", help="images between the fast run's evaluations (default 120000)")
    qp.add_argument("--options", type=_csv_list, default=None, metavar="A,B",
                    help=f"options to compare on the fast recipe at equal images: {', '.join(OPTIONS)}")
    qp.add_argument("--fast-from", default=None, metavar="FILE",
                    help="reuse the reference, target and fast run of an earlier quality.json; train only --options")
    qp.add_argument("--reference-only", action="store_true",
                    help="train and record only the reference (then: --reference-from OUT/quality.json)")
    qp.add_argument("--remeasure", action="store_true",
                    help="train again the runs an earlier call finished in OUT (default: reuse them)")
    qp.add_argument("--device", default="auto", metavar="DEVICE", help="auto (default), cpu, cuda, cuda:N")
    qp.add_argument("--quick", action="store_true", help="tiny U-Net, 256 images: a CPU check of the pipeline")
    qp.add_argument("--out", default=None, metavar="DIR", help="output folder (default runs/bench-quality-<UTC time>)")
    return qp


def quality_settings(args: argparse.Namespace):
    from fastddpm.bench.quality import QUICK, QualitySettings

    base = _given(args, QUICK, ("data", "preset", "num_images", "eval_samples", "eval_sampler", "eval_steps",
                                "reference_epochs", "reference_eval_every_images", "reference_from", "target_fid",
                                "fast_overrides", "sets", "fast_max_images", "fast_eval_every_images", "options",
                                "fast_from"))
    return QualitySettings(**base, reference_only=args.reference_only, remeasure=args.remeasure, device=args.device,
                           quick=args.quick)


def _run_quality(args: argparse.Namespace) -> int:
    from fastddpm.bench.quality import default_out_dir, run_quality

    args.out = args.out or default_out_dir()  # named here, so that a Ctrl-C can say where the runs are
    run_quality(quality_settings(args), args.out)
    return 0


def _add_samplers_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sp = commands.add_parser("samplers", help="FID against network calls per image for every sampler",
                             description=_SAMPLERS_DESCRIPTION, epilog=_SAMPLERS_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("checkpoint", metavar="CHECKPOINT",
                    help="run directory, ckpt_*.pt, an FSDP run's ckpt_*.dcp directory, or ema.safetensors")
    sp.add_argument("--samplers", type=_csv_list, default=None, metavar="A,B",
                    help="default ddim,dpmpp-2m,dpmpp-2m-sde,unipc,heun")
    sp.add_argument("--steps", type=_csvpositive_ints, default=None, metavar="K,..", help="default 5,10,20,50,100")
    sp.add_argument("--no-ddpm", dest="ddpm", action="store_false", default=None,
                    help="leave out the DDPM-over-all-T reference point (the costliest)")
    sp.add_argument("--spacing", choices=SPACINGS, default=None,
                    help="default: each sampler's own (karras for heun and on an EDM model, trailing for the others)")
    sp.add_argument("--num-samples", type=positive_int, default=None, metavar="N", help="per point (default 2000)")
    sp.add_argument("--seed", type=int, default=None, help="noise seed of every point (default 0)")
    sp.add_argument("--spread-points", type=_csv_list, default=None, metavar="S-K,..",
                    help="points drawn again with --spread-seeds (default: those of ddim-50,ddim-100,dpmpp-2m-10,"
                         "dpmpp-2m-20 in the grid asked, --quick's ddim-4; none: no spread)")
    sp.add_argument("--spread-seeds", type=_csvints, default=None, metavar="N,..", help="default 1,2")
    sp.add_argument("--guidance", type=float, default=None, metavar="W",
                    help="a conditional model's guidance scale (default: its train.sample_guidance)")
    sp.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                    help="default 1000 on a GPU, 250 on a CPU")
    sp.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    sp.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="default auto: on for CUDA")
    sp.add_argument("--device", default="auto", metavar="DEVICE", help="auto (default), cpu, cuda, cuda:N")
    sp.add_argument("--remeasure", action="store_true", help="draw again the points already in OUT/samplers.json")
    sp.add_argument("--quick", action="store_true", help="20 samples at 2 and 4 steps, no DDPM: a pipeline check")
    sp.add_argument("--out", default=None, metavar="DIR", help="default RUN_DIR/bench-samplers")
    return sp


def samplers_settings(args: argparse.Namespace):
    from fastddpm.bench.samplers import QUICK, SamplerBenchSettings

    base = _given(args, QUICK, ("samplers", "steps", "ddpm", "spacing", "num_samples", "seed", "spread_points",
                                "spread_seeds", "guidance", "batch_size"))
    if base.get("spread_points") == ("none",):
        base["spread_points"] = ()
    return SamplerBenchSettings(checkpoint=args.checkpoint, **base, precision=args.precision, compile=args.compile,
                                device=args.device, remeasure=args.remeasure, quick=args.quick)


def _run_samplers(args: argparse.Namespace) -> int:
    from fastddpm.bench.samplers import run_samplers

    result = run_samplers(samplers_settings(args), args.out)
    return 0 if any(r.get("status") == "ok" for r in result["rows"]) else 1


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench {throughput,ladder,quality}` to a top-level CLI's subparsers; returns the `bench` parser.
    Sub-commands dispatch through `run_bench` on args.bench_command."""
    bench = subparsers.add_parser("bench", help="benchmark the training step (throughput, MFU, memory)",
                                  description=_BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = bench.add_subparsers(dest="bench_command", metavar="{throughput,ladder,quality,samplers}", required=True)
    _add_throughput_parser(commands)
    _add_ladder_parser(commands)
    _add_quality_parser(commands)
    _add_samplers_parser(commands)
    bench.set_defaults(func=run_bench)
    return bench


def throughput_settings(args: argparse.Namespace):
    """The ThroughputSettings the flags ask for: ThroughputSettings' defaults, or --quick's, then every flag given."""
    from fastddpm.bench.throughput import QUICK, ThroughputSettings

    base = _given(args, QUICK, ("presets", "batch_sizes", "choices", "warmup_steps", "steps", "repeats"))
    if args.image_shape is not None and len(args.image_shape) != 3:
        from fastddpm.config import ConfigError

        raise ConfigError(f"bench throughput: --image-shape {','.join(map(str, args.image_shape))} needs C,H,W")
    if args.image_shape is not None:
        base["image_shape"] = args.image_shape
    return ThroughputSettings(**base, precision=args.precision, compile=args.compile, cuda_graphs=args.cuda_graphs,
                              data_placement=args.data_placement, device=args.device, quick=args.quick,
                              remeasure=args.remeasure)


def _run_throughput(args: argparse.Namespace) -> int:
    from fastddpm.bench.throughput import default_out_dir, run_throughput

    args.out = args.out or default_out_dir()  # named here, so that a Ctrl-C can say where the variants are
    result = run_throughput(throughput_settings(args), args.out)
    return 0 if any(r["status"] == "ok" for r in result["results"]) else 1


_COMMANDS = {"throughput": _run_throughput, "ladder": _run_ladder, "quality": _run_quality,
             "samplers": _run_samplers}


def run_bench(args: argparse.Namespace) -> int:
    """Run `bench <command>`; a config error becomes `error: ...` on stderr and exit code 2."""
    from fastddpm.config import ConfigError
    from fastddpm.trainer.loop import TrainingInterrupted  # bench quality's runs stop at a signal with it

    try:
        return _COMMANDS[args.bench_command](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, TrainingInterrupted) as e:
        # Ctrl-C, or a signal a training run (bench quality's) stopped at: Python's traceback said nothing of what
        # was kept or how to go on, and the run's own line named train's --resume, which no bench takes
        code = getattr(e, "exit_code", 130)  # 128 + SIGINT (or SIGTERM, SIGPIPE), what a shell reports
        where = f"--out {args.out}" if args.out else "its --out folder (RUN_DIR/bench-samplers)"
        again = " (the training run it stopped is trained again from its start)" if isinstance(
            e, TrainingInterrupted) else ""
        cause = {130: "Ctrl-C", 143: "SIGTERM"}.get(code, "the closed pipe its output went to")
        print(f"\nbench {args.bench_command}: stopped by {cause}; what was measured "
              f"before it is kept in {where}, and the same command with that --out goes on from there, reusing it"
              f"{again}", file=sys.stderr)
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastddpm")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
