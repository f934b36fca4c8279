"""The doctor's measuring engine: a bounded run cut into warm-up, watch and profile windows.

    step:   0 ......... warmup | ........ watch ........ | .... profile .... | done
            compile, caches      cheap timers only         torch.profiler      diagnose

Each window ends at a step boundary when its planned steps are done, or earlier when its share of the time budget
(DoctorConfig.time_budget_s) is spent and it has the fewest steps it can use: a loop of 10-second steps is
diagnosed in about a minute, not after 55 steps.

- warm-up: nothing is judged (compilation, cuDNN autotuning, allocator growth, worker start-up).
- watch: host timers around every wait for data and every step boundary, CUDA events on the boundaries,
  CPU load from /proc on a side thread, dynamo's counters. Costs microseconds per step (<= 3% is the promise;
  benchmarks/doctor_overhead.py measures it). Step-time statistics come from this window only.
- profile: torch.profiler with CPU and CUDA activities and input shapes, the steps bracketed by
  `fastddpm::step` ranges and data waits by `fastddpm::data_wait`, exported as a Chrome/Perfetto trace that
  fastddpm.doctor.trace reads. The profiler slows the host, so no step time is taken from this window.
- the second warm-up step also counts what autograd saves for the backward (measure.SavedTensors: the
  roofline's bytes); its Python hooks would slow a watched or profiled step.

Whoever drives the loop calls `wait_for_data(fn)` around each fetch (or `new_iterator(fn)` for a fresh
epoch) and `step()` at each step boundary. `watch()` (fastddpm.doctor.api), `doctor run` and `doctor train`
are three ways of placing those two calls.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fastddpm.doctor.marks import DATA_MARK, STEP_MARK
from fastddpm.doctor.measurements import CpuLoad, DeviceMemory, LoaderProbe, StepRecord, StepStats, Telemetry
from fastddpm.doctor.system import CpuSampler, StepEvents, device_memory, gpu_telemetry, usable_device
from fastddpm.doctor.watchers import AttentionSites, dynamo_graphs, mark_step_closures
from fastddpm.measure import SavedTensors


# The time budget's shares of the windows. The watch gets the most: its steps are the step-time statistics. The
# profile gets more than its few steps need because the profiler slows every step, and its start and stop cost
# time of their own. The warm-up only has to get past the first steps' compilation and autotuning.
WARMUP_SHARE = 0.25
WATCH_SHARE = 0.45
PROFILE_SHARE = 0.30

# The fewest steps a window cut by time may end with: the first step often compiles, so the warm-up sees a second
# one; a median needs 3 watched steps; one profiled step is a trace the rules can read.
MIN_WARMUP_STEPS = 2
MIN_WATCH_STEPS = 3
MIN_PROFILE_STEPS = 1

# Kineto's own log lines. It writes them from C++ straight to file descriptor 2 (redirecting sys.stderr does not
# catch them); torch 2.13 prints at its default level, at the profiler's start and stop:
#   USDT:2026-11-22 22:45:39 28823:28823 SyncActivityProfilerHandler.cpp:52] profiler_start
#   USDT:2026-11-22 22:45:39 28823:28823 SyncActivityProfilerHandler.cpp:59] profiler_stop
# and, with KINETO_LOG_LEVEL lowered, INFO: and STAGE: lines of the same form. Its WARNING: and ERROR: lines
# (e.g. CUPTI without permission: no GPU timeline) are kept. Setting KINETO_LOG_LEVEL is no fix: Kineto reads
# it once, when the process first profiles.
_PROFILER_LOG_LINE = re.compile(rb"(?:INFO|STAGE|USDT|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def profiler_logs_muted():
    """Around the profiler's start, stop and export: file descriptor 2 goes to a temporary file, and afterwards
    every line in it but Kineto's own log lines is written back to fd 2, so real warnings and errors still
    reach the user (later, in their order)."""
    if sys.stderr is not None:
        sys.stderr.flush()  # Python's buffered stderr writes before the switch go out in place
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            if sys.stderr is not None:
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured.read().splitlines(keepends=True)
                            if not _PROFILER_LOG_LINE.match(line))
            while kept:
                kept = kept[os.write(2, kept):]


class DoctorError(Exception):
    """A user error: what to diagnose cannot be run or has no steps. The message says what to do."""


class DoctorDone(BaseException):
    """Raised (by `doctor run`) to end a user's script once the bounded run is over. A BaseException so that
    a script's `except Exception` does not swallow it."""


@dataclass(kw_only=True)
class DoctorConfig:
    """How long the doctor watches, and where it writes."""

    warmup_steps: int = 5  # not judged: compilation, autotuning, worker start-up
    steps: int = 40  # watched with cheap timers: the step-time statistics
    profile_steps: int = 10  # then traced with torch.profiler (0: no trace; GPU-level rules unavailable)
    loader_probe_s: float = 2.0  # afterwards, time the loader alone for up to this long (0: skip)
    # the three windows together, seconds (warm-up 25%, watch 45%, profile 30%): a window whose share is spent
    # ends early, at a step boundary, once it has its fewest steps (2, 3, 1). None: bounded by steps only
    time_budget_s: float | None = 60.0
    out_dir: str | Path | None = None  # report.txt / report.json / report.html; None: nothing written
    # keep the profiler trace in out_dir, gzipped (<host>_<pid>.doctor.pt.trace.json.gz: Perfetto and TensorBoard's
    # profiler plugin read it). Off: the trace is read into the report and deleted (tens of MB unzipped)
    save_trace: bool = False

    def __post_init__(self):
        for name in ("warmup_steps", "profile_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.steps < 3:
            raise ValueError(f"steps={self.steps}: the doctor needs at least 3 watched steps for a median; "
                             f"use 20 or more")
        if self.loader_probe_s < 0:
            raise ValueError(f"loader_probe_s={self.loader_probe_s} must be >= 0")
        if self.save_trace and self.out_dir is None:
            raise ValueError("save_trace=True keeps the trace in out_dir: give an out_dir (--report-dir)")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s={self.time_budget_s} must be > 0 seconds (--max-seconds S), or None to "
                             f"bound the run by steps only (--max-seconds 0)")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps + self.profile_steps


class _ThreadDemand:
    """(seconds this thread ran, seconds it sat runnable waiting for a core), from Linux schedstat.

    Of a wait for data, the part spent neither running nor queued for a core is blocking (I/O, sleep, locks,
    a queue fed by workers). Running / (running + blocking) says whether the wait is CPU work in this process,
    however crowded the cores are. Without schedstat: thread CPU time, and no queued time."""

    def __init__(self):
        self._fd = None
        try:
            import threading

            self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
            if int(os.pread(self._fd, 128, 0).split()[0]) == 0:  # kernel without schedstats: all zeros
                os.close(self._fd)
                self._fd = None
        except (OSError, AttributeError, ValueError, IndexError):
            self._fd = None

    def __call__(self) -> tuple[float, float]:
        if self._fd is not None:
            try:
                run_ns, wait_ns, _ = os.pread(self._fd, 128, 0).split()
                return int(run_ns) / 1e9, int(wait_ns) / 1e9
            except (OSError, ValueError):
                pass
        return time.thread_time(), 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Session:
    def __init__(self, config: DoctorConfig, *, device: torch.device | str | None = None,
                 on_done: Callable[[], None] | None = None):
        self.config = config
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = usable_device(device)
        except ValueError as e:
            raise DoctorError(str(e)) from None
        self.cuda = self.device.type == "cuda"
        self.on_done = on_done
        self.step_index = 0  # steps finished
        self.records: list[StepRecord] = []
        self._t_boundary = time.perf_counter()  # until start_clocks moves it to the loop's first fetch
        self._clocks_started = False
        self._wait_s = 0.0
        self._batches = 0  # fetched in this step
        self._wait_cpu_s = 0.0
        self._wait_queued_s = 0.0
        self._demand = _ThreadDemand()
        self._epoch_start = False
        self._epochs = 0
        self.profiled_epoch_starts: list[bool] = []  # per profiled step, in order: whether it began an epoch
        self._events = StepEvents()  # CUDA events on the watch's step boundaries
        self._graphs_prev = dynamo_graphs()
        self.compile_start = self._graphs_prev  # dynamo's counters are per process: count from here
        self.compile_warm: tuple[int, int, int] | None = None
        self.compile_end: tuple[int, int, int] | None = None
        self.cpu = CpuSampler()
        self.cpu_load: CpuLoad | None = None
        self.telemetry_start: Telemetry | None = None
        self.telemetry_end: Telemetry | None = None
        self.memory: DeviceMemory | None = None
        self.profiler = None
        self._step_range = None
        self.trace_path: Path | None = None
        self.profile_wall_s: float | None = None
        self.done = False
        self.started_at = time.time()
        self.wall_t0 = time.perf_counter()
        self.wall_s: float | None = None
        self.notes: list[str] = []
        self.loader = None  # the training DataLoader when known: timed alone at the end
        # what autograd saved for the backward in the second warm-up step (the roofline's bytes); None before
        self.saved: SavedTensors | None = None
        self.saved_unavailable: str | None = None  # why nothing was counted, when the session knows
        self._opt_hooks = None  # torch.optim step() timing during the watched steps: (pre, post) hook handles
        self._closure_hook = None  # from the watch to the end: the handle of the pre-hook that wraps step closures
        self.steps_end_in_optimizer_hook = False  # the runner calls step() from an optimizer post-hook
        self._opt_s, self._opt_t0 = 0.0, None
        # the modules that built attention weights in that step (not looked for in a compiled loop)
        self.attention_sites: AttentionSites | None = None
        c = config
        # window -> (planned steps, fewest steps when cut by time, share of the time budget)
        self._plan = {"warmup": (c.warmup_steps, min(MIN_WARMUP_STEPS, c.warmup_steps), WARMUP_SHARE),
                      "watch": (c.steps, MIN_WATCH_STEPS, WATCH_SHARE),
                      "profile": (c.profile_steps, min(MIN_PROFILE_STEPS, c.profile_steps), PROFILE_SHARE)}
        # each window that ran: {"planned", "taken", "seconds", "budget_s", "cut_by_time"}, for the report
        self.windows: dict[str, dict] = {}
        self._phase = "warmup"
        self._window_t0 = self.wall_t0
        self._window_step_s: list[float] = []  # the current window's step times, for the note when it is cut
        if c.warmup_steps == 0:
            self._phase = "watch"
            self._enter("warmup", "watch")

    # ---------------------------------------------------------------- windows
    @property
    def phase(self) -> str:
        """The current window: "warmup", "watch", "profile" or "done"."""
        return self._phase

    def _window_over(self, now: float) -> bool:
        planned, fewest, share = self._plan[self._phase]
        taken = len(self._window_step_s)
        if taken >= planned:
            return True
        budget = self.config.time_budget_s
        return budget is not None and taken >= fewest and now - self._window_t0 >= share * budget

    def _next_window(self, phase: str) -> str:
        order = ("warmup", "watch", "profile")
        for later in order[order.index(phase) + 1:]:
            if self._plan[later][0] > 0:
                return later
        return "done"

    def _close_window(self, now: float, *, ended_by_loop: bool = False) -> None:
        """Record the current window; say why when its time share cut it short."""
        phase, steps_s = self._phase, self._window_step_s
        planned, _, share = self._plan[phase]
        budget = self.config.time_budget_s
        cut = not ended_by_loop and len(steps_s) < planned
        self.windows[phase] = {"planned": planned, "taken": len(steps_s), "seconds": now - self._window_t0,
                               "budget_s": share * budget if budget is not None else None, "cut_by_time": cut}
        if cut:
            did = {"warmup": "warmed up for", "watch": "watched", "profile": "profiled"}[phase]
            name = {"warmup": "warm-up", "watch": "watch", "profile": "profile"}[phase]
            self.notes.append(
                f"{did} {len(steps_s)} of {planned} planned steps: the {name} window is bounded at "
                f"{_seconds(share * budget)} s ({share:.0%} of the {budget:g} s time budget, --max-seconds / "
                f"time_budget_s) and " + (
                    # two steps' median is their mean, which hides a compiling first step (71 s and 0.01 s)
                    f"its steps took {' and '.join(_seconds(x) + ' s' for x in steps_s)}" if len(steps_s) < 3
                    else f"its median step took {_seconds(statistics.median(steps_s))} s"))
        self._window_t0 = now
        self._window_step_s = []

    # ---------------------------------------------------------------- the two calls
    def start_clocks(self) -> None:
        """The loop's first step begins: at its first data fetch (wait_for_data calls this), or, in a loop that
        fetches nothing through the session, at its first optimizer step (doctor run's pre-hook). Step 0 and the
        warm-up window are timed from here, not from the Session's creation: a script's imports and set-up (a
        dataset read, a model built) are not a step, and do not spend the warm-up's share of the time budget. A
        loop that does neither is timed from the Session's creation."""
        if self._clocks_started:
            return
        self._clocks_started = True
        if self._phase == "watch" and not self.records:  # no warm-up: the watch's own clocks start here too
            self.cpu.rebase()
            self.compile_warm = self._graphs_prev = dynamo_graphs()
            if self.cuda:  # the telemetry read first: the step's first event and clock start after it
                self.telemetry_start = gpu_telemetry(self.device)
                self._events.open(self.device, self._plan["watch"][0])
        self._t_boundary = self._window_t0 = time.perf_counter()

    def wait_for_data(self, fetch: Callable[[], object], *, batch: bool = True) -> object:
        """Run `fetch` (a `next(iterator)`), timing how long the loop waits for it. `batch`: it fetches a
        training batch, counted per step (not so an iterator's creation, or another loader's batch)."""
        self.start_clocks()
        self._batches += batch
        profiling = self.phase == "profile" and self.profiler is not None
        rf = torch.autograd.profiler.record_function(DATA_MARK) if profiling else None
        if rf is not None:
            rf.__enter__()
        t0, (run0, queued0) = time.perf_counter(), self._demand()
        try:
            return fetch()
        finally:
            self._wait_s += time.perf_counter() - t0
            run1, queued1 = self._demand()
            self._wait_cpu_s += run1 - run0
            self._wait_queued_s += queued1 - queued0
            if rf is not None:
                rf.__exit__(None, None, None)

    def new_iterator(self, make: Callable[[], object]) -> object:
        """A fresh pass over the data (an epoch): creating it (worker start-up) counts as data wait."""
        self.mark_epoch()
        return self.wait_for_data(make, batch=False)

    def mark_epoch(self) -> None:
        """A new epoch begins in the current step (the first one is not a boundary)."""
        if self._epochs > 0:
            self._epoch_start = True
        self._epochs += 1

    def step(self) -> None:
        """A step boundary: the step that just ended is recorded; may start or stop the profiler."""
        if self.done:
            return
        self._clocks_started = True  # a loop with no fetch before its first boundary: timed from the creation
        now = time.perf_counter()
        phase = self._phase
        if phase == "watch":
            graphs = dynamo_graphs()
            if self._opt_t0 is not None:  # the boundary is the optimizer's own post-hook, called before ours
                self._opt_s += now - self._opt_t0
                self._opt_t0 = None
            rec = StepRecord(self.step_index, (now - self._t_boundary) * 1e3, self._wait_s * 1e3,
                             self._wait_cpu_s * 1e3, self._epoch_start, data_queued_ms=self._wait_queued_s * 1e3,
                             recompiles=graphs[0] - self._graphs_prev[0],
                             optimizer_ms=self._opt_s * 1e3 if self._opt_hooks is not None else None,
                             batches=self._batches)
            self._opt_s = 0.0
            self._graphs_prev = graphs
            self.records.append(rec)
            if self.cuda:
                self._events.record()  # no sync: read after the run
        elif phase == "profile":
            self.profiled_epoch_starts.append(self._epoch_start)
        self.step_index += 1
        self._window_step_s.append(now - self._t_boundary)
        self._wait_s = self._wait_cpu_s = self._wait_queued_s = 0.0
        self._batches = 0
        self._epoch_start = False
        self.stop_counting()  # one step counted is enough
        if self._window_over(now):
            self._close_window(now)
            self._phase = self._next_window(phase)
            self._enter(phase, self._phase)
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self.phase == "profile":
            self._step_range = torch.autograd.profiler.record_function(STEP_MARK)
            self._step_range.__enter__()
        if self.phase == "warmup" and self.step_index == 1:
            # the second warm-up step (the first compiles and builds state): counted there, where nothing is
            # timed, because its Python hooks slow a step of many small ops
            if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                # hooks of the loop's own (save_on_cpu around the loop): ours on top would hide them for a step
                self.saved_unavailable = ("the loop runs under saved-tensor hooks of its own (e.g. "
                                          "torch.autograd.graph.save_on_cpu): not counted, not to hide them")
            else:
                if dynamo_graphs()[0] == self.compile_start[0]:  # global module hooks would make dynamo recompile
                    self.attention_sites = AttentionSites().__enter__()
                sites = self.attention_sites
                self.saved = SavedTensors(on_pack=sites.saw if sites is not None else None).__enter__()
        self._t_boundary = time.perf_counter()
        if self.phase == "done":
            self._finish()

    # ---------------------------------------------------------------- transitions
    def _enter(self, old: str, new: str) -> None:
        if new == "watch":
            self._time_optimizer(True)
            self._mark_closures(True)
            self.compile_warm = dynamo_graphs()
            self._graphs_prev = self.compile_warm
            if self.cuda:
                self._events.open(self.device, self._plan["watch"][0])
                self.telemetry_start = gpu_telemetry(self.device)
            self.cpu.start()
        if old == "watch":
            self._time_optimizer(False)
            self.compile_end = dynamo_graphs()
            self.cpu_load = self.cpu.stop()
            if self.cuda:
                self.telemetry_end = gpu_telemetry(self.device)
        if new == "profile":
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profile_t0 = time.perf_counter()
            self.profiler = profile(activities=activities, record_shapes=True)
            with profiler_logs_muted():
                self.profiler.__enter__()
        if old == "profile":
            self._stop_profiler()

    def _time_optimizer(self, on: bool) -> None:
        """Time torch.optim step() calls (any optimizer, process-wide hooks) while the watched steps run. Where
        the steps end in an optimizer post-hook (doctor run), that boundary ends the timing: a
        post-hook of ours could not be added or removed there (torch iterates over the post-hooks then)."""
        if on and self._opt_hooks is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            def pre(optimizer, args, kwargs):
                self._opt_t0 = time.perf_counter()

            def post(optimizer, args, kwargs):
                if self._opt_t0 is not None:
                    self._opt_s += time.perf_counter() - self._opt_t0
                    self._opt_t0 = None

            self._opt_s, self._opt_t0 = 0.0, None
            self._opt_hooks = (register_optimizer_step_pre_hook(pre),) + (
                () if self.steps_end_in_optimizer_hook else (register_optimizer_step_post_hook(post),))
        elif not on and self._opt_hooks is not None:
            for h in self._opt_hooks:
                h.remove()
            self._opt_hooks, self._opt_t0 = None, None

    def _mark_closures(self, on: bool) -> None:
        """Wrap each closure given to a torch.optim step() (watchers.mark_step_closures): its time is not the
        optimizer's, and in the profile window its ops are charged to their own categories."""
        if on and self._closure_hook is None:
            self._closure_hook = mark_step_closures(profiling=lambda: self.profiler is not None,
                                                    took=self._closure_took)
        elif not on and self._closure_hook is not None:
            self._closure_hook.remove()
            self._closure_hook = None

    def _closure_took(self, seconds: float) -> None:
        if self._opt_t0 is not None:  # inside a timed step() call: not the optimizer's time
            self._opt_s -= seconds

    def release_hooks(self) -> None:
        """Remove every process-wide hook the session holds (the loop ended, or raised, mid-window)."""
        self.stop_counting()
        self._time_optimizer(False)
        self._mark_closures(False)

    def stop_counting(self) -> None:
        """Leave the saved-tensor count if a step is being counted (the loop ended, or raised, inside it)."""
        if self.saved is not None and self.saved.active:
            self.saved.__exit__(None, None, None)
            if self.attention_sites is not None:
                self.attention_sites.__exit__(None, None, None)

    def _stop_profiler(self) -> None:
        self.stop_counting()
        if self.profiler is None:
            return
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self.cuda:
            torch.cuda.synchronize(self.device)  # note: sync, after the measured steps, to flush the trace
        keep = self.config.save_trace
        out = Path(self.config.out_dir) if keep else Path(tempfile.mkdtemp(prefix="fastddpm-doctor-"))
        out.mkdir(parents=True, exist_ok=True)
        # TensorBoard's profiler plugin looks for <worker>.<n>.pt.trace.json(.gz) under a run folder
        self.trace_path = out / f"{socket.gethostname()}_{os.getpid()}.doctor.pt.trace.json{'.gz' if keep else ''}"
        with profiler_logs_muted():
            self.profiler.__exit__(None, None, None)
            self.profiler.export_chrome_trace(str(self.trace_path))
        self.profiler = None
        self.profile_wall_s = time.perf_counter() - self._profile_t0

    def discard_trace(self) -> None:
        """Delete the trace once it has been read, unless the config keeps it (save_trace)."""
        if self.trace_path is None or self.config.save_trace:
            return
        self.trace_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.trace_path.parent.rmdir()  # its own temporary folder
        self.trace_path = None

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        if self._phase != "done":  # ended early, by the loop
            self._close_window(time.perf_counter(), ended_by_loop=True)
        self._time_optimizer(False)
        if self._phase != "done" and self.records and self.cpu_load is None:  # ended early, inside the watch
            self.compile_end = dynamo_graphs()
            self.cpu_load = self.cpu.stop()
        self._stop_profiler()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # note: sync, after the run, to read the step events
            for rec, ms in zip(self.records, self._events.elapsed_ms()):
                rec.gpu_ms = ms
            self.memory = device_memory(self.device)
            if self.telemetry_end is None:
                self.telemetry_end = gpu_telemetry(self.device)
        self._mark_closures(False)
        self.wall_s = time.perf_counter() - self.wall_t0
        self._demand.close()
        if self.on_done is not None:
            self.on_done()

    def finish_early(self, reason: str) -> None:
        """The loop ended before the planned steps (the data ran out, the script returned)."""
        if not self.done:
            self.notes.append(f"the loop ended after {self.step_index} steps ({reason}); planned "
                              f"{self.config.total_steps}: fewer measurements than asked for")
            self._finish()

    # ---------------------------------------------------------------- after the run
    def probe_loader(self, train_step_ms: float | None, batches_per_step: float = 1.0) -> LoaderProbe | None:
        """Rule 1b: the loader alone, no training, for up to loader_probe_s: batches per second, against the
        batches per second the training takes (`batches_per_step` each step: accumulated micro-batches)."""
        loader = self.loader
        if loader is None or self.config.loader_probe_s <= 0:
            return None
        budget = self.config.loader_probe_s
        it = iter(loader)
        try:
            next(it)  # start-up (workers) is not throughput
        except StopIteration:
            return None
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < budget:
            try:
                next(it)
            except StopIteration:
                break
            n += 1
        elapsed = time.perf_counter() - t0
        del it
        if n == 0:
            return LoaderProbe(batches_per_s=None, note=f"no batch within {budget:g} s")
        rate = n / elapsed
        out = LoaderProbe(batches_per_s=rate, batches=n, seconds=elapsed)
        if train_step_ms:
            out.train_steps_per_s = 1000.0 / train_step_ms
            out.batches_per_step = batches_per_step if batches_per_step != 1 else None
            out.ratio = rate / (out.train_steps_per_s * batches_per_step)
        return out

    def step_stats(self) -> StepStats | None:
        """The watched steps' statistics; None before any step was watched."""
        recs = self.records
        if not recs:
            return None
        host = [r.host_ms for r in recs]
        gpu = [r.gpu_ms for r in recs if r.gpu_ms is not None]
        # rule 15's fifths on a GPU come from the CUDA events: a loop that never syncs queues its first steps
        # faster than the GPU runs them (host times of 0.5 ms, then the GPU's 25 ms once the queue is full), a
        # ramp that is not drift
        series, basis = (gpu, "CUDA events") if gpu and len(gpu) == len(recs) else (host, "host")
        first = series[: max(1, len(series) // 5)]
        last = series[-max(1, len(series) // 5):]
        return StepStats(
            steps=len(recs), median_ms=statistics.median(host), mean_ms=statistics.fmean(host),
            p10_ms=_quantile(host, 0.1), p90_ms=_quantile(host, 0.9), max_ms=max(host),
            data_wait_ms_total=sum(r.data_wait_ms for r in recs), host_ms_total=sum(host),
            epoch_starts=sum(r.epoch_start for r in recs),
            first_fifth_median_ms=statistics.median(first), last_fifth_median_ms=statistics.median(last),
            fifths_basis=basis,
            gpu_median_ms=statistics.median(gpu) if gpu else None,
            gpu_p10_ms=_quantile(gpu, 0.1) if gpu else None, gpu_p90_ms=_quantile(gpu, 0.9) if gpu else None)


def _seconds(s: float) -> str:
    return f"{s:.3g}" if s < 100 else f"{s:.0f}"


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]
