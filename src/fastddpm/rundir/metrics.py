"""The metrics logs: one JSON object per line in RUN_DIR/metrics.jsonl (and eval.jsonl), appended across resumes.
Each holds one history: a resume moves the records of the steps it trains again to <name>.abandoned.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from fastddpm.rundir.files import atomic_write_bytes


class MetricsLog:
    """`also`: called with every record after it is written (the run's --log-to loggers)."""

    def __init__(self, path: Path, also: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        self.also = also
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a+b") as f:
            # a line a kill cut short has no newline: end it, so that this record starts a line of its own
            cut = False
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            f.write((("\n" if cut else "") + json.dumps(record) + "\n").encode())
        if self.also is not None:
            self.also(record)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a log. A line that does not parse is skipped where a kill leaves one: the last line (cut
    short mid-write), or one a later write ended (MetricsLog.write starts its record on a line of its own)."""
    records = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def abandoned(path: Path) -> Path:
    """Where set_aside_after moves a log's records: metrics.jsonl -> metrics.abandoned.jsonl."""
    return path.with_name(f"{path.stem}.abandoned{path.suffix}")


def set_aside_after(path: Path, step: int | None) -> int:
    """Move the records of steps after `step` from the log at `path` to abandoned(path) beside it: a resume
    from `step` trains those steps again (a run killed after its last checkpoint logged them; a resume from an
    older checkpoint leaves a whole branch), and two records of one step would draw the loss twice. A line cut
    short by a kill goes too. `step` None moves every record: a new run in a folder where an earlier run wrote
    no checkpoint. Appended there first, then the log rewritten atomically: a crash between leaves a
    record in both files, never in neither. Returns how many records moved."""
    if not path.is_file():
        return 0
    keep, drop = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            later = step is None or int(json.loads(line).get("step", -1)) > step
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            later = True
        (drop if later else keep).append(line)
    if not drop:
        return 0
    with open(abandoned(path), "a") as f:
        f.write("\n".join(drop) + "\n")
        f.flush()
        os.fsync(f.fileno())
    atomic_write_bytes(path, "".join(f"{line}\n" for line in keep).encode())
    return len(drop)
