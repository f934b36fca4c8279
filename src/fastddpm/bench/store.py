"""Result files that survive a killed run, and the resume that reads them back.

A GPU call that runs past its time limit is killed. So `bench throughput` and `bench ladder` rewrite their
files after every variant / rung, each atomically (a temporary file renamed over the old one: a reader, or
the next run, sees the old file or the new one, never half of one), and a re-run of the same command into the
same folder reuses every row already measured.

A row is reused only when its identity is equal: the item's full settings (the resolved config, the timing
settings, the data's fingerprint), the device's name and the torch / CUDA versions. The code version is not
part of the identity (a fix between two calls does not throw away the first call's measurements); every row
records the run that measured it (`run`: date, command, commit), and the reports list those runs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable


# what a bench's --out must be, said when it is not (a file, a folder that cannot be made or written)
OUT_FIX = "give a folder that can be created and written (new, or an earlier bench's, whose results it reuses)"


def fmt(value, spec: str, missing: str = "n/a") -> str:
    """A number for a report table: `format(value, spec)`, or `missing` for None, NaN and inf."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def json_safe(obj):
    """NaN and inf become null, tuples lists, so the file is strict JSON any parser reads."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def canonical(obj) -> object:
    """An identity as it reads back from JSON (tuples become lists, keys strings), so that an identity built
    now compares equal to the same identity loaded from a file."""
    return json.loads(json.dumps(json_safe(obj), sort_keys=True, default=str))


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: a kill leaves the old file or the new one


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(json_safe(obj), indent=2, allow_nan=False, default=str) + "\n")


def table_cell(text: str | None, limit: int, cut_mark: str = "...") -> str:
    """A message as one markdown table cell: its first line, cut at `limit` characters (ending in `cut_mark`), its
    pipes escaped (a traceback's first line or a shape like (B|C) would otherwise split the row)."""
    first = text.splitlines()[0] if text else ""
    if len(first) > limit:
        first = first[:limit - len(cut_mark)] + cut_mark
    return first.replace("|", "\\|")


def config_identity(config: dict) -> dict:
    """A resolved config as part of an identity: unset (None) fields are left out, so a new optional field added to
    the config between two runs does not discard the rows measured before it."""
    return {k: config_identity(v) if isinstance(v, dict) else v for k, v in config.items() if v is not None}


def device_identity(env: dict) -> dict:
    """The part of a run's environment that changes what a row measures (not the date, host or commit)."""
    return {"device": env["device"].split(":")[0], "device_name": env["device_name"], "torch": env["torch"],
            "cuda_runtime": env.get("cuda_runtime")}


def run_record(env: dict) -> dict:
    """Which run measured a row: kept with the row when a later run reuses it."""
    return {"date_utc": env["date_utc"], "run_id": env.get("run_id"), "command_line": env["command_line"],
            "git_commit": env["git_commit"], "git_dirty": env.get("git_dirty")}


def distinct_runs(rows: list[dict]) -> list[dict]:
    """The runs that measured these rows, oldest first, each once."""
    seen, out = set(), []
    for r in rows:
        run = r.get("run")
        if run and json.dumps(run, sort_keys=True) not in seen:
            seen.add(json.dumps(run, sort_keys=True))
            out.append(run)
    return sorted(out, key=lambda run: run["date_utc"])


class Previous:
    """The ok rows of an earlier result file in the same folder, looked up by identity.

    Failed rows are not reused (the next run measures them again: an interrupted compile, a transient error);
    ok rows whose identity matches nothing in this run are reported, and the old file is kept beside the new
    one as <name>.replaced.json before it is overwritten.
    """

    def __init__(self, path: Path, *, schema: str, rows: Callable[[dict], list[dict]], remeasure: bool,
                 log: Callable[[str], None]):
        self.path, self.log = path, log
        self.rows: list[dict] = []  # the earlier ok rows
        self.failed: list[dict] = []  # the earlier failed rows: measured again, their error named in the log
        self._used: set[int] = set()
        if not path.is_file():
            return
        if remeasure:
            log(f"--remeasure: ignoring the rows already in {path}")
            self._backup()
            return
        try:
            data = json.loads(path.read_text())
        except ValueError as e:  # a file cut short by hand, or from an older writer that was not atomic
            log(f"cannot read {path} ({e}): measuring everything again")
            self._backup()
            return
        if data.get("schema") != schema:
            log(f"{path} has schema {data.get('schema')!r}, not {schema!r}: measuring everything again")
            self._backup()
            return
        earlier = rows(data)
        self.rows = [r for r in earlier if r.get("status") == "ok" and "identity" in r]
        self.failed = [r for r in earlier if r.get("status") == "failed" and "identity" in r]

    def _backup(self) -> None:
        backup = self.path.with_name(self.path.stem + ".replaced.json")
        os.replace(self.path, backup)
        self.log(f"kept the earlier file as {backup}")

    def take(self, identity: dict) -> dict | None:
        """The earlier ok row with exactly this identity, or None."""
        want = canonical(identity)
        for i, r in enumerate(self.rows):
            if i not in self._used and r["identity"] == want:
                self._used.add(i)
                return r
        return None

    def failed_before(self, identity: dict) -> dict | None:
        """The earlier failed row with this identity (it is measured again), or None."""
        want = canonical(identity)
        return next((r for r in self.failed if r["identity"] == want), None)

    def take_all(self, keep: Callable[[dict], bool]) -> list[dict]:
        """Every earlier ok row not yet taken whose identity `keep` accepts: for a command whose runs each measure a
        part of one table (other points of the same subject), to carry them into the new file."""
        out = []
        for i, r in enumerate(self.rows):
            if i not in self._used and keep(r["identity"]):
                self._used.add(i)
                out.append(r)
        return out

    def finish_matching(self) -> None:
        """Say which earlier ok rows matched nothing in this run, and keep the old file beside the new one."""
        unused = [r for i, r in enumerate(self.rows) if i not in self._used]
        if unused:
            self.log(f"{len(unused)} row(s) in {self.path} match no item of this command (other settings, device "
                     "or torch): they are not carried into the new file")
            self._backup()
