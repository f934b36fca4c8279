"""Errors that teach: every problem with the user's data names the path, what was found, and the fix.

`DataError` is a `ValueError` so callers that already treat bad arguments as `ValueError` keep working;
the CLI prints it as `error: <message>` without a traceback, because a traceback into our decoder
tells the user nothing about which of their 60,000 files is broken.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

# Enough lines to see the pattern of what is wrong without scrolling a terminal off screen;
# the full list goes to a file (see `bad_files_message`).
MAX_LISTED_BAD_FILES = 50


class DataError(ValueError):
    """A problem with the user's data or data options; the message names the path/value and the fix."""


@dataclass(kw_only=True, frozen=True)
class BadFile:
    """One file that could not become a training image, and why (shown to the user verbatim)."""

    path: str  # as the user knows it: relative to the folder, or the member name inside the zip
    reason: str
    # Short category used to tailor the "Fix:" line (e.g. only suggest --resize if sizes differ).
    kind: str = "corrupt"  # "corrupt" | "size" | "mode" | "depth" | "bomb" | "layout"


def bad_files_message(
    *,
    where: str,
    bad: list[BadFile],
    total_files: int,
    full_list_path: Path | None = None,
) -> str:
    """The strict-mode report: how many of how many, every path (up to a cap), then the fix.

    `full_list_path`, when given, is a file that already holds every line, for when there are more
    than MAX_LISTED_BAD_FILES.
    """
    all_bad = len(bad) == total_files
    head = (
        f"all {total_files:,} image files in {where} are bad:"
        if all_bad
        else f"{len(bad):,} of {total_files:,} image files in {where} are bad:"
    )
    lines = [head]
    lines += [f"  {b.path}: {b.reason}" for b in bad[:MAX_LISTED_BAD_FILES]]
    if len(bad) > MAX_LISTED_BAD_FILES:
        rest = len(bad) - MAX_LISTED_BAD_FILES
        counts = collections.Counter(b.kind for b in bad)
        by_kind = ", ".join(f"{n:,} {k}" for k, n in counts.most_common())
        where_full = f"; the full list is in {full_list_path}" if full_list_path else ""
        lines.append(f"  ... and {rest:,} more (by kind: {by_kind}){where_full}")

    kinds = {b.kind for b in bad}
    fixes = ["remove or repair them"]
    if "size" in kinds:
        fixes.append("pass --resize N (resize=N) to bring mixed sizes to one")
    if "mode" in kinds:
        fixes.append("pass --image-mode L or RGB (image_mode=...) to convert mixed or unusual modes")
    if "depth" in kinds:
        # --image-mode cannot help here: the reader refuses 16-bit and float pixels before any conversion, as
        # scaling them to 8 bits is a choice (which range is black and white) the user has to make
        fixes.append("save the 16-bit/float images as 8-bit ones (--image-mode does not convert them), e.g. a "
                     "16-bit grey PNG with Pillow: Image.fromarray((np.asarray(Image.open(p)) >> 8)"
                     ".astype(np.uint8)).save(p), or with ImageMagick: mogrify -depth 8 FILE.png")
    if "bomb" in kinds:
        fixes.append("downscale the huge images, or if they are genuine raise the limit from Python: "
                     "fastddpm.data.prepare(SOURCE, max_image_pixels=N)")
    if all_bad:
        lines.append("Fix: " + ", ".join(fixes) + ". (--skip-bad cannot help: nothing would be left.)")
    else:
        fixes.append("or pass --skip-bad (skip_bad=True) to skip them")
        lines.append("Fix: " + ", ".join(fixes) + ".")
    return "\n".join(lines)
