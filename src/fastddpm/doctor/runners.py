"""Two ways to diagnose a loop nobody edited:

- `run_script`: run a user's script (as `python script.py args`) with two hooks placed from outside:
  DataLoader iteration is timed (a wait for data) and each `optimizer.step()` of the first optimizer that
  steps is a step boundary (torch.optim's global post-hook). When the bounded run is over, DoctorDone ends
  the script.
- `run_trainer`: fastddpm's own trainer for a bounded number of steps, through TrainHooks (the batch source
  is timed, each step is a boundary), no checkpoints or grids on the way.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import shutil
import sys
import threading
import weakref
from pathlib import Path

import torch

from fastddpm.doctor.api import diagnose
from fastddpm.doctor.report import Report
from fastddpm.doctor.rules import verdict
from fastddpm.doctor.script_context import ScriptContext
from fastddpm.doctor.session import DoctorConfig, DoctorDone, DoctorError, Session
from fastddpm.doctor.stall import Stalled, StallWatch, stalled
from fastddpm.doctor.watchers import AttentionWatch, SitesWindow, batch_size, conv_layout, optimizer_info

# --try's default bound (--try-seconds): the trials' rounds and steps are fitted to it
TRY_SECONDS = 300.0


class _TimedIterator:
    """A DataLoader iterator whose every `next` is timed as a wait for data, and told to the hooks (which loader
    the loop trains on is decided from its fetches)."""

    def __init__(self, it, session: Session, hooks: "ScriptHooks", loader):
        self._it = it
        self._session = session
        self._hooks = hooks
        # held while its batches are: `for x in DataLoader(...)` keeps only the iterator, and a loader gone before
        # the first step boundary could not be chosen as the training one (no loader probe, no batch size)
        self._loader = loader

    def __iter__(self):
        return self

    def __next__(self):
        # a batch fetched with grad on is the training loop's (one under no_grad is a validation pass's), counted
        # per step: a loop that accumulates gradients fetches several
        train = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        batch = self._session.wait_for_data(lambda: next(self._it), batch=train)
        self._hooks.fetched(self._loader, batch)
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


def _weakrefable(obj) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:  # a list or a tuple of samples used as the dataset
        return False
    return True


class ScriptHooks:
    """Install/remove the DataLoader and optimizer hooks for one session.

    The training loader is the one whose batch was fetched last before the first step boundary, leaving out
    fetches under torch.no_grad() or inference_mode (a validation pass before training iterates its own loader
    first); where every fetch before that boundary was without grad, the last one. A loop whose first steps
    fetch nothing (a warm-up on a fixed batch) waits for the first later boundary with a fetch under grad before
    it. Until it is known every loader's fetches are timed alike."""

    def __init__(self, session: Session):
        self.session = session
        self._orig_iter = None
        self._handles = []
        self._optimizer = None  # weakref to the optimizer whose steps are the step boundaries
        self._train_loader = None  # weakref to the training DataLoader once known: its new iterators are epochs
        self._train_dataset = None  # weakref to its dataset: a new loader over it, built each epoch, is the next
        # until the training loader is known: weakrefs to the loader of the latest fetch, and of the latest with
        # grad on (not under torch.no_grad() or inference_mode)
        self._last_fetch = self._last_grad_fetch = None
        self._first_batch = weakref.WeakKeyDictionary()  # loader -> its first batch's size
        self._iterated = weakref.WeakSet()  # loaders with an iterator made before the training loader was known
        self.optimizer_steps = 0
        self.loader_per_epoch = False  # a new training DataLoader seen at an epoch's start
        self.step_thread: int | None = None  # the thread whose optimizer steps are the boundaries
        self.batch_size: int | None = None  # of the training loader's first batch
        self.optimizer_info = None
        self.attention = AttentionWatch(lambda: session.phase == "watch")
        self.sites = SitesWindow()  # from a warm-up step's optimizer step to the next one's

    def fetched(self, loader, batch) -> None:
        """A batch came from `loader`: remembered until the training loader is known."""
        if self._train_loader is not None or loader is None:
            return
        if loader not in self._first_batch:
            self._first_batch[loader] = batch_size(batch)
        self._last_fetch = weakref.ref(loader)
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            self._last_grad_fetch = self._last_fetch

    def next_epochs_loader(self, loader) -> bool:
        """A loop that builds a new DataLoader each epoch (`for x in DataLoader(dataset, ...)`) iterates a new
        object over the training loader's dataset, with grad on: it is the training loader from here, and its
        iterator starts an epoch (a validation pass iterates under no_grad, or another dataset)."""
        train = self._train_dataset() if self._train_dataset is not None else None
        if train is None or loader.dataset is not train or not torch.is_grad_enabled() \
                or torch.is_inference_mode_enabled():
            return False
        self._train_loader = weakref.ref(loader)
        self.session.loader = loader
        self.loader_per_epoch = True
        return True

    def _choose_train_loader(self) -> None:
        """At a step boundary: the loader of the last fetch with grad on; at the first boundary, else the loader
        of the last fetch (a loop that fetches its training batches under no_grad)."""
        tried = (self._last_grad_fetch,) + ((self._last_fetch,) if self.optimizer_steps == 0 else ())
        chosen = next((r() for r in tried if r is not None and r() is not None), None)
        if chosen is None:
            return
        self._train_loader = weakref.ref(chosen)
        self._train_dataset = weakref.ref(chosen.dataset) if _weakrefable(chosen.dataset) else None
        self.session.loader = chosen
        self.batch_size = self._first_batch.get(chosen)
        if chosen in self._iterated:
            self.session.mark_epoch()  # the epoch it is in began before it was known: the first, not a boundary
        self._first_batch, self._iterated = None, None

    def __enter__(self):
        from torch.utils.data import DataLoader

        hooks, session = self, self.session
        orig = DataLoader.__iter__
        self._orig_iter = orig

        def timed_iter(loader):
            if hooks._train_loader is None:
                hooks._iterated.add(loader)
                it = session.wait_for_data(lambda: orig(loader), batch=False)
            elif hooks._train_loader() is loader or hooks.next_epochs_loader(loader):
                it = session.new_iterator(lambda: orig(loader))
            else:
                it = session.wait_for_data(lambda: orig(loader), batch=False)
            return _TimedIterator(it, session, hooks, loader)

        DataLoader.__iter__ = timed_iter

        def after_optimizer_step(optimizer, args, kwargs):
            if hooks._optimizer is None:
                hooks._optimizer = weakref.ref(optimizer)
                hooks.optimizer_info = optimizer_info(optimizer)
            if hooks._optimizer() is not optimizer:
                return
            if hooks._train_loader is None:
                hooks._choose_train_loader()
            hooks.optimizer_steps += 1
            hooks.step_thread = threading.get_ident()  # the thread that trains: where a stall is looked for
            session.step()
            if session.done:
                raise DoctorDone()
            if session.phase == "warmup":  # the next step is a warm-up one too: the counting costs no timed step
                hooks.sites.open(after_optimizer_step=True)

        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def before_optimizer_step(optimizer, args, kwargs):
            if hooks._optimizer is None or hooks._optimizer() is optimizer:
                hooks.sites.close()
                session.start_clocks()  # a loop that fetched no batch before its first step: its step 0 starts here

        self._handles = [register_optimizer_step_pre_hook(before_optimizer_step),
                         register_optimizer_step_post_hook(after_optimizer_step)]
        self.attention.__enter__()
        return self

    def __exit__(self, *exc):
        from torch.utils.data import DataLoader

        DataLoader.__iter__ = self._orig_iter
        for h in self._handles:
            h.remove()
        self.sites.close()
        self.attention.__exit__()
        return False

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps were the step boundaries (None once it is gone)."""
        return self._optimizer() if self._optimizer is not None else None

    def seen(self) -> dict:
        """What the hooks saw, as Measurements fields (diagnose's `seen`)."""
        opt = self.optimizer
        return {"batch_size": self.batch_size, "optimizer": self.optimizer_info,
                "loader_per_epoch": self.loader_per_epoch, **self.sites.seen(),
                "attention_calls": self.attention.measured(len(self.session.records)),
                "conv_layout": conv_layout(p for g in opt.param_groups for p in g["params"]) if opt else None}


def run_script(script: str | Path, args: list[str], config: DoctorConfig, *,
               device: torch.device | str | None = None, try_fixes: int = 0, try_rounds: int = 3,
               try_seconds: float | None = TRY_SECONDS, log=print) -> Report:
    """Run `script` with `args` under the doctor; returns the Report (and writes it under config.out_dir).
    `try_fixes`: then measure the top N fixes that can be applied from outside, each in up to `try_rounds` rounds
    alternating with the script unchanged, all within about `try_seconds` (fastddpm.doctor.trials)."""
    path = Path(script)
    if path.is_dir():
        raise DoctorError(f"doctor run: {path} is a folder; give the path of the .py file in it that trains")
    if not path.is_file():
        raise DoctorError(f"doctor run: no script at {path}; give the path of the .py file that trains")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as e:
        raise DoctorError(f"doctor run: {path} does not start: {_where(e)}; fix it, then run the doctor again") \
            from None
    session = Session(config, device=device)
    session.steps_end_in_optimizer_hook = True  # its boundary is an optimizer post-hook
    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    hooks = ScriptHooks(session)
    context = ScriptContext(path)  # what the script drives, to word the fixes in its own terms
    ended = "the script returned"
    watch = StallWatch(path, config.time_budget_s, lambda: hooks.optimizer_steps, lambda: hooks.step_thread, log=log)
    stuck = False
    try:
        with hooks, context, watch:
            runpy.run_path(str(path), run_name="__main__")
    except DoctorDone:
        ended = None
    except Stalled:
        stuck = True
        stall = (f"no step ended for {watch.idle_s:.0f} s, the process idle (the limit: {watch.limit_s:.0f} s); it "
                 f"was stuck at {watch.where}")
        if not session.records:
            raise DoctorError(f"doctor run: {path} stopped after {watch.steps_at_stall} optimizer steps, before the "
                              f"doctor measured one: {stall}") from None
        ended = f"the doctor ended it: {stall}"
    except (ImportError, SyntaxError) as e:
        if session.step_index:
            raise
        raise DoctorError(f"doctor run: {path} does not start: {_where(e, path)}; install or fix what it imports, "
                          f"then run the doctor again") from None
    except SystemExit as e:
        if e.code not in (None, 0):
            shared = [a for a in args if a.split("=", 1)[0] in ("--warmup", "--steps", "--json", "--device")]
            hint = (f" (if {shared[0]} was meant for the doctor, put it before the script name)"
                    if shared and e.code == 2 and not session.step_index else "")
            raise DoctorError(f"doctor run: {path} exited with status {e.code} after {session.step_index} steps"
                              f"{hint}; run it without the doctor first to see why") from e
        ended = f"the script exited with status {e.code or 0}"
    except Exception as e:  # the script's own error: named at its line, without the doctor's frames
        if not session.records:
            raise DoctorError(f"doctor run: {path} raised {_where(e, path)} after {hooks.optimizer_steps} optimizer "
                              "steps, before the doctor measured one, so there is nothing to diagnose; run it "
                              "without the doctor to see the whole traceback") from None
        ended = f"the script raised {_where(e, path)}"
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        session.release_hooks()
    if hooks.optimizer_steps == 0:
        raise DoctorError(
            f"doctor run: {path} never called optimizer.step() on a torch.optim optimizer, so the doctor found no "
            f"step boundaries. Mark them yourself with fastddpm.doctor.watch(loader) and dr.step() in the script")
    if ended is not None:
        session.finish_early(ended)
    opt = hooks.optimizer
    params = [p for g in opt.param_groups for p in g["params"]] if opt is not None else None
    report = diagnose(session, context="user", command=["fastddpm", "doctor", "run", str(path), *args],
                      seen=hooks.seen(), params=params)
    if stuck:  # rule 21: the loop itself stopped; nothing else it does matters until it moves
        report.findings.insert(0, stalled(watch))
        report.verdict = verdict(report.findings, report.measurements)
    in_script_terms(report, context, optimizer=hooks.optimizer, loader=session.loader)
    if try_fixes:
        try_top_fixes(report, path, args, try_fixes, rounds=try_rounds, budget_s=try_seconds, log=log)
    elif report.files.get("json"):
        report.save(Path(report.files["json"]).parent)
    return report


def in_script_terms(report: Report, script: ScriptContext, *, optimizer=None, loader=None) -> None:
    """Each fix that the script's own flags, its framework's arguments or the library call it makes can apply,
    worded so: a flag to pass, an argument at a file:line (the raw torch change stays beside it where the library
    decides). The frameworks it drives go into the report."""
    for f in report.findings:
        for fix in f.fixes:
            name, _, n = (fix.trial or "").partition(":")
            found = (script.precision_fix(name.split("-")[1]) if name.startswith("autocast-") else
                     script.optimizer_fix(optimizer) if name == "fused-optimizer" else
                     script.dataloader_fix(int(n), loader=loader) if name == "loader-workers" else
                     script.compile_fix() if name == "compile" else
                     script.ema_fix() if f.id == "per-tensor-ema" and fix is f.fixes[0] else None)
            if found is None:
                continue
            fix.code = found.text if found.kind != "code" else f"{found.text}; else: {fix.code}"
            fix.args = found.args
            if f.id == "per-tensor-ema":  # the script's EMAModel: its foreach argument can be set from outside
                fix.trial = "foreach-ema"
    report.script = script.to_dict()


def try_plan_line(trials: list, n: int, shape, *, what: str, against: str, none: str) -> str:
    """`doctor --try: 1 fix of the 2 asked (...): channels-last; 3 rounds of 2 runs, ...`: what --try will run
    and for how long, and why fewer than N fixes where there are."""
    if not trials:
        return f"doctor --try: {none}"
    fewer = f" of the {n} asked (no other can be tried)" if len(trials) < n else ""
    plural = what + ("es" if what.endswith(("s", "x", "sh", "ch")) else "s")
    compiled = any(t.fix == "compile" or (t.settings or {}).get("train.compile") == "on" for t in trials)
    return (f"doctor --try: {len(trials)} {what if len(trials) == 1 else plural}{fewer}, each against {against}, "
            f"alternating: {', '.join(t.fix for t in trials)}; {shape.describe(1 + len(trials))}"
            + (" (and torch.compile's own time in its runs' first steps)" if compiled else ""))


def _median_step_ms(report: Report) -> float | None:
    return (report.measurements.get("step_stats") or {}).get("median_ms") or None


def try_top_fixes(report: Report, path: Path, args: list[str], n: int, *, rounds: int = 3,
                  budget_s: float | None = None, log=print) -> None:
    """`--try N`: the top N fixes tried on the script, measured against its runs without them (report.trials),
    in rounds that fit `budget_s` (--try-seconds) at the diagnosed step time."""
    from fastddpm.doctor.trials import fit_shape, plan, run_trials

    convs = bool((report.measurements.get("optimizer") or {}).get("conv_weights"))
    trials = plan(report.findings, n, convs=convs)
    shape = fit_shape(_median_step_ms(report), 1 + len(trials), budget_s, rounds=rounds)
    log(try_plan_line(trials, n, shape, what="fix", against="the script without it",
                      none="no finding has a fix the doctor can apply from outside the script"))
    run_trials(path, args, trials, rounds=shape.rounds, warmup=shape.warmup, steps=shape.steps, budget_s=budget_s,
               log=log)
    report.trials = [t.to_dict() for t in trials]
    if report.files.get("json"):
        report.save(Path(report.files["json"]).parent)


def _where(e: BaseException, script: Path | None = None) -> str:
    """`SyntaxError at train.py:12: invalid syntax`, or `ModuleNotFoundError: No module named 'x' (train.py:3)`:
    the error and the innermost line of the script (or of the file a SyntaxError is in) that raised it."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError at {e.filename}:{e.lineno}: {e.msg}"
    line = None
    tb = e.__traceback__
    while tb is not None:
        if script is not None and Path(tb.tb_frame.f_code.co_filename).resolve() == script.resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{type(e).__name__}: {e}" + (f" ({script}:{line})" if line is not None else "")


class _TimedBatches:
    """fastddpm's batch source with each `get` timed; a new epoch starts when m wraps around."""

    def __init__(self, inner, session: Session):
        self._inner = inner
        self._session = session

    def get(self, m: int):
        if m % self._inner.steps_per_epoch == 0:  # the first call opens epoch 0 (not a boundary)
            self._session.mark_epoch()
        return self._session.wait_for_data(lambda: self._inner.get(m))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _step_done(session: Session) -> bool:
    """A step boundary; True once the doctor's windows are over (the trainer then stops)."""
    session.step()
    return session.done


def recorded_head_pad(fast_path: dict) -> int:
    """The attention head padding a run trained with, from run.json's `fast_path` ("8 (auto: ...)", "off (...)");
    0 for a run.json written before it was recorded."""
    first = str(fast_path.get("attention_head_pad", "off")).split(" ", 1)[0]
    return int(first) if first.isdigit() else 0


def run_model(cfg, fast_path: dict) -> torch.nn.Module:
    """The U-Net as the run built it, for counting its step: padded heads move their zeros through memory too
    (about 3% more activation bytes on seed-1layer at a pad of 8), though count_step_flops leaves their FLOPs out."""
    from fastddpm.models import build_unet, set_attention_head_pad

    model = build_unet(cfg.model)
    set_attention_head_pad(model, recorded_head_pad(fast_path))
    return model


def run_trainer(cfg, config: DoctorConfig, *, log=print, try_fixes: int = 0, try_rounds: int = 3,
                try_seconds: float | None = TRY_SECONDS, try_log=print) -> Report:
    """fastddpm's trainer for config.total_steps steps under the doctor (its lines to `log`). `cfg` is a
    RunConfig. `try_fixes`: then measure the top N fixes that are fastddpm settings, `fastddpm train` with and
    without each, alternating (their progress to `try_log`)."""
    from fastddpm.config import from_dict
    from fastddpm.device import resolve_device
    from fastddpm.measure import count_step_bytes, count_step_flops
    from fastddpm.rundir.layout import RunDir
    from fastddpm.trainer.loop import train
    from fastddpm.trainer.setup import TrainHooks

    out = Path(config.out_dir) if config.out_dir else None
    if out is None:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="fastddpm-doctor-"))
        config = dataclasses.replace(config, out_dir=out)
    t = dataclasses.replace(cfg.train, max_steps=config.total_steps, max_images=None, max_epochs=None,
                            checkpoint_every=None, sample_every_images=None, progress=False,
                            log_every=max(config.total_steps, 1))
    cfg = dataclasses.replace(cfg, train=t)
    device, _ = resolve_device(t.device)
    session = Session(config, device=device)
    run_dir = out / "run"
    if run_dir.exists():  # the doctor's own short run from an earlier report in this folder: a fresh one is measured
        shutil.rmtree(run_dir)
    hooks = TrainHooks(wrap_batches=lambda b: _TimedBatches(b, session), after_step=lambda step: _step_done(session),
                       final_outputs=False)
    try:
        train(cfg, out_dir=run_dir, hooks=hooks, log=log)
    finally:
        session.release_hooks()
    resolved = from_dict(json.loads(RunDir(run_dir).config.read_text()))
    m, images = resolved.model, resolved.train.batch_size * resolved.train.accum_steps
    info = json.loads(RunDir(run_dir).info.read_text())
    precision = info["precision"]  # what autocast ran the matmuls in
    fast_path = info.get("fast_path", {})
    model = run_model(resolved, fast_path)
    flops = count_step_flops(model, (resolved.train.batch_size, m.image_channels, m.image_size, m.image_size),
                             accum_steps=resolved.train.accum_steps)
    channels_last = str(fast_path.get("channels_last", "off")).startswith("on")
    # the layout the run compiled with, as resolved ("auto" forces it on a GPU); a run.json from before it was
    # recorded gives only the setting
    forced = (str(fast_path["inductor_layout"]).startswith("channels-last") if "inductor_layout" in fast_path
              else resolved.train.inductor_layout == "channels-last"
              and str(fast_path.get("compile", "off")).startswith("on"))
    # the roofline's bytes counted on the model, as bench throughput and the ladder count them (eager autograd's
    # saved set: a compiled step replayed from a CUDA graph shows the profiler no saves of its own)
    moved = count_step_bytes(model.to(device), (m.image_channels, m.image_size, m.image_size),
                             images_per_step=images, device=device,
                             autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision))
    pad = recorded_head_pad(fast_path)
    step_bytes = {"activation_bytes": moved["activation_bytes_per_image"] * images,
                  "update_bytes": moved["update_bytes_per_step"],
                  "basis": f"counted on the model: eager autograd's saved tensors in {precision}"
                           + (f" (attention heads padded to {pad}, as the run had them)" if pad else "") + ", "
                           f"{moved['activation_bytes_per_image'] / 1e6:.3g} MB an image, written and read once; "
                           f"AdamW's update and the EMA over the parameters in fp32"}
    del model
    report = diagnose(session, context="fastddpm", flops_per_step=flops, command=sys.argv, matmul_dtype=precision,
                      seen={"batch_size": resolved.train.batch_size,
                            "conv_layout": "channels_last" if channels_last else "nchw",
                            "inductor_layout": "channels-last" if forced else None},
                      step_bytes=step_bytes)
    if try_fixes:
        from fastddpm.doctor.trials import fit_shape, plan_trainer, run_trials

        trials = plan_trainer(report.findings, try_fixes)
        shape = fit_shape(_median_step_ms(report), 1 + len(trials), try_seconds, rounds=try_rounds, trainer=True)
        try_log(try_plan_line(trials, try_fixes, shape, what="setting", against="the config without it",
                              none="no finding has a fastddpm setting to try"))
        report.trials = [t.to_dict() for t in run_trials(cfg.to_dict(), [], trials, rounds=shape.rounds,
                                                         warmup=shape.warmup, steps=shape.steps,
                                                         budget_s=try_seconds, log=try_log)]
        if report.files.get("json"):
            report.save(Path(report.files["json"]).parent)
    return report
