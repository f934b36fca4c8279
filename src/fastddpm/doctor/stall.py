"""A script that stops making steps under `doctor run`: the time budget is checked as each step ends, so a loop stuck
between two steps (a deadlocked DataLoader worker, a collective waiting for a peer, a sleep) would hold the doctor
forever. StallWatch watches the clock from a thread: once no step has ended for the longer of the time budget
(--max-seconds, or STALL_MIN_S without one) and STALL_STEPS of the slowest step so far, it notes where the script
is stuck and ends it with a signal, and the doctor reports what it measured. Set-up before the first step is not
bounded (a dataset read may take minutes); it is said every SETUP_NOTE_S instead."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from fastddpm.doctor.findings import Finding, Fix

STALL_MIN_S = 60.0  # without a time budget: no step for this long is a stall
STALL_STEPS = 10  # ... nor for this many of the slowest step so far (a step that compiles is slow, not stuck)
SETUP_NOTE_S = 30.0  # before the first step: said this often, so a long set-up is not mistaken for a hang


class Stalled(BaseException):
    """Raised in the script's thread when it made no step for StallWatch's limit (a BaseException: the script's
    own `except Exception` must not swallow it)."""


class StallWatch:
    """Polls `steps()`, the count of steps ended so far; `where` and `idle_s` say the stall once Stalled was
    raised."""

    def __init__(self, script: Path, budget_s: float | None, steps: Callable[[], int], *, log=print,
                 poll_s: float = 1.0):
        self.script, self.budget_s, self.steps, self.log, self.poll_s = script, budget_s, steps, log, poll_s
        self.where: str | None = None
        self.idle_s = 0.0
        self.limit_s = 0.0
        self._last: float | None = None
        self._longest = 0.0
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_handler = None
        self._main = threading.main_thread().ident

    def limit(self) -> float:
        return max(self.budget_s or STALL_MIN_S, STALL_STEPS * self._longest)

    def __enter__(self) -> StallWatch:
        # a signal is what wakes a thread blocked in a sleep or a wait; only the main thread receives one
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
            return self
        self._old_handler = signal.signal(signal.SIGUSR1, self._handle)
        self._armed = True
        self._thread = threading.Thread(target=self._watch, name="fastddpm-doctor-stall-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._armed = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(signal.SIGUSR1, self._old_handler)
        return False

    def _handle(self, signum, frame) -> None:
        if self._armed:
            self._armed = False
            raise Stalled()

    def _watch(self) -> None:
        t0, said, seen = time.perf_counter(), 0, 0
        while not self._stop.wait(self.poll_s):
            now, count = time.perf_counter(), self.steps()
            if count != seen:  # steps ended since the last look: the longest gap is known to a poll
                if self._last is not None:
                    self._longest = max(self._longest, (now - self._last) / (count - seen))
                self._last, seen = now, count
            if self._last is None:  # set-up: not bounded, said
                if int((now - t0) // SETUP_NOTE_S) > said:
                    said = int((now - t0) // SETUP_NOTE_S)
                    self.log(f"doctor run: waiting for {self.script.name}'s first optimizer.step() "
                             f"({now - t0:.0f} s; its imports and set-up are not timed)")
                continue
            if now - self._last > self.limit():
                self.idle_s, self.limit_s = now - self._last, self.limit()
                self.where = stuck_at(self._main, self.script)
                if self._armed:
                    os.kill(os.getpid(), signal.SIGUSR1)
                return


def stuck_at(thread_id: int | None, script: Path) -> str:
    """Where the thread is: the innermost line of `script` on its stack (`train.py:23 in main`), and the call it is
    in when that is elsewhere (`time.sleep`, a queue's get)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)
    mine = [f for f in stack if Path(f.filename).resolve() == script.resolve()]
    inner = stack[-1]
    if not mine:
        return f"{inner.filename}:{inner.lineno} in {inner.name}"
    at = mine[-1]
    where = f"{script.name}:{at.lineno} in {at.name}"
    if at is not inner:
        where += f", inside {Path(inner.filename).name}:{inner.lineno} in {inner.name}"
    elif at.line:
        where += f" ({at.line.strip()})"
    return where


def stalled(watch: StallWatch, steps: int) -> Finding:
    """Rule 21: the finding of a loop that stopped making steps (StallWatch ended it): the whole step, and more."""
    return Finding(
        "stalled", (21,), f"STALLED: the loop made no step for {watch.idle_s:.0f} s after step {steps}", 1.0,
        [f"no step ended for {watch.idle_s:.0f} s after step {steps}, against a limit of {watch.limit_s:.0f} s (the "
         f"longer of the time budget and {STALL_STEPS} of the slowest step so far)",
         f"the script was stuck at {watch.where}"],
        "the loop waits on something that does not come: a DataLoader worker that died or deadlocked (a fork after "
        "threads, a lock in the dataset), a collective waiting for another rank, a queue or input() nobody feeds",
        [Fix(None, f"look at {watch.where.split(',')[0]}: rerun with DataLoader(num_workers=0) to see a worker's own "
                   "traceback, or run the script alone and send it SIGINT where it hangs to see the stack")])
