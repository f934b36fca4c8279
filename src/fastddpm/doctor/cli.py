"""`fastddpm doctor train [train options]` and `fastddpm doctor run SCRIPT [ARGS]`."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

EPILOG = """\
The run is bounded: --warmup steps (not judged), --steps watched with cheap timers, then --profile-steps
under torch.profiler, and all three within --max-seconds (default 60; a window whose share of it is spent ends
early, with at least 2, 3 and 1 steps). The verdict names one bottleneck with the numbers behind it, then
ranked fixes.

Examples:
  fastddpm doctor train --data fashion-mnist --preset seed-1layer      # the built-in trainer, any config
  fastddpm doctor train --data ./my.zip --batch-size 64 --compile off --report-dir doctor/eager
  fastddpm doctor run train_mine.py --epochs 1 --lr 3e-4               # your script, unchanged

In your own code, without the CLI:
  with fastddpm.doctor.watch(loader, out="doctor/") as dr:
      for batch in dr.batches():
          ...; dr.step()

Writes DIR/report.txt, report.json and report.html (open in a browser); with --save-trace also the raw trace
(<host>_<pid>.doctor.pt.trace.json.gz: https://ui.perfetto.dev, chrome://tracing, or TensorBoard's profiler
plugin pointed at DIR).
"""


def _add_window_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("doctor")
    g.add_argument("--warmup", type=int, default=5, metavar="N", help="steps before measuring (default 5)")
    g.add_argument("--steps", type=int, default=40, metavar="N", help="steps watched with timers (default 40)")
    g.add_argument("--profile-steps", type=int, default=10, metavar="N",
                   help="steps traced with torch.profiler after the watch (default 10; 0 = no trace)")
    g.add_argument("--max-seconds", type=float, default=60.0, metavar="S",
                   help="bound the three windows to about S seconds: warm-up 25%%, watch 45%%, profile 30%%, each "
                        "ending early with at least 2, 3, 1 steps (default 60; 0 = bounded by steps only)")
    g.add_argument("--loader-probe-s", type=float, default=2.0, metavar="S",
                   help="time the DataLoader alone for up to S seconds afterwards (default 2; 0 = skip)")
    g.add_argument("--report-dir", "--out", dest="report_dir", default="doctor_report", metavar="DIR",
                   help="where the reports (and a trace kept with --save-trace) go (default ./doctor_report)")
    g.add_argument("--save-trace", action="store_true",
                   help="keep the profiler trace in the report folder, gzipped (Perfetto, chrome://tracing or "
                        "TensorBoard's profiler plugin read it); by default it is read into the report and deleted")
    g.add_argument("--json", action="store_true", help="print the JSON report instead of the text one")


def _add_try_seconds(p) -> None:
    p.add_argument("--try-seconds", type=float, default=300.0, metavar="S",
                   help="bound --try to about S seconds: its rounds (up to 3) and timed steps (up to 20, after 5 "
                        "warm-up steps, in each fresh run) are fitted to S at the diagnosed step time, and no round "
                        "starts that would end past it (default 300; 0 = no bound)")


def add_doctor_parser(sub, add_train_flags) -> None:
    """`add_train_flags(parser)` adds the trainer's config flags and returns their dests (fastddpm.cli)."""
    dp = sub.add_parser("doctor", help="profile a training loop, name its bottleneck, prescribe the fix",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                        description="Profile a training loop for a bounded number of steps, name its bottleneck "
                                    "with evidence, and prescribe the fix.")
    dsub = dp.add_subparsers(dest="doctor_command", metavar="{train,run}")
    dt = dsub.add_parser("train", help="diagnose fastddpm's trainer with any config",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    _add_window_flags(dt)
    run = dt.add_argument_group("run")
    run.add_argument("--try", dest="try_fixes", type=int, default=0, metavar="N",
                     help="then try the top N fixes that are fastddpm settings (--precision, --compile, ...): each "
                          "finding's first, then their alternatives; each in `fastddpm train` runs alternating with "
                          "runs without it, and report the measured speedup beside the predicted one")
    _add_try_seconds(run)
    run.add_argument("--preset", help="starting configuration (as for train)")
    run.add_argument("--config", metavar="FILE", help="YAML or JSON config file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    dt.set_defaults(train_dests=add_train_flags(dt))
    dr = dsub.add_parser("run", help="diagnose your own training script, unchanged",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                         description="Run SCRIPT as `python SCRIPT ARGS` with DataLoader iteration timed and "
                                     "each optimizer.step() taken as a step boundary; stop after the bounded run.")
    _add_window_flags(dr)
    dr.add_argument("--device", default=None, help="the device the script trains on (default: cuda if present)")
    dr.add_argument("--try", dest="try_fixes", type=int, default=0, metavar="N",
                    help="then try the top N fixes that can be applied from outside the script (autocast, compile, "
                         "a fused optimizer, loader workers, channels_last): each finding's first, then their "
                         "alternatives; each in fresh runs alternating with runs without it, and report the measured "
                         "speedup beside the predicted one")
    _add_try_seconds(dr)
    dr.add_argument("script", help="the training script (.py)")
    dr.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


# Options no training script is expected to take: after the script's name they are a misplaced doctor option.
# (--steps, --warmup, --device and --json are common script options too: those go to the script as written.)
DOCTOR_ONLY_OPTIONS = ("--report-dir", "--profile-steps", "--max-seconds", "--loader-probe-s", "--save-trace", "--try",
                       "--try-seconds")


def script_arguments(script: str, given: list[str]) -> list[str]:
    """The script's own arguments: everything after its name. A doctor-only option there is refused, saying where
    it goes, instead of being passed to a script that would then fail on it."""
    from fastddpm.doctor.session import DoctorError

    misplaced = [a.split("=", 1)[0] for a in given if a.split("=", 1)[0] in DOCTOR_ONLY_OPTIONS]
    if misplaced:
        raise DoctorError(
            f"doctor run: {', '.join(misplaced)} comes after the script name, so it would be passed to {script}: "
            f"put doctor options before the script, e.g. fastddpm doctor run {misplaced[0]} ... {script} ARGS")
    return list(given)


def _stderr(line: str) -> None:
    """Progress lines (--try) go to stderr: stdout holds the report, JSON with --json."""
    import sys

    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Everything the diagnosed loop prints goes to stderr, so that stdout holds only the JSON report (--json).
    Two levels, as a loop writes at both: sys.stdout is pointed at sys.stderr, which catches print() wherever
    sys.stdout leads (a terminal, a pipe, a test's capture); and file descriptor 1 is pointed at fd 2, which
    catches what bypasses sys.stdout: C and C++ code, and child processes (DataLoader workers) that inherit
    fd 1."""
    import os
    import sys

    for stream in (sys.stdout, sys.__stdout__):
        if stream is not None:
            stream.flush()  # what was printed before goes out in place
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for stream in (sys.stdout, sys.__stdout__, sys.stderr):
            if stream is not None:
                stream.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_doctor(args, resolve_train_config) -> int:
    import sys

    from fastddpm.doctor.session import DoctorConfig, DoctorError

    try:
        return _run(args, resolve_train_config, DoctorConfig)
    except DoctorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args, resolve_train_config, DoctorConfig) -> int:
    from fastddpm.doctor.session import DoctorError

    if args.doctor_command is None:
        raise DoctorError("say what to diagnose: `fastddpm doctor train [train options]` or "
                          "`fastddpm doctor run SCRIPT [ARGS]` (see fastddpm doctor --help)")
    if args.try_fixes < 0:
        raise DoctorError(f"--try {args.try_fixes}: the number of fixes to try, 0 (none) or more")
    if not args.try_seconds >= 0 or args.try_seconds == float("inf"):
        raise DoctorError(f"--try-seconds {args.try_seconds:g}: a number of seconds > 0 (0 = no bound)")
    try_seconds = args.try_seconds or None
    try:
        cfg = DoctorConfig(warmup_steps=args.warmup, steps=args.steps, profile_steps=args.profile_steps,
                           loader_probe_s=args.loader_probe_s, out_dir=Path(args.report_dir),
                           time_budget_s=args.max_seconds if args.max_seconds != 0 else None,
                           save_trace=args.save_trace)
    except ValueError as e:
        from fastddpm.config import ConfigError

        raise ConfigError(f"doctor: {e}") from e
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        if args.doctor_command == "train":
            from fastddpm.doctor.runners import run_trainer

            from fastddpm.config import device_setting
            from fastddpm.device import resolve_device

            args.resume = None
            train_cfg = resolve_train_config(args, args.train_dests)
            # here, where the file is known: a config file's device this machine lacks is named by the file
            resolve_device(train_cfg.train.device, setting=device_setting(train_cfg, args.config))
            report = run_trainer(train_cfg, cfg, log=lambda *a: None, try_fixes=args.try_fixes,
                                 try_seconds=try_seconds, try_log=_stderr)
        else:
            from fastddpm.doctor.runners import run_script

            report = run_script(args.script, script_arguments(args.script, args.script_args), cfg,
                                device=args.device, try_fixes=args.try_fixes, try_seconds=try_seconds,
                                log=_stderr)
    if args.json:
        import json

        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        report.print()
    return 0
