"""Every chart fastddpm draws (the ladder, samplers, time to quality, the FID curve, the loss curve) goes through
here: matplotlib's object API, which leaves the caller's pyplot backend alone (a notebook keeps its own), and a
PNG written to a temporary name and renamed, so a reader never sees half a file."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullFormatter


def figure(width_in: float, height_in: float) -> Figure:
    return Figure(figsize=(width_in, height_in))


def save(fig: Figure, path: Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    tmp.replace(path)
    return path


def log_y(ax) -> None:
    """A log y axis labelled in plain numbers (20, 0.05). matplotlib's default writes them as powers of ten,
    1.2x10^1 on the minor ticks it labels when the range is under about a decade (FID 12-24). Which ticks get a
    label stays matplotlib's choice."""
    ax.set_yscale("log")
    _plain_labels(ax.yaxis)


def log_x(ax, ticks: list[float] | None = None) -> None:
    """A log x axis labelled in plain numbers (10, 100, not 10^1), as log_y; with `ticks`, labelled at those values
    (the points measured: matplotlib labels NFE 5-20 at 6, 10 and 20 only), fewer where labels would overlap
    (spaced_log_ticks)."""
    ax.set_xscale("log")
    _plain_labels(ax.xaxis)
    if ticks:
        ax.xaxis.set_major_locator(FixedLocator(spaced_log_ticks(ticks)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, pos=None: f"{x:g}"))


def spaced_log_ticks(values: list[float], labels: int = 14) -> list[float]:
    """The positive `values`, smallest first, each kept where it lies at least 1/`labels` of the range's log span
    from the last one kept (and the largest always): about `labels` labels at most across the axis."""
    xs = sorted({float(v) for v in values if v > 0})
    if len(xs) <= 2:
        return xs
    gap = math.log(xs[-1] / xs[0]) / labels
    kept = [xs[0]]
    for x in xs[1:-1]:
        if math.log(x / kept[-1]) >= gap and math.log(xs[-1] / x) >= gap:
            kept.append(x)
    return kept + [xs[-1]]


def _plain_labels(axis) -> None:
    axis.set_major_formatter(_PlainLogFormatter())
    axis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of ticks to label (set_locs), each label written as %g (0.05, not 5e-02)."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def smoothed(values: list[float], alpha: float = 0.1) -> list[float]:
    """An exponential moving average (bias-corrected, as Adam's moments), for a noisy loss."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = (1 - alpha) * avg + alpha * v
        out.append(avg / (1 - (1 - alpha) ** i))
    return out


def loss_curve(records: list[dict], path: Path, *, title: str) -> Path | None:
    """The training loss against images seen (metrics.jsonl's logged steps), raw and smoothed, on a log scale.
    None when fewer than two steps were logged."""
    points = [(r["images_seen"], r["loss"]) for r in records
              if "loss" in r and "images_seen" in r and r["loss"] is not None and math.isfinite(r["loss"])]
    if len(points) < 2:
        return None
    images, loss = zip(*points)
    fig = figure(7, 4.2)
    ax = fig.subplots()
    # each logged loss is already the mean over its logging window: a light EMA over them, so the curve still
    # follows the fast early drop
    ax.plot(images, loss, color="0.7", linewidth=0.8, label="loss (mean of each logging window)")
    ax.plot(images, smoothed(list(loss), alpha=0.3), color="C0", linewidth=1.6, label="smoothed (EMA 0.7)")
    ax.set_xlabel("images seen")
    ax.set_ylabel("loss")
    if min(loss) > 0:
        log_y(ax)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path)
