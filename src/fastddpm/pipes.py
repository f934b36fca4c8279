"""When the reader of a command's output leaves: `fastddpm train ... | head -8`, `fastddpm --help | head -1`.

Python ignores SIGPIPE, so a write into a pipe whose reader is gone raises BrokenPipeError wherever it happens: in
a print deep in the trainer, or in the interpreter's last flush of a block-buffered stdout, which prints "Exception
ignored ... BrokenPipeError" and exits 120. A shell tool (cat, `git log | head`) ends there, quietly, with 141
(128 + SIGPIPE). fastddpm's commands end the same way (fastddpm.cli.main); a training run first finishes its step
and writes its checkpoint, as on SIGTERM (ReaderWatch, which fastddpm.trainer.loop holds while a run trains).

Imports nothing of fastddpm (a ground-floor module).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, TextIO

EXIT_READER_GONE = 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe ended


class ReaderGone(BrokenPipeError):
    """Raised where a reader that left ends more than a write (fastddpm.trainer.loop.ReaderLeft: the training run),
    the streams already silenced: fastddpm.cli.main ends the command with 141 as for any BrokenPipeError."""


def reader_gone(stream: TextIO | None) -> bool:
    """Whether `stream` writes into a pipe or socket whose reader is gone: poll says POLLERR on such a write end
    (a file or a terminal never does). False where it cannot be told (no descriptor, no poll)."""
    import select

    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation (a notebook's stream) is both
        return False


def silence(stream: TextIO) -> None:
    """Point `stream`'s descriptor at os.devnull (Python's docs, the signal module's "Note on SIGPIPE"), then flush
    into it what the closed pipe refused: later writes, and the interpreter's flush at exit, succeed and go
    nowhere, not into a traceback or an "Exception ignored" line."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    with contextlib.suppress(OSError, ValueError):
        stream.flush()


def silence_closed_streams() -> bool:
    """Silence sys.stdout and sys.stderr where their reader is gone; whether either was. A BrokenPipeError when
    neither is came from another pipe (a subprocess's), not from the reader of this command's output."""
    gone = [stream for stream in (sys.stdout, sys.stderr) if reader_gone(stream)]
    for stream in gone:
        silence(stream)
    return bool(gone)


class ReaderWatch:
    """While a run trains: tells `on_gone("stdout")` (or "stderr") once that stream's reader has left, found
    either by `poll()` (the loop calls it at each step's end: a run that prints nothing for hours still notices
    that `head` has exited) or by a write that raised BrokenPipeError. The stream is silenced then, so nothing
    more reaches the closed pipe and no later print raises. In the main thread sys.stdout and sys.stderr are
    replaced, for the watch's duration, by stand-ins that catch that error in every print, the run's log, the
    progress lines and the libraries' alike."""

    def __init__(self, on_gone: Callable[[str], None]):
        self.on_gone = on_gone
        self.streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        self.gone: set[str] = set()
        self._stand_ins: dict[str, _StandIn] = {}

    def __enter__(self) -> ReaderWatch:
        if threading.current_thread() is threading.main_thread():  # sys.stdout is the whole process's
            for name, stream in self.streams.items():
                self._stand_ins[name] = _StandIn(stream, name, self)
                setattr(sys, name, self._stand_ins[name])
        return self

    def __exit__(self, *exc) -> None:
        for name, stand_in in self._stand_ins.items():
            if getattr(sys, name) is stand_in:  # another watch inside this one was left as it was
                setattr(sys, name, self.streams[name])
        self._stand_ins.clear()

    def poll(self) -> None:
        for name, stream in self.streams.items():
            if name not in self.gone and reader_gone(stream):
                self.left(name)

    def left(self, name: str) -> None:
        if name in self.gone:
            return
        self.gone.add(name)
        silence(self.streams[name])
        self.on_gone(name)


class _StandIn:
    """sys.stdout or sys.stderr, whose writes and flushes end a BrokenPipeError in ReaderWatch.left; every other
    attribute (isatty, fileno, encoding) is the stream's own."""

    def __init__(self, stream: TextIO, name: str, watch: ReaderWatch):
        self._stream, self._name, self._watch = stream, name, watch

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._watch.left(self._name)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._watch.left(self._name)

    def __getattr__(self, attr: str):
        return getattr(self._stream, attr)
