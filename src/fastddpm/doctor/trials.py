"""`fastddpm doctor run --try N`: the top fixes measured, not only predicted.

Each fix that can be applied from outside the script is tried on the unmodified script, in separate processes,
alternating with runs without it (base, fix A, fix B, base, fix A, fix B, ...), so that a machine that drifts
(thermals, a neighbour on a shared CPU) moves both sides alike. A run trains `warmup` steps (compilation,
allocator and loader start-up), then times `steps` steps without the profiler, and ends the script. The
report gives each fix's measured speedup (the median over rounds of base / fix step time, with the spread)
beside the finding's prediction.

Which fixes: the findings' own (each Fix names its `trial`), each finding's first, largest expected gain first,
then (while N allows) the findings' alternatives, after the channels-last candidate below. Each is applied by
hooks in the trial process and reports what it changed (a fix that found nothing to change says so, and is not
counted as measured):
    autocast-bf16 / autocast-fp16   the model's forward runs under torch.autocast (the loss's top module: the
                                    first module the step calls with trainable parameters); autocast-fp32: with
                                    autocast off inside it (a CPU that emulates bf16)
    compile                         that module compiled (nn.Module.compile), its first steps in the warm-up
    fused-optimizer                 Adam, AdamW and SGD built with fused=True
    loader-workers:N                DataLoaders with N worker processes (persistent, pinned on CUDA)
    channels-last                   the module's weights and its 4-D inputs in channels_last (a candidate for a
                                    model with 2-D convolutions, which no rule costs)
    foreach-ema                     diffusers' EMAModel built with foreach=True (planned only where the script
                                    builds one: a hand-written EMA loop cannot be changed from outside)
A fix that is one of the script's own flags (fastddpm.doctor.script_context) runs the script with that flag.

`doctor train --try N` tries fastddpm's own settings the same way: each fix's `--flag value` (Fix.fastddpm) set
on the diagnosed config, `fastddpm train` runs alternating with the config as it was, timed from metrics.jsonl
(images per second between the warm-up's end and the last step, so a fix that changes the batch compares too).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastddpm.doctor.findings import Finding, Fix
from fastddpm.doctor.system import usable_cores

WHAT = {
    "autocast-bf16": "torch.autocast(dtype=torch.bfloat16) around the model's forward",
    "autocast-fp16": "torch.autocast(dtype=torch.float16) around the model's forward",
    "autocast-fp32": "autocast turned off (torch.autocast(enabled=False)) inside the model's forward",
    "compile": "torch.compile of the model",
    "fused-optimizer": "the optimizer with fused=True",
    "loader-workers": "DataLoader worker processes (persistent; pinned memory on CUDA)",
    "channels-last": "channels_last weights and inputs",
    "foreach-ema": "diffusers' EMAModel with foreach=True",
}


def _what(fix: str) -> str:
    name, _, n = fix.partition(":")
    return WHAT[name] + (f": {n} workers" if n else "")


@dataclass
class Trial:
    """One fix tried: its runs' step times (ms) beside the base runs', round by round."""

    fix: str
    what: str
    finding: str | None  # the finding it answers (None: a candidate the rules do not cost, e.g. channels-last)
    predicted: float | None  # the finding's promised speedup
    base_ms: list[float] = field(default_factory=list)
    fix_ms: list[float] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # what the fix changed, said by the trial process
    failed: str | None = None
    args: list[str] | None = None  # a flag fix: the script's arguments it ran with
    settings: dict[str, str] | None = None  # a trainer fix: the config fields it sets ({"train.precision": "bf16"})

    @property
    def speedups(self) -> list[float]:
        return [b / f for b, f in zip(self.base_ms, self.fix_ms) if f > 0]

    @property
    def measured(self) -> float | None:
        return statistics.median(self.speedups) if self.speedups and self.applied and not self.failed else None

    def to_dict(self) -> dict:
        s = self.speedups
        return {"fix": self.fix, "what": self.what, "finding": self.finding, "predicted": self.predicted,
                "measured": self.measured, "spread": [min(s), max(s)] if s else None, "rounds": len(s),
                "base_ms": self.base_ms, "fix_ms": self.fix_ms, "applied": self.applied, "failed": self.failed,
                "args": self.args, "settings": self.settings}


def predicted_gain(finding: Finding, fix: Fix) -> float | None:
    """What `--try` predicts for a fix: its finding's speedup, bounded by the fix's own gain; None where the fix
    makes no prediction."""
    if fix.unpredicted:
        return None
    return min(fix.gain, finding.speedup) if fix.gain is not None else finding.speedup


def _ranked_fixes(findings: list[Finding], tryable) -> tuple[list[tuple[Finding, Fix]], list[tuple[Finding, Fix]]]:
    """The fixes `tryable` accepts, as (finding, fix): each costed finding's first, largest expected gain first,
    and then the findings' alternatives in the same order (so that `--try 2` on one finding with two fixes,
    e.g. two layouts neither predicted, measures both)."""
    ranked = [(f, [x for x in f.fixes if tryable(x)])
              for f in sorted((f for f in findings if f.kind == "bottleneck" and f.cost > 0 and not f.negligible),
                              key=lambda f: -f.cost)]
    return ([(f, fixes[0]) for f, fixes in ranked if fixes],
            [(f, x) for f, fixes in ranked for x in fixes[1:]])


def plan(findings: list[Finding], n: int, *, convs: bool = False) -> list[Trial]:
    """The top `n` fixes to try: each costed finding's first fix that can be applied from outside (its `trial`;
    run as the script's own flag where the fix is one), largest expected gain first; then channels-last for a
    model with 2-D convolutions; then the findings' other fixes that can be applied."""
    firsts, alternatives = _ranked_fixes(findings, lambda x: x.trial)
    candidate = [(None, None)] if convs else []  # channels-last, which no rule costs
    trials: list[Trial] = []
    for f, fix in firsts + candidate + alternatives:
        if fix is None:
            trial = Trial("channels-last", WHAT["channels-last"], None, None)
        elif fix.args is not None:
            trial = Trial(f"flag {' '.join(_flag(list(fix.args)))}", f"the script's own flag: {fix.code}", f.id,
                          predicted_gain(f, fix), args=list(fix.args))
        else:
            trial = Trial(fix.trial, _what(fix.trial), f.id, predicted_gain(f, fix))
        if all((t.fix, t.args) != (trial.fix, trial.args) for t in trials):
            trials.append(trial)
    return trials[:n]


def plan_trainer(findings: list[Finding], n: int) -> list[Trial]:
    """`doctor train --try`: the top `n` fixes that are fastddpm settings with values: each costed finding's
    first, largest expected gain first, then the findings' alternatives."""
    firsts, alternatives = _ranked_fixes(findings, lambda x: x.fastddpm and settings_of(x.fastddpm))
    trials: list[Trial] = []
    for f, fix in firsts + alternatives:
        flags, settings = settings_of(fix.fastddpm)
        if all(t.settings != settings for t in trials):
            trials.append(Trial(flags, f"fastddpm's own setting: {flags}", f.id, predicted_gain(f, fix),
                                settings=settings))
    return trials[:n]


def settings_of(text: str) -> tuple[str, dict[str, str]] | None:
    """The flags a fix's `--flag value` text begins with, and the config fields they set ("--precision bf16 (auto
    picks it)" -> ("--precision bf16", {"train.precision": "bf16"})); None where the text is not train flags with
    values up to its first remark (a placeholder N, advice)."""
    from fastddpm.config import SECTIONS, flag_name

    by_flag = {flag_name(f): f"{section}.{f.name}" for section, cls in SECTIONS.items()
               for f in dataclasses.fields(cls)}
    words = text.split(" (")[0].split(";")[0].split(",")[0].split()
    if not words or len(words) % 2:
        return None
    pairs = list(zip(words[::2], words[1::2]))
    if any(flag not in by_flag or value.startswith("-") or value.isupper() for flag, value in pairs):
        return None
    return " ".join(words), {by_flag[flag]: value for flag, value in pairs}


# A trial process's time outside its steps (Python, torch, the script's imports), as estimates count it; a
# `fastddpm train` trial also loads the data cache, builds the model and writes a checkpoint at its end (a 1-step
# tiny run took 11 s on a shared 2-core CPU)
STARTUP_S, TRAINER_STARTUP_S = 5.0, 10.0
MIN_STEPS, MIN_ROUNDS = 5, 2  # fewer timed steps or rounds measure noise, not the fix
# the timed window a run asks for at the least (budget allowing): 20 steps of 5 ms are 0.1 s, where one of a shared
# CPU's scheduling stalls (tens of ms) moves a run by 20% and the median of three rounds swung 0.97-1.42x
MIN_WINDOW_S = 1.0


@dataclass(frozen=True)
class TrialShape:
    rounds: int
    warmup: int
    steps: int
    estimate_s: float | None  # the whole --try, from the diagnosed step time (None: no step time)

    def describe(self, runs_per_round: int) -> str:
        about = f", about {self.estimate_s / 60:.1f} min" if self.estimate_s is not None else ""
        return (f"{self.rounds} rounds of {runs_per_round} runs, each {self.warmup} warm-up + {self.steps} timed "
                f"steps{about}")


def fit_shape(step_ms: float | None, runs_per_round: int, budget_s: float | None, *, rounds: int = 3,
              warmup: int = 5, steps: int = 20, trainer: bool = False) -> TrialShape:
    """The rounds and steps of a --try that fits `budget_s` (--try-seconds) at the diagnosed median step: `steps`,
    or more where they would time less than MIN_WINDOW_S. Where that does not fit: fewer timed steps, down to
    MIN_WINDOW_S; then fewer rounds, down to MIN_ROUNDS; then fewer steps, down to MIN_STEPS. What still does not
    fit runs at that floor, and run_trials stops at a round's end once the budget is spent. `trainer`: the runs are
    `fastddpm train` processes (TRAINER_STARTUP_S each, timed steps in whole log intervals, _trainer_steps)."""
    timed = (lambda s: _trainer_steps(warmup, s)) if trainer else (lambda s: s)
    if not step_ms:
        return TrialShape(rounds, warmup, timed(steps), None)
    window = max(MIN_STEPS, math.ceil(MIN_WINDOW_S * 1e3 / step_ms))  # the steps that time MIN_WINDOW_S
    steps = max(steps, window)

    def cost(r: int, s: int) -> float:
        startup_s = TRAINER_STARTUP_S if trainer else STARTUP_S
        return r * runs_per_round * (startup_s + (warmup + timed(s)) * step_ms / 1e3)

    def fewer_steps(down_to: int) -> None:
        nonlocal steps
        while budget_s is not None and timed(steps) > down_to and cost(rounds, steps) > budget_s:
            fewer = timed(steps) - (warmup if trainer else 1)
            if timed(fewer) >= timed(steps):  # one log interval already (a warm-up longer than MIN_STEPS)
                break
            steps = fewer

    fewer_steps(min(steps, window))  # a window of MIN_WINDOW_S kept while rounds can go instead
    while budget_s is not None and rounds > MIN_ROUNDS and cost(rounds, steps) > budget_s:
        rounds -= 1
    fewer_steps(MIN_STEPS)
    return TrialShape(rounds, warmup, timed(steps), cost(rounds, steps))


def _trainer_steps(warmup: int, steps: int) -> int:
    """A `fastddpm train` trial's timed steps: `steps` rounded up to whole log intervals (it logs every `warmup`
    steps, and its step time is read from those lines)."""
    return warmup * max(1, -(-steps // warmup))


def run_trials(script: Path | dict, args: list[str], trials: list[Trial], *, rounds: int = 3, warmup: int = 5,
               steps: int = 20, timeout_s: float = 300.0, budget_s: float | None = None, log=print) -> list[Trial]:
    """Alternate base and fix runs `rounds` times (each a fresh process), filling each Trial in place. `script`: a
    script (with its `args`), or a fastddpm config (its dict form) for `doctor train`. `budget_s`: no round starts
    once the rounds so far, at their mean time, say the next would end past it (the first round always runs)."""
    if not trials:
        return trials
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fastddpm-doctor-try-") as tmp:
        def run(t: Trial | None, r: int) -> dict:
            out = Path(tmp) / f"{'base' if t is None else trials.index(t)}-{r}"  # one file per run
            if isinstance(script, dict):
                return _run_trainer(script, None if t is None else t.settings, warmup, steps, out, timeout_s)
            fix = None if t is None or t.args is not None else t.fix
            return _run(script, (t.args if t is not None else None) or args, fix, warmup, steps,
                        out.with_suffix(".json"), timeout_s)

        for r in range(rounds):
            if all(t.failed for t in trials):
                break
            spent = time.perf_counter() - started
            if r and budget_s is not None and spent + spent / r > budget_s:
                log(f"doctor --try: stopped after round {r} of {rounds}: another would end past --try-seconds "
                    f"{budget_s:g} ({spent:.0f} s spent)")
                break
            base = run(None, r)
            # each round in another order: no fix always runs right after the base (a warm page cache, a cool CPU)
            for t in trials[r % len(trials):] + trials[:r % len(trials)]:
                if t.failed:
                    continue
                if base.get("error"):
                    t.failed = f"without the fix: {base['error']}"
                    continue
                got = run(t, r)
                if got.get("error"):
                    t.failed = got["error"]
                    continue
                t.base_ms.append(base["step_ms"])
                # per step of the base run's images (a trainer fix may change the batch)
                t.fix_ms.append(got["step_ms"] * base.get("per_step", 1.0) / got.get("per_step", 1.0))
                t.applied = got["applied"] if t.args is None else [f"ran with {' '.join(_flag(t.args))}"]
            log(f"doctor --try: round {r + 1} of {rounds}: base {base.get('step_ms', float('nan')):.1f} ms/step; "
                + ", ".join(f"{t.fix} {t.fix_ms[-1]:.1f}" for t in trials if t.fix_ms and len(t.fix_ms) == r + 1))
    return trials


def _run_trainer(cfg: dict, settings: dict[str, str] | None, warmup: int, steps: int, out: Path,
                 timeout_s: float) -> dict:
    """`fastddpm train` on `cfg` with `settings`, `warmup` + `steps` steps, logged at the warm-up's end and
    every `warmup` steps after: its ms per step and images per step (a fix may change the batch), from
    metrics.jsonl."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    n = _trainer_steps(warmup, steps)
    sets = [a for k, v in (settings or {}).items() for a in ("--set", f"{k}={v}")]
    # the final grid as small as it can be (one image, one sampler step): 64 images took half a tiny trial's time
    cmd = [sys.executable, "-m", "fastddpm", "train", "--config", str(out / "config.json"), "--out", str(out / "run"),
           "--max-steps", str(warmup + n), "--log-every", str(warmup), "--checkpoint-every", "none",
           "--sample-every-images", "none", "--eval-every", "none", "--num-sample-images", "1", "--sample-steps", "1",
           "--no-progress", *sets]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no {warmup + n} steps within {timeout_s:.0f} s"}
    logged = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x] if (out / "run" / "metrics.jsonl").is_file() else []
    if proc.returncode != 0 or len(logged) < 2:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"error": f"fastddpm train ended before {warmup + n} steps: {tail[0]}"}
    first, last = logged[0], logged[-1]
    per_step = (last["images_seen"] - first["images_seen"]) / (last["step"] - first["step"])
    return {"step_ms": 1000 * (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"]),
            "per_step": per_step, "applied": [f"fastddpm train {' '.join(sets)}"] if sets else []}


def _flag(args: list[str]) -> list[str]:
    """The flag a flag fix appended to the script's arguments (its last option, with its value)."""
    last = max((i for i, a in enumerate(args) if a.startswith("-")), default=0)
    return args[last:]


def _run(script: Path, args: list[str], fix: str | None, warmup: int, steps: int, out: Path,
         timeout_s: float) -> dict:
    spec = {"script": str(script), "args": args, "fix": fix, "warmup": warmup, "steps": steps, "out": str(out)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-m", "fastddpm.doctor.trials", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no {warmup + steps} steps within {timeout_s:.0f} s"}
    if out.is_file():
        return json.loads(out.read_text())
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
    return {"error": f"the trial process ended before {warmup + steps} steps: {tail[0]}"}


# ---------------------------------------------------------------------------------------------------------------
# The trial process: the script under one fix, timed between optimizer steps


class _Done(BaseException):
    """Ends the script once the timed steps are over (a BaseException: the script's `except Exception` lets it
    through)."""


class _Fix:
    """The hooks of one fix, installed for the whole trial process; `applied` says what they changed."""

    def __init__(self, fix: str | None):
        self.name, _, self.param = (fix or "").partition(":")
        self.applied, self._undo = [], []
        self._top: torch.nn.Module | None = None

    def __enter__(self):
        if not self.name:
            return self
        if self.name.startswith("autocast-") or self.name in ("compile", "channels-last"):
            self._find_top_module()
        elif self.name == "fused-optimizer":
            self._fused_optimizers()
        elif self.name == "loader-workers":
            self._loader_workers(int(self.param or max(1, usable_cores() - 1)))
        elif self.name == "foreach-ema":
            self._foreach_ema()
        else:
            raise ValueError(f"unknown fix {self.name!r}; one of {', '.join(WHAT)}")
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()

    # -- the model's top module: the first module called with trainable parameters, outside any other module
    def _find_top_module(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        depth = [0]

        def pre(module, args):
            if depth[0] == 0 and self._top is None and torch.is_grad_enabled() and any(
                    p.requires_grad for p in module.parameters()):
                self._top = module
                self._change(module)
                for h in self._handles:  # found: no hook on any module call from here (the base runs have none)
                    h.remove()
                return
            depth[0] += 1

        def post(module, args, output):
            depth[0] -= 1

        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        self._handles = handles
        self._undo.append(lambda: [h.remove() for h in handles])

    def _change(self, module: torch.nn.Module) -> None:
        """The fix, on the top module: from its next call on (this call has begun)."""
        name = type(module).__name__
        if self.name == "compile":
            module.compile()
            self.applied.append(f"compiled {name}")
            return
        if self.name == "channels-last":
            module.to(memory_format=torch.channels_last)
        forward = module.forward
        dtype = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(self.name)
        on = self.name != "autocast-fp32"  # fp32: the script's own autocast turned off inside the forward

        def fixed_forward(*args, **kwargs):
            if self.name == "channels-last":
                args = tuple(a.contiguous(memory_format=torch.channels_last) if torch.is_tensor(a) and a.dim() == 4
                             else a for a in args)
                return forward(*args, **kwargs)
            device = next((a.device.type for a in (*args, *kwargs.values()) if torch.is_tensor(a)), "cpu")
            with torch.autocast(device, dtype=dtype, enabled=on):
                return forward(*args, **kwargs)

        module.forward = fixed_forward
        self.applied.append(f"{WHAT[self.name]}: {name}.forward")

    # -- optimizers built fused
    def _fused_optimizers(self):
        for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
            init = cls.__init__

            def fused_init(opt, params, *args, _orig_init=init, **kwargs):
                if kwargs.get("fused") is None and not kwargs.get("foreach"):
                    kwargs["fused"] = True
                    self.applied.append(f"{type(opt).__name__}(fused=True)")
                _orig_init(opt, params, *args, **kwargs)

            cls.__init__ = fused_init
            self._undo.append(lambda cls=cls, init=init: setattr(cls, "__init__", init))

    # -- loaders with workers
    def _loader_workers(self, workers: int):
        from torch.utils.data import DataLoader

        init = DataLoader.__init__

        def with_workers(loader, dataset, *args, **kwargs):
            # num_workers is DataLoader's fifth parameter after the dataset and pin_memory its seventh: either may
            # come positionally. A loader with fewer workers than the fix's is raised to them (the finding's
            # advice, measured); one with as many or more is left as it is
            given = args[4] if len(args) > 4 else kwargs.get("num_workers") or 0
            if given < workers:
                if len(args) > 4:
                    args = (*args[:4], workers, *args[5:])
                else:
                    kwargs["num_workers"] = workers
                kwargs["persistent_workers"] = True
                if len(args) <= 6:
                    kwargs["pin_memory"] = kwargs.get("pin_memory") or torch.cuda.is_available()
                self.applied.append(f"DataLoader(num_workers={workers}, persistent_workers=True)"
                                    + (f" (was num_workers={given})" if given else ""))
            init(loader, dataset, *args, **kwargs)

        DataLoader.__init__ = with_workers
        self._undo.append(lambda: setattr(DataLoader, "__init__", init))


    # -- diffusers' EMAModel built foreach
    def _foreach_ema(self):
        try:  # the script's own import then finds the module, and the class, patched
            from diffusers.training_utils import EMAModel
        except ImportError:
            return  # no diffusers: the script builds no EMAModel, and `applied` stays empty
        init = EMAModel.__init__

        def foreach_init(ema, parameters, *args, **kwargs):
            # foreach is EMAModel's eighth parameter after `parameters`: by name in practice, positionally possible
            if len(args) > 6:
                if not args[6]:
                    args = (*args[:6], True, *args[7:])
                    self.applied.append("EMAModel(foreach=True)")
            elif not kwargs.get("foreach"):
                kwargs["foreach"] = True
                self.applied.append("EMAModel(foreach=True)")
            init(ema, parameters, *args, **kwargs)

        EMAModel.__init__ = foreach_init
        self._undo.append(lambda: setattr(EMAModel, "__init__", init))


def trial_process(spec: dict) -> None:
    """Run the script under the fix; write {"step_ms", "applied"} (or {"error"}) to spec["out"]."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    script, warmup, steps = Path(spec["script"]), int(spec["warmup"]), int(spec["steps"])
    seen = [0]  # step boundaries so far: the first optimizer's steps
    ends: list[float] = []  # the timed window's two ends
    first: list = []

    def boundary(optimizer, args, kwargs):
        if not first:
            first.append(optimizer)
        if optimizer is not first[0]:
            return
        seen[0] += 1
        if seen[0] in (warmup, warmup + steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # note: sync, so the timed window holds the GPU's work
            ends.append(time.perf_counter())
            if len(ends) == 2:
                raise _Done

    sys.argv = [str(script), *spec["args"]]
    sys.path.insert(0, str(script.resolve().parent))
    handle = register_optimizer_step_post_hook(boundary)
    result: dict = {}
    try:
        with _Fix(spec["fix"]) as fix:
            runpy.run_path(str(script), run_name="__main__")
        result = {"error": f"the script ended after {seen[0]} steps, before the {warmup + steps} a trial needs"}
    except _Done:
        result = {"step_ms": 1000 * (ends[1] - ends[0]) / steps, "applied": fix.applied}
    except SystemExit as e:
        result = {"error": f"the script exited with status {e.code} after {seen[0]} steps"}
    except Exception as e:  # noqa: BLE001 - the trial's result says how the script failed under the fix
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} after {seen[0]} steps"}
    finally:
        handle.remove()
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    trial_process(json.loads(sys.argv[1]))
