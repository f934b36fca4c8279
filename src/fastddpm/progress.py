"""Progress that reads well wherever it is written: tqdm's bar on a terminal, the notebook bar in Jupyter, and
elsewhere (nohup, CI, `2> train.log`) a plain line every `every_s` seconds. A bar redrawn with carriage returns
leaves one line of tens of thousands of characters in a log file; these lines are whole and few.

`progress_bar(total, ...)` picks one (or, with disable=True, one that shows nothing); all take update(n),
set_postfix(**values), close(), and are context managers. Imports nothing of fastddpm (a ground-floor module).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TextIO

# A line every this many seconds where there is no terminal: a 6-minute run leaves about a dozen
EVERY_S = 30.0


def _duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class PlainProgress:
    """A progress bar for a file that is not a terminal: a line such as
    `step 1,200/2,344 (51%) | loss=0.0829, img_s=460 | 2:34 elapsed, ETA 2:26` at most every `every_s` seconds,
    and one at close() for where it ended. `clock` is injectable for tests."""

    def __init__(self, total: int | None, *, initial: int = 0, unit: str = "step", desc: str | None = None,
                 every_s: float = EVERY_S, file: TextIO | None = None, clock=time.monotonic):
        self.total, self.n, self.unit, self.desc = total, initial, unit, desc
        self.every_s, self.fp, self._clock = every_s, file if file is not None else sys.stderr, clock
        self.postfix: dict[str, object] = {}
        self._t0 = self._t_line = clock()
        self._n0 = self._n_line = initial
        self._first: tuple[float, int] | None = None  # (time, count) at the first line printed
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if now - self._t_line >= self.every_s:
            self._line(now)

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix.update(values)

    def close(self) -> None:
        if not self.closed and self.n != self._n_line:
            self._line(self._clock())
        self.closed = True

    def external_write_mode(self, file=None):
        return contextlib.nullcontext()  # whole lines: nothing to clear around another writer's line

    def _line(self, now: float) -> None:
        elapsed = now - self._t0
        rate = (self.n - self._n0) / elapsed if elapsed > 0 else 0.0
        if self._first is not None and now > self._first[0] and self.n > self._first[1]:
            # The ETA from the rate since the first line: the mean since the start keeps the first steps' one-off
            # set-up (torch.compile, CUDA graph capture: minutes on a GPU) in it, and overstates the time left for
            # most of the run; the rate of the last interval alone jumps with every slow patch of a shared machine.
            rate = (self.n - self._first[1]) / (now - self._first[0])
        where = f"{self.unit} {self.n:,}"
        if self.total:
            where += f"/{self.total:,} ({100 * self.n / self.total:.0f}%)"
        parts = ([self.desc] if self.desc else []) + [where]
        if self.postfix:
            parts.append(", ".join(f"{k}={v}" for k, v in self.postfix.items()))
        eta = (self.total - self.n) / rate if self.total and rate > 0 else None
        parts.append(f"{_duration(elapsed)} elapsed" + (f", ETA {_duration(eta)}" if self.total else ""))
        print(" | ".join(parts), file=self.fp, flush=True)
        self._t_line, self._n_line = now, self.n
        if self._first is None:
            self._first = (now, self.n)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoProgress:
    """What `progress_bar(..., disable=True)` returns (a command's --no-progress): the same calls, nothing shown."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, refresh: bool = False, **values) -> None:
        pass

    def close(self) -> None:
        pass

    def external_write_mode(self, file=None):
        return contextlib.nullcontext()

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc) -> None:
        pass


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where tqdm's notebook bar draws a widget)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except AttributeError:
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_bar(total: int | None, *, initial: int = 0, unit: str = "step", desc: str | None = None,
                 file: TextIO | None = None, every_s: float = EVERY_S, unit_scale: bool = False,
                 disable: bool = False):
    """The progress display for `file` (default stderr, where tqdm draws): the notebook bar in Jupyter, tqdm's bar
    on a terminal, else PlainProgress lines; NoProgress with `disable`. `unit_scale`: the bars show counts as k, M,
    G (bytes of a download); the plain lines keep whole counts."""
    if disable:
        return NoProgress()
    file = file if file is not None else sys.stderr
    if in_notebook():
        with contextlib.suppress(ImportError):  # tqdm's notebook bar needs ipywidgets
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm(total=total, initial=initial, unit=unit, desc=desc, unit_scale=unit_scale)
    isatty = getattr(file, "isatty", None)
    if callable(isatty) and isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit=unit, desc=desc, file=file, dynamic_ncols=True, leave=True,
                    unit_scale=unit_scale)
    return PlainProgress(total, initial=initial, unit=unit, desc=desc, file=file, every_s=every_s)
