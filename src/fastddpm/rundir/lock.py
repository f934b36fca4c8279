"""One training process per run folder."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

from fastddpm.rundir.files import rank_0_by_env
from fastddpm.rundir.flock import NO_LOCK_ERRNOS, is_the_file_at


class RunFolderLock:
    """An exclusive flock on RUN/.train.lock, taken by rank 0 once the folder exists and held until the run ends
    (the kernel drops it when the process dies, SIGKILL included). A second `fastddpm train` into the same folder
    (the command started again in another terminal, with --resume latest or before the first wrote a checkpoint) is
    refused before it writes there: both had trained, each overwriting the other's checkpoints and interleaving
    one metrics.jsonl. The other ranks of a torchrun job share rank 0's folder and hold nothing; where there is no
    fcntl, or the file system has no locks, the run goes on unlocked. The file is removed when the lock is let go."""

    NAME = ".train.lock"

    def __init__(self, run_dir: Path, *, said=None):
        """`said`: how the refusal names the run's folder and resume (config.Spelling; the command's flags if
        None)."""
        self.path, self.file = Path(run_dir) / self.NAME, None
        try:
            import fcntl
        except ImportError:  # not POSIX
            return
        if not rank_0_by_env():
            return
        while True:
            file = open(self.path, "a+")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "a process"
                file.close()
                from fastddpm.config import CLI, ConfigError

                said = said or CLI
                raise ConfigError(f"{said('out', str(run_dir))}: another fastddpm train is writing this run folder "
                                  f"({holder}): wait for it to end, or stop it (Ctrl-C, or kill -TERM: it saves a "
                                  f"checkpoint) and continue with {said('resume', 'latest')}; or give another "
                                  f"{said('out')}") from None
            except OSError as e:
                file.close()
                if e.errno in NO_LOCK_ERRNOS:
                    return
                raise
            if is_the_file_at(file, self.path):
                break
            # the holder let go (removing the file) between our open and our lock: another trainer may already hold
            # the file now at the path, so lock that one instead
            file.close()
        file.seek(0)
        file.truncate()
        since = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        file.write(f"pid {os.getpid()} on {platform.node()}, since {since}\n")
        file.flush()
        self.file = file

    def release(self) -> None:
        """Let go, removing the file first (while still held: a run folder keeps no file of a finished run)."""
        if self.file is not None:
            self.path.unlink(missing_ok=True)
            self.file.close()
            self.file = None

    def __enter__(self) -> "RunFolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
