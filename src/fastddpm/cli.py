"""The `fastddpm` command: train, sample, data, bench, doctor, eval.

`fastddpm train --help` is generated from the config dataclasses (fastddpm.config), so every field has a flag
and a line of help, and nothing here can drift from what the trainer reads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import textwrap
import types
import typing
import warnings
from pathlib import Path

from fastddpm import __version__
from fastddpm.config import (CLI, PRESETS, SAMPLER_CHOICES, SAMPLER_HELP, SECTIONS, SPACINGS, STEPS_HELP,
                             ConfigError, RunConfig, Spelling, TrainConfig, class_index, class_slug, default_preset,
                             default_spacing, device_setting, flag_name, load_config_file, preset_summaries, qualify,
                             resolve_config)
from fastddpm.pipes import EXIT_READER_GONE, ReaderGone, silence_closed_streams

TRAIN_EPILOG = """\
Presets (--preset NAME; later layers override: preset < --config FILE < --set < flags):
{presets}
  Default: seed-1layer when CUDA is available, else cpu-demo-cond (a grid of one row per class).

Config files (YAML or JSON) hold sections model/diffusion/data/train and an optional preset, e.g.
  preset: seed-1layer
  train: {batch_size: 256, lr: 2.0e-4}
  diffusion: {schedule: cosine}

Examples:
  fastddpm train --data fashion-mnist --out runs/fmnist                 # preset by device
  fastddpm train --data mnist --out runs/mnist --preset seed-1layer --batch-size 256
  fastddpm train --data ./my_images.zip --out runs/mine --resize 32 --max-images 2000000
  fastddpm train --out runs/fmnist --resume latest                      # continue exactly where it stopped
  fastddpm train --data fashion-mnist --print-config                    # show the resolved config and exit

Run directory: config.json, run.json, metrics.jsonl, checkpoints/ckpt_<step>.pt (+ .sha256),
ema.safetensors (EMA weights), samples/grid_<images>.png and samples/final.png.
Exit codes: 0 done, 2 bad input or config, 130 SIGINT / 143 SIGTERM / 141 the reader of stdout or stderr left
(`| head`), each after writing a checkpoint.
"""


def _train_epilog() -> str:
    """TRAIN_EPILOG with each preset's line from its own docstring (config.preset_summaries), so they cannot drift."""
    lines = []
    for name, text in preset_summaries().items():
        lines += textwrap.wrap(text, width=110, initial_indent=f"  {name:12s} ", subsequent_indent=" " * 15,
                               break_on_hyphens=False)
    return TRAIN_EPILOG.replace("{presets}", "\n".join(lines))


_METAVARS = {"source": "SOURCE", "cache_dir": "DIR", "device": "DEVICE"}


def _add_config_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str]]:
    """One flag per config field, grouped by section. Returns {argparse dest: (section, field)}."""
    dests: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options ({cls.__doc__.splitlines()[0]})")
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = flag_name(f)
            dest = f"cfg__{section}__{f.name}"
            default = getattr(defaults, f.name)
            # as the value is spelt on the command line: none, not Python's None
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else ("none" if default is None
                                                                                   else default)
            help_text = f"{meta['help']} (default {shown}; presets may change it)".replace("%", "%%")
            tp = hints[f.name]
            dests[dest] = (section, f.name)
            if tp is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
                continue
            choices = meta.get("choices")
            metavar = "{" + ",".join("none" if c is None else c for c in choices) + "}" if choices else None
            if metavar is None:
                optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
                base = typing.get_args(tp)[0] if optional else tp
                metavar = _METAVARS.get(f.name) or {int: "N", float: "X", str: "STR"}.get(base, "A,B,..")
            group.add_argument(flag, dest=dest, default=None, metavar=metavar, help=help_text)
    return dests


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching: with 80 config flags an abbreviation silently picks a neighbour (`--out`
    read as `--out-block-channels`); a flag must be spelt whole. Subcommand parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if a_later_process_of_its_node():  # every rank parses the same command line
            let_the_first_process_speak()
            self.exit(2)
        super().error(message)


def a_later_process_of_its_node() -> bool:
    """Under torchrun, whether this process is not the first of its node. Every rank parses the same command line
    and, until the process group forms, runs alike (fastddpm.distributed.same_on_every_rank marks that code's
    errors): of an error there, the first process of each node says it (whoever reads one node's log sees why it
    stopped) and the others exit with the same status in silence (torchrun's summary lists every rank's exit). An
    empty RANK is rank 0, as in rundir.files.warn_on_rank_0."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return rank is not None and world is not None and os.environ.get("LOCAL_RANK", rank).strip() not in ("", "0")


QUIET_EXIT_WAIT_S = 2.0


def let_the_first_process_speak() -> None:
    """Before a later process of a node exits in silence: torchrun's agent stops every process of the job once one
    has failed, so the first process of the node, a moment behind on the same error, would be stopped before it
    said why. Only under torchrun's agent (TORCHELASTIC_RUN_ID), not where RANK is set by other means."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        import time

        time.sleep(QUIET_EXIT_WAIT_S)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = _Parser(
        prog="fastddpm",
        description="Train DDPM diffusion models at the speed of the GPU, and sample from them.",
    )
    parser.add_argument("--version", action="version", version=f"fastddpm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tr = sub.add_parser(
        "train", help="train a DDPM U-Net on a dataset", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a DDPM U-Net (Ho et al. 2020) on a dataset, writing checkpoints, metrics and sample "
                    "grids to a run directory.",
        epilog=_train_epilog(),
    )
    run = tr.add_argument_group("run")
    run.add_argument("--out", metavar="RUN_DIR", help="run directory (created if missing; required except with "
                                                       "--print-config)")
    run.add_argument("--preset", choices=list(PRESETS), help="starting configuration (see below)")
    run.add_argument("--config", metavar="FILE", help="YAML or JSON config file, applied over the preset")
    run.add_argument("--resume", metavar="latest|PATH",
                     help="continue from the newest verified checkpoint in RUN_DIR ('latest'; starts fresh if there "
                          "is none), a checkpoint file (.pt, or an FSDP run's .dcp directory; an earlier one of "
                          "RUN_DIR branches: the later ones move to checkpoints/abandoned-after-*), or another run "
                          "directory")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="set any config field, e.g. --set train.lr=3e-4 (repeatable; a field of one section may be "
                          "named alone, lr=3e-4; a run length replaces the preset's)")
    run.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    dests = _add_config_flags(tr)

    sp = sub.add_parser(
        "sample", help="draw images from a trained model (PNG grid + .npz)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample images from a checkpoint with DDPM (ancestral, all T steps), DDIM, the few-step ODE\n"
                    "solvers DPM-Solver++(2M), UniPC and Heun (K steps; Heun makes 2K-1 network calls), or the\n"
                    "stochastic SDE-DPM-Solver++(2M) (K steps). The default, auto, is the model's objective's best:\n"
                    "SDE-DPM-Solver++(2M) 20 steps for DDPM and EDM, Heun 10 steps (19 calls) for flow matching,\n"
                    "UniPC 10 steps for a flow model sampled with --class at a guidance above 1 (its default, 2).",
        epilog="Examples:\n  fastddpm sample --checkpoint runs/fmnist --num-images 64\n"
               "  fastddpm sample --checkpoint runs/fmnist/ema.safetensors --num-images 1000 --sampler dpmpp-2m "
               "--steps 10"
               "\n  fastddpm sample --checkpoint runs/fmnist/checkpoints/ckpt_000002000.pt --sampler ddpm\n"
               "  fastddpm sample --checkpoint runs/cond --class sneaker --guidance 2     # a conditional model\n"
               "  fastddpm sample --checkpoint runs/cond --class all --num-images 100    # one row per class\n\n"
               "Writes two files:\n"
               "  OUT/<sampler><steps>[-<spacing>][-eta<E>]_n<N>[_from<F>]_seed<S>[_<class>_w<W>]_step<K>"
               "[_model][_<precision>].png\n"
               "  and the matching .npz.\n"
               "The PNG is a grid of up to 256 images (with --class all one row per class, named, of N / classes\n"
               "images each, N a multiple of the class count, or with N below it one image each of N classes\n"
               "spread over the ids). The .npz holds `images`: uint8 (N, C, H, W), and for a conditional model\n"
               "`labels` (N,) and `guidance`. <class> is the class's name however --class gave it (`--class 7`\n"
               "of Fashion-MNIST writes `_sneaker_`), or `all`; <precision> is --precision where it is not what\n"
               "auto picks here.\n"
               "The images are a function of the weights, the sampler's flags, --seed and the device type: image k\n"
               "draws its noise from (seed, k), so --batch-size does not change it (up to float rounding in the\n"
               "network), and a draw of more images of one class (or none) begins with the images of a draw of\n"
               "fewer (with --class all, N decides each image's class).",
    )
    sp.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="run directory (newest checkpoint), ckpt_*.pt, an FSDP run's ckpt_*.dcp directory, "
                         "ema.safetensors, or a diffusers DDPMPipeline (or UNet2DModel) folder")
    sp.add_argument("--num-images", type=int, default=64, metavar="N", help="images to draw (default 64)")
    sp.add_argument("--sampler", choices=SAMPLER_CHOICES, default="auto", help=SAMPLER_HELP)
    sp.add_argument("--steps", type=int, default=None, metavar="K", help=STEPS_HELP)
    sp.add_argument("--spacing", choices=SPACINGS, default=None,
                    help="timesteps: trailing (evenly spaced from T-1), karras (EDM noise levels, dense at low "
                         "noise) or logsnr (evenly spaced in log-SNR, DPM-Solver's); default: karras for heun and "
                         "for every sampler of an EDM model, trailing for the others")
    sp.add_argument("--eta", type=float, default=0.0, help="DDIM eta: 0 deterministic, 1 DDPM-like (default 0)")
    sp.add_argument("--seed", type=int, default=0,
                    help="sampling seed (default 0): the same seed gives the same images; image k's noise comes "
                         "from (seed, k)")
    sp.add_argument("--first-image", type=int, default=0, metavar="K",
                    help="draw images K .. K+N-1 of the seed's sequence (default 0): split a large draw over "
                         "processes or GPUs, each with its own range, and together they hold what one draw of all "
                         "would (as EDM's --seeds), for one class or none (not with --class all)")
    sp.add_argument("--batch-size", type=int, default=256, metavar="N",
                    help="images per model call (default 256); memory and speed only: each image draws its own noise, "
                         "so another batch size draws the same images")
    sp.add_argument("--weights", choices=("ema", "model"), default="ema", help="EMA (default) or raw weights")
    sp.add_argument("--out", metavar="DIR", help="output folder, its files named by the settings (default: "
                                                 "RUN_DIR/samples; for a checkpoint or export outside a run "
                                                 "directory, samples/ beside it); or NAME.png: the grid, with "
                                                 "NAME.npz beside it")
    sp.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    sp.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                    help="sampling autocast (default auto: bf16 on GPUs that have it; on a CPU bf16 where it has "
                         "native bf16, else fp32)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--class", dest="klass", metavar="NAME|ID|all",
                    help="a conditional model's class: its name (e.g. sneaker; 'ankle boot' also as file names spell "
                         "it, ankle-boot) or number, or all (one row per class); default: unconditional")
    sp.add_argument("--guidance", type=float, default=None, metavar="W",
                    help="classifier-free guidance scale with --class (default: the model's train.sample_guidance, "
                         f"{TrainConfig().sample_guidance:g} for new runs, the best FID measured on the CPU demo): 1 = "
                         "plain conditional, 0 = unconditional, > 1 = more faithful to the class, less varied")

    from fastddpm.bench.cli import add_bench_parser
    from fastddpm.data.cli import add_data_parser

    from fastddpm.doctor.cli import add_doctor_parser
    from fastddpm.eval.cli import add_eval_parser
    from fastddpm.export import add_export_parser

    add_data_parser(sub)
    add_bench_parser(sub)
    add_doctor_parser(sub, _add_config_flags)
    add_eval_parser(sub)
    add_export_parser(sub)
    return parser, dests


def resolve_train_config(args, dests: dict, resumed: RunConfig | None = None) -> RunConfig:
    """preset (or the checkpoint's config when resuming) < --config FILE < --set < flags
    (fastddpm.config.resolve_config, which the Python API shares)."""
    import torch

    in_file = load_config_file(args.config).get("preset") if args.config else None
    preset = args.preset or in_file
    if args.preset and in_file and in_file != args.preset:  # the command line wins, as its flags do: said
        print(f"note: --preset {args.preset} replaces the preset {args.config} names ({in_file}): the file's values "
              f"go over {args.preset}", file=sys.stderr if getattr(args, "print_config", False) else sys.stdout)
    if resumed is not None and preset is None:
        base = resumed
    else:
        if preset is None:
            preset, why = default_preset(torch.cuda.is_available())
            print(f"preset: {preset} (no --preset given; {why})",  # stdout holds only the JSON of --print-config
                  file=sys.stderr if getattr(args, "print_config", False) else sys.stdout)
        base = preset
    sets = {}
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. --set train.lr=3e-4")
        key, value = item.split("=", 1)
        sets[key] = value
    flags = {f"{section}.{name}": getattr(args, dest) for dest, (section, name) in dests.items()
             if getattr(args, dest) is not None}
    return resolve_config(base, file=args.config, layers=[("--set", sets), ("command line", flags)],
                          resumed=resumed)


def _spelling(args, dests: dict) -> Spelling:
    """How train's errors name a setting: by the `--set KEY` typed where --set alone gave it (no flag over it), else
    by its flag. `--set train.eval_inception=BAD` had been named as --eval-inception, a flag never typed."""
    flagged = {dests[dest] for dest in dests if getattr(args, dest) is not None}
    fields = {(section, f.name): f for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    said = CLI
    for item in args.overrides:  # each SECTION.FIELD=VALUE, as resolve_train_config has checked
        key = item.split("=", 1)[0]
        section, name = qualify(key, "--set").split(".", 1)
        if (section, name) in fields and (section, name) not in flagged:
            said = said.setting(flag_name(fields[section, name])[2:], key)
    return said


def cmd_train(args, dests) -> int:
    import json

    from fastddpm.rundir.locate import find_resume
    from fastddpm.trainer.loop import TrainingInterrupted, train
    from fastddpm.trainer.step import CudaGraphCaptureError

    from fastddpm.distributed import same_on_every_rank

    with same_on_every_rank():  # the command line, its config files and the run folder (the group is not begun)
        if args.out is None and not (args.print_config and str(args.resume) != "latest"):
            raise ConfigError("train needs --out RUN_DIR, the folder for the run's checkpoints, metrics and grids "
                              "(created if missing; an existing run's folder with --resume latest)"
                              if not args.print_config else
                              "--print-config --resume latest reads the run in --out: give --out RUN_DIR")
        run_dir = Path(args.out) if args.out is not None else None
        resumed = find_resume(run_dir if run_dir is not None else Path.cwd(), args.resume)
        cfg = resolve_train_config(args, dests, resumed=resumed.config if resumed else None)
        if not args.print_config:  # a config file's device, named by the file (the run knows no file)
            from fastddpm.device import resolve_device

            resolve_device(cfg.train.device, setting=device_setting(cfg, args.config))
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    # each line of the log as it is written, in a pipe too (`| tee run.log`, `| head -8`), not 8 KiB at a time:
    # a run's few lines would otherwise wait for its end, and a reader that left be found only then
    if hasattr(sys.stdout, "reconfigure"):  # a TextIOWrapper (a notebook's stream, main() called there, is not)
        sys.stdout.reconfigure(line_buffering=True)
    try:
        train(cfg, out_dir=run_dir, resume=resumed if resumed is not None else args.resume,
              said=_spelling(args, dests))
    except TrainingInterrupted as e:
        return e.exit_code
    except CudaGraphCaptureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # under torchrun: a collective that failed on a peer is said in one line per rank
        from fastddpm.distributed import collective_failure, launched_by_torchrun

        why = collective_failure(e, cfg.train.dist_timeout_s) if launched_by_torchrun() else None
        if why is None:
            raise
        print(f"error: rank {os.environ.get('RANK', '?')}: {why}", file=sys.stderr)
        return 1
    return 0


LARGE_DRAW_GIB = 1.0  # `fastddpm sample` says what a draw this large costs before it starts


def cmd_sample(args) -> int:
    import torch

    from fastddpm.device import resolve_device, resolve_precision
    from fastddpm.rundir.files import make_writable_dir
    from fastddpm.rundir.locate import locate
    from fastddpm.sampling import (check_first_image, class_labels, load_for_sampling, null_class_note,
                                   resolve_sampler_args, sample_to_files)

    # before the checkpoint is read: a count below 1 is wrong whatever the model
    bad = [f"{flag} {count}" for flag, count in (("--num-images", args.num_images), ("--batch-size", args.batch_size))
           if count < 1]
    if bad:
        raise ConfigError(f"{' and '.join(bad)}: {'each ' if len(bad) > 1 else ''}must be >= 1")
    device, _ = resolve_device(args.device, setting="--device")
    ckpt = locate(args.checkpoint, weights=args.weights, what="--checkpoint")
    model, cfg = load_for_sampling(ckpt, device=device, weights=args.weights)
    check_first_image(args.first_image, args.klass)
    if args.out is not None and not args.out.strip():
        raise ConfigError('--out "": give the folder for the grid and the .npz (or leave --out out: '
                          f"{ckpt.run_dir.samples})")
    out = Path(args.out) if args.out else ckpt.run_dir.samples
    named = out.suffix.lower() in (".png", ".npz") and not out.is_dir()  # --out grid.png: the files' own name
    if named:
        out, named = out.parent, out.stem
    # as train --out: a grid among the run's images would be read as one of them by its next prepare; the default
    # RUN_DIR/samples too, for a run whose folder sits inside its images (trained before train --out refused that)
    from fastddpm.data.sources import refuse_output_among_images

    refuse_output_among_images(cfg.data.source, out, flag="--out", what="the grid and the .npz", given=bool(args.out))
    if args.guidance is not None and args.guidance < 0:
        raise ConfigError(f"--guidance {args.guidance} must be >= 0 (1 = plain conditional)")
    if args.guidance is not None and not cfg.model.conditional:
        raise ConfigError(f"--guidance {args.guidance:g} steers toward a class; this model is unconditional (trained "
                          "without --conditional): drop --guidance")
    if args.guidance is not None and args.klass is None:
        raise ConfigError("--guidance steers toward a class: give --class NAME|ID|all with it")
    guidance = cfg.train.sample_guidance if args.guidance is None else args.guidance
    labels, per_class = class_labels(cfg.model, args.klass, args.num_images)
    args.sampler, args.steps = resolve_sampler_args(cfg, args.sampler, args.steps, args.eta,
                                                    guidance=guidance if labels is not None else None)
    if args.sampler == "ddpm" and args.spacing is not None:
        raise ConfigError(f"--spacing {args.spacing}: --sampler ddpm walks every one of the "
                          f"{cfg.diffusion.num_timesteps} timesteps and takes no spacing; drop --spacing, or pick a "
                          "few-step sampler (ddim, dpmpp-2m, dpmpp-2m-sde, unipc, heun)")
    unconditional = null_class_note(cfg, args.klass)
    if unconditional:
        print(f"note: {unconditional}", file=sys.stderr)
    steps = cfg.diffusion.num_timesteps if args.sampler == "ddpm" else args.steps
    num_images = len(labels) if labels is not None else args.num_images
    own_spacing = default_spacing(args.sampler, cfg.diffusion.objective)
    spacing = args.spacing or own_spacing
    # every choice that changes the images and is not the default is in the name, so that sampling again with
    # another eta or the raw weights writes beside the earlier files instead of over them
    tag = f"-{spacing}" if spacing != own_spacing else ""
    tag += f"-eta{args.eta:g}" if args.eta != 0 else ""
    stem = f"{args.sampler}{steps}{tag}_n{num_images}" + (f"_from{args.first_image}" if args.first_image else "")
    stem += f"_seed{args.seed}"
    if args.klass is not None:
        stem += f"_{class_tag(cfg.model, args.klass)}_w{guidance:g}"
    if ckpt.step is not None:  # the samples of two checkpoints of one run are two results, as in eval's names
        stem += f"_step{ckpt.step}"
    if args.weights != "ema":
        stem += f"_{args.weights}"
    chosen, auto = resolve_precision(args.precision, device).name, resolve_precision("auto", device).name
    if chosen != auto:  # bf16 and fp32 draw different images: side by side, not one over the other
        stem += f"_{chosen}"
    stem = named or stem
    make_writable_dir(out, flag="--out", fix="--out is the folder for the grid and the .npz: give one that can be "
                                             "created and written, or an existing folder")  # before any sampling
    m = cfg.model
    gib = num_images * m.image_channels * m.image_size ** 2 / 2**30
    if gib >= LARGE_DRAW_GIB:  # held in memory whole, then written once: a killed draw keeps nothing
        split = ("by class (--class NAME, each with its own --first-image ranges)" if per_class is not None else
                 "with --first-image K --num-images N, each range its own files")
        print(f"note: {num_images:,} images are {gib:,.1f} GiB of uint8, held in memory and written at the end; a "
              f"draw stopped before then keeps nothing: split it {split}", file=sys.stderr)
    with torch.inference_mode():
        images = sample_to_files(model, cfg, num_images=num_images, sampler=args.sampler, steps=steps,
                                 spacing=args.spacing, eta=args.eta, seed=args.seed, first_image=args.first_image,
                                 batch_size=args.batch_size, device=device, out_grid=out / f"{stem}.png",
                                 out_npz=out / f"{stem}.npz",
                                 precision=args.precision, progress=not args.no_progress, labels=labels,
                                 guidance=guidance, per_class_row=per_class)
    print(f"wrote {out / (stem + '.png')} and {out / (stem + '.npz')} ({images.shape[0]} images, "
          f"{tuple(images.shape[1:])} uint8)")
    return 0


def class_tag(model_cfg, wanted: str) -> str:
    """The class of `--class` in a file name, one spelling per class: its name where the model has names
    (`--class 7` and `--class sneaker` write the same files), else its id; `all` for every class."""
    if wanted.strip().lower() == "all":
        return "all"
    i = class_index(model_cfg, wanted)
    names = model_cfg.class_names
    tag = class_slug(names[i]) if i < len(names) else ""
    if not tag:
        return str(i)
    # two names of one spelling ("Cat" and "cat!") would write one file: each then keeps its id too
    return tag if [class_slug(n) for n in names].count(tag) == 1 else f"{tag}-{i}"


def main(argv: list[str] | None = None) -> int:
    """The command, ended quietly with 141 when the reader of its output leaves (`fastddpm ... | head`), as `cat`
    ends: no traceback, nothing more written (a training run stops at its step's end with a checkpoint first)."""
    try:
        try:
            return _main(argv)
        finally:
            # what is still buffered (argparse's --help, a command's last lines) is written here, where a reader
            # that left is caught, not by the interpreter's exit ("Exception ignored ... BrokenPipeError")
            sys.stdout.flush()
    except BrokenPipeError as e:
        if not (silence_closed_streams() or isinstance(e, ReaderGone)):
            raise  # another pipe (a subprocess's) broke: not the reader of this command's output
        return EXIT_READER_GONE


def _main(argv: list[str] | None) -> int:
    parser, dests = build_parser()
    args = parser.parse_args(argv)  # --help answers here, before anything imports torch
    if args.command is None:
        parser.print_help()
        return 2
    from fastddpm.data import DataError
    from fastddpm.rundir.files import CheckpointError

    try:
        with _plain_warnings():
            return _run(parser, args, dests, (ConfigError, DataError, CheckpointError))
    except KeyboardInterrupt:
        if args.command == "doctor":
            raise  # the traceback points into the user's own script, which the doctor runs
        # Ctrl-C where the command has no stop of its own (sample, eval, export, data; train's second Ctrl-C): one
        # line, as a shell tool ends, not Python's traceback of wherever the signal landed (a convolution, say)
        print(f"\nfastddpm {args.command}: stopped by Ctrl-C", file=sys.stderr)
        return 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C ended


@contextlib.contextmanager
def _plain_warnings():
    """fastddpm's own warnings (a checkpoint skipped, ...) printed as one line, `warning: ...`, as its errors are:
    Python's default form adds the file, line and source of the warn() call, which tell a user nothing. Warnings
    from elsewhere (torch, the user's own script under the doctor) keep that form: the place is theirs to find."""
    original = warnings.formatwarning
    package = str(Path(__file__).resolve().parent) + os.sep

    def one_line(message, category, filename, lineno, line=None):
        if str(Path(filename).resolve()).startswith(package):  # a torch deprecation raised there keeps its kind
            return f"warning: {message}\n" if category is UserWarning else f"warning ({category.__name__}): {message}\n"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = original


def _run(parser, args, dests: dict, user_errors: tuple[type[Exception], ...]) -> int:
    try:
        if args.command == "train":
            return cmd_train(args, dests)
        if args.command == "sample":
            return cmd_sample(args)
        if args.command == "data":
            from fastddpm.data.cli import run_data

            return run_data(args)
        if args.command == "bench":
            from fastddpm.bench.cli import run_bench

            return run_bench(args)
        if args.command == "doctor":
            from fastddpm.doctor.cli import run_doctor

            return run_doctor(args, resolve_train_config)
        if args.command == "eval":
            from fastddpm.eval.cli import run_eval

            return run_eval(args)
        if args.command == "export":
            from fastddpm.export import run_export

            return run_export(args)
    except user_errors as e:
        if a_later_process_of_its_node():
            from fastddpm.distributed import is_same_on_every_rank

            if is_same_on_every_rank(e):  # the first process of this node says it
                let_the_first_process_speak()
                return 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
