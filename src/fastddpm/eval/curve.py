"""The time-to-quality curve: FID against training wall time and against images seen."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def kept_records(records: list[dict]) -> list[dict]:
    """The records of the steps the run kept: a resume from a checkpoint before the last record trains those steps
    again, so a record at or below an earlier one's images_seen replaces it (the abandoned tail)."""
    kept: list[dict] = []
    for r in records:
        while kept and kept[-1]["images_seen"] >= r["images_seen"]:
            kept.pop()
        kept.append(r)
    return kept


def cumulative_wall_s(records: list[dict]) -> list[float]:
    """Training wall time across resumes, for kept_records. A checkpoint carries the run's training time, so wall_s
    goes on across a resume; a run resumed from a checkpoint written before it did restarts wall_s at 0, and such a
    drop starts a new segment that continues from the previous segment's last value."""
    out, offset, prev = [], 0.0, None
    for r in records:
        w = float(r["wall_s"])
        if prev is not None and w < prev:
            offset += prev
        out.append(offset + w)
        prev = w
    return out


def write_curve(records: list[dict], path: Path, *, title: str, log: Callable[[str], None] = print) -> Path | None:
    """FID vs wall time and vs images seen, side by side. Returns the path, or None with no records."""
    from fastddpm import charts

    records = kept_records(records)
    if not records:
        return None
    fid = [r["fid"] for r in records]
    wall = cumulative_wall_s(records)
    images = [r["images_seen"] for r in records]
    fig = charts.figure(11, 4.2)
    a, b = fig.subplots(1, 2)
    for ax, x, xlabel in ((a, wall, "training wall time, s (evaluation excluded, compile included)"),
                          (b, images, "images seen")):
        ax.plot(x, fid, marker="o")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("FID")
        if min(fid) > 0 and max(fid) / min(fid) > 20:
            charts.log_y(ax)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return charts.save(fig, path)
