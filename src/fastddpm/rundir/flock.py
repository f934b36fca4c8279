"""What fastddpm's two file locks (the dataset cache's build lock, data/cache.py, and the run folder's one-trainer
lock, rundir/lock.py) share about flock(2). Imports nothing but the standard library: the dataset cache, which
`fastddpm --help` must reach without torch, imports it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# flock's answers on a file system without locks, where each lock's holder goes on unlocked: Lustre mounted without
# -o flock (ENOSYS), some NFS set-ups (ENOLCK), FUSE file systems that do not implement it (EOPNOTSUPP)
NO_LOCK_ERRNOS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


def is_the_file_at(opened, path: Path) -> bool:
    """Whether the open file is still the one at `path` (not removed, nor replaced by another). Both locks remove
    their file as they let go, so a process that opened it just before then locks a removed file, which excludes no
    one who opens the path afterwards: after flock succeeds, this says whether to open the path again."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(opened.fileno())
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
