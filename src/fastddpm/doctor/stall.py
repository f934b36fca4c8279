"""A script that stops making steps under `doctor run`: the time budget is checked as each step ends, so a loop stuck
between two steps (a deadlocked DataLoader worker, a wait on a queue nobody feeds, a sleep) would hold the doctor
forever. StallWatch watches from a thread. The loop is stuck when, for the limit, no step has ended, the process and
its child processes have used no CPU (under 5% of a core) and the training thread has stood at the same line: a
validation pass (in the process or a child), a checkpoint save or a slow step compute, and move. The limit is the
longer of the time budget (--max-seconds, or STALL_MIN_S without one) and STALL_STEPS of the slowest step so far;
before the first step, SETUP_FACTOR times that (a dataset read may take minutes; the wait is said every
SETUP_NOTE_S). Then it notes where the thread stands and ends the script with SIGUSR1, raising Stalled in it, and
the doctor reports what it measured. The signal is the doctor's only while it runs: one sent from outside goes to
the handler there was before (or ends the process, as by default), a faulthandler registration is put back after,
and a script that takes the signal over is said to, not ended; one whose handler the signal does not reach
(faulthandler.register inside it takes it below Python) is reached at Python's level, or said to be unreachable."""

from __future__ import annotations

import _thread
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from fastddpm.doctor.findings import Finding, Fix
from fastddpm.doctor.watchers import place_of

STALL_MIN_S = 60.0  # without a time budget: the shortest stall
STALL_STEPS = 10  # ... and never under this many of the slowest step so far
SETUP_FACTOR = 3  # before the first step the limit is this many times longer
SETUP_NOTE_S = 30.0  # before the first step: the wait is said this often
IDLE_CPU = 0.05  # of one core: a process (with its children) waiting, not working
UNHEARD_S = 5.0  # a stop signal whose Python handler has not run after this long is not heard
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's CPU times are in clock ticks


class Stalled(BaseException):
    """Raised in the script's main thread when StallWatch found it stuck (a BaseException: the script's own
    `except Exception` must not swallow it)."""


class StallWatch:
    """Polls `steps()` (the steps ended so far) and `thread()` (the thread they end in, None before the first);
    once Stalled was raised, `where`, `idle_s`, `limit_s` and `steps_at_stall` say the stall."""

    def __init__(self, script: Path, budget_s: float | None, steps: Callable[[], int],
                 thread: Callable[[], int | None] = lambda: None, *, log=print, poll_s: float = 1.0):
        self.script, self.budget_s, self.steps, self.thread = script, budget_s, steps, thread
        self.log, self.poll_s = log, poll_s
        self.where: str | None = None
        self.idle_s = self.limit_s = 0.0
        self.steps_at_stall = 0
        self._longest = 0.0
        self._fired = False  # the watch sent the signal (an outside SIGUSR1 is not a stall)
        self._pending = False  # ... and the script has not yet raised Stalled for it
        self._lock = threading.Lock()  # the watch fires only while the script runs
        self._running = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_handler = None
        self._faulthandler = False

    def limit(self, started: bool) -> float:
        limit = max(self.budget_s or STALL_MIN_S, STALL_STEPS * self._longest)
        return limit if started else SETUP_FACTOR * limit

    def __enter__(self) -> StallWatch:
        # a signal is what wakes a thread blocked in a sleep or a wait; only the main thread can take one
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return self
        self._faulthandler = faulthandler.unregister(signal.SIGUSR1)  # put back after
        self._old_handler = signal.signal(signal.SIGUSR1, self._handle)
        self._running = True
        self._thread = threading.Thread(target=self._watch, name="fastddpm-doctor-stall-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        with self._lock:
            self._running = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            faulthandler.unregister(signal.SIGUSR1)  # the script's own registration ends with it
            signal.signal(signal.SIGUSR1, self._old_handler)
            if self._faulthandler:
                try:
                    faulthandler.register(signal.SIGUSR1, all_threads=True)
                except (OSError, ValueError):  # sys.stderr without a file descriptor now (a captured stream)
                    pass
        return False

    def _handle(self, signum, frame) -> None:
        if self._pending:
            self._pending = False
            raise Stalled()
        if self._fired:
            return  # the watch's own signal, delivered twice (interrupt_main and the kill)
        old = self._old_handler  # a SIGUSR1 from outside: what it would have done without the doctor
        if callable(old):
            old(signum, frame)
        elif old != signal.SIG_IGN:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGUSR1)

    def _watch(self) -> None:
        t0 = time.perf_counter()
        seen, last_step, said = 0, None, 0
        last_cpu, busy_at = cpu_seconds(), t0
        spot, still_since, fired_at = None, t0, None
        while not self._stop.wait(self.poll_s):
            now, count, cpu = time.perf_counter(), self.steps(), cpu_seconds()
            if self._pending and now - fired_at > UNHEARD_S:
                # The Python handler never ran: the thread is blocked in C code that waits on after a signal (a
                # C++ condition variable, a CUDA or NCCL wait: only its return would run the handler), or the
                # signal is taken below Python (a C extension's handler). Nothing in the process can unwind such a
                # wait; Ctrl-C's handler runs in Python too, so the way out is a signal Python does not handle.
                self.log(f"doctor run: {self.script.name} did not stop when the doctor signalled it: it stands at "
                         f"{self.where}, in C code that no signal interrupts (a C++ library's wait), or with SIGUSR1 "
                         f"taken below Python. Ctrl-C may not stop it either: end it with Ctrl-\\ (SIGQUIT) or "
                         f"`kill -9 {os.getpid()}`, then run that line without the doctor to see why it waits; "
                         "nothing was reported")
                return
            if count != seen:
                if last_step is not None:  # the longest gap between steps, to a poll
                    self._longest = max(self._longest, (now - last_step) / (count - seen))
                last_step, seen = now, count
            if cpu - last_cpu > IDLE_CPU * self.poll_s:
                busy_at = now
            last_cpu = cpu
            ident = self.thread() or threading.main_thread().ident
            here = _innermost(ident)
            if here != spot:
                spot, still_since = here, now
            if last_step is None and int((now - t0) // SETUP_NOTE_S) > said:
                said = int((now - t0) // SETUP_NOTE_S)
                self.log(f"doctor run: waiting for {self.script.name}'s first optimizer.step() ({now - t0:.0f} s; "
                         "its imports and set-up are not timed)")
            limit = self.limit(last_step is not None)
            quiet_since = max(last_step or t0, busy_at, still_since)
            if now - quiet_since <= limit or self._pending:
                continue  # one signal at a time: another would restart the wait for it (fired_at), never said
            with self._lock:
                if not self._running:
                    return
                if signal.getsignal(signal.SIGUSR1) != self._handle:
                    self.log(f"doctor run: {self.script.name} has made no step for {now - (last_step or t0):.0f} s "
                             f"and stands at {stuck_at(ident, self.script)}, but it handles SIGUSR1 itself, so "
                             "the doctor cannot end it: stop it yourself (Ctrl-C)")
                    return
                self.where, self.steps_at_stall = stuck_at(ident, self.script), count
                self.idle_s, self.limit_s = now - (last_step or t0), limit
                self._fired = self._pending = True
                fired_at = now
                # A faulthandler registration of the script's own for SIGUSR1 is removed first: its C handler
                # dumps every thread's stack, this thread's too while it runs on, and that crashed the process (a
                # segmentation fault, about one stall in ten); the report says where the script stood. Then the
                # handler at Python's level, and the signal itself, whose EINTR wakes a blocked sleep or wait.
                faulthandler.unregister(signal.SIGUSR1)
                _thread.interrupt_main(signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGUSR1)
            still_since = busy_at = now  # swallowed by the script (a bare except): fired again after another limit


def cpu_seconds() -> float:
    """CPU time of this process and of its child processes, live (a validation in a subprocess, a pool, DataLoader
    workers: read from Linux's /proc) and waited for: a process waiting on a busy child is working, not stalled.
    Elsewhere, this process's and its waited-for children's."""
    t = os.times()
    total = time.process_time() + t.children_user + t.children_system
    for pid in _descendants(os.getpid()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)
        except (OSError, ValueError, IndexError):  # gone since it was listed
            continue
    return total


def _descendants(pid: int) -> list[int]:
    """Live descendants of `pid` from /proc/PID/task/TID/children (Linux 3.5+); [] where there is none."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _innermost(ident: int | None) -> tuple | None:
    frame = sys._current_frames().get(ident)
    return None if frame is None else (frame.f_code, frame.f_lineno)


def stuck_at(thread_id: int | None, script: Path) -> str:
    """Where the thread is: the innermost line of `script` on its stack (`train.py:23 in main`, worded by
    watchers.place_of as the report words every place), and the Python call it is in when that is elsewhere (a
    queue's get), else that line's code (a C call such as time.sleep has no frame of its own)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "an unknown place"
    mine, target = frame, script.resolve()
    while mine is not None and Path(mine.f_code.co_filename).resolve() != target:
        mine = mine.f_back
    inner, _ = place_of(frame)
    if mine is None:
        return inner
    where, code = place_of(mine)
    if mine is not frame:
        return f"{where}, inside {inner}"
    return f"{where} ({code})" if code else where


def stalled(watch: StallWatch) -> Finding:
    """Rule 21: the finding of a loop that stopped making steps (StallWatch ended it)."""
    return Finding(
        "stalled", (21,), f"STALLED: no step for {watch.idle_s:.0f} s after step {watch.steps_at_stall}, the "
        "process idle", 1.0,
        [f"no step ended for {watch.idle_s:.0f} s after step {watch.steps_at_stall}, while the process used no CPU and "
         f"its training thread stood at one line, against a limit of {watch.limit_s:.0f} s (the longer of the time "
         f"budget and {STALL_STEPS} of the slowest step so far)",
         f"the script was stuck at {watch.where}"],
        "the loop waits on something that does not come: a DataLoader worker that died or deadlocked (a fork after "
        "threads, a lock in the dataset), a queue or input() nobody feeds, a sleep",
        [Fix(None, f"look at {(watch.where or '').split(',')[0]}: rerun with DataLoader(num_workers=0) to see a "
                   "worker's own traceback, or run the script alone and send it SIGINT where it hangs to see the "
                   "stack")])
