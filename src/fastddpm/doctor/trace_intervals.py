"""Time intervals of trace events, in microseconds: merging them, measuring how much of one range they cover,
thinning them for drawing, and asking whether a moment fell inside a host op on a thread."""

from __future__ import annotations

import bisect
from typing import Callable


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap(a0: float, a1: float, merged: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [a0, a1] covered by the sorted, disjoint intervals `merged` (starts = their starts)."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, a0) - 1)
    while i < len(merged) and merged[i][0] < a1:
        s, e = merged[i]
        total += max(0.0, min(e, a1) - max(s, a0))
        i += 1
    return total


def coarsen(merged: list[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most `limit` intervals for drawing: close the smallest gaps first (a pixel cannot show them)."""
    if len(merged) <= limit:
        return merged
    gaps = sorted(b[0] - a[1] for a, b in zip(merged, merged[1:]))
    cut = gaps[len(merged) - limit]
    out = [list(merged[0])]
    for s, e in merged[1:]:
        if s - out[-1][1] < cut:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class Ranges:
    """Merged time ranges of one host op per thread, for 'was this moment inside op X on thread T?'. `name`: the
    op's name, or a test of the name (a family of ranges, e.g. every Optimizer.step#...)."""

    def __init__(self, op_events: list[dict], name: str | Callable[[str], bool]):
        match = name if callable(name) else name.__eq__
        by_tid: dict = {}
        for o in op_events:
            if match(o.get("name", "")):
                by_tid.setdefault(o.get("tid"), []).append((float(o["ts"]), float(o["ts"]) + float(o.get("dur", 0))))
        self.ranges = {tid: merge(v) for tid, v in by_tid.items()}
        self.starts = {tid: [s for s, _ in v] for tid, v in self.ranges.items()}
        self._holes: Ranges | None = None

    def exclude(self, holes: "Ranges") -> None:
        """From now on a moment inside `holes` (on the same thread) is not inside these ranges."""
        self._holes = holes

    def contains(self, tid, ts: float) -> bool:
        if self._holes is not None and self._holes.contains(tid, ts):
            return False
        r = self.ranges.get(tid)
        if not r:
            return False
        i = bisect.bisect_right(self.starts[tid], ts) - 1
        return i >= 0 and r[i][0] <= ts < r[i][1]


def any_between(sorted_values: list[float], lo: float, hi: float) -> bool:
    i = bisect.bisect_left(sorted_values, lo)
    return i < len(sorted_values) and sorted_values[i] <= hi
