"""The metrics log: one JSON object per line in RUN_DIR/metrics.jsonl, appended across resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


class MetricsLog:
    """`also`: called with every record after it is written (the run's --log-to loggers)."""

    def __init__(self, path: Path, also: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        self.also = also
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.also is not None:
            self.also(record)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
