"""Image grids and uint8 image files with Pillow and numpy (no torchvision)."""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
from PIL import Image


def make_grid(images_NCHW: np.ndarray, *, nrow: int | None = None, padding: int = 2, pad_value: int = 0) -> np.ndarray:
    """(N, C, H, W) uint8 -> one (H', W', C) uint8 grid, nrow images per row (default: square-ish)."""
    images_NCHW = np.asarray(images_NCHW)
    if images_NCHW.dtype != np.uint8 or images_NCHW.ndim != 4:
        raise ValueError(f"make_grid wants uint8 (N, C, H, W), got {images_NCHW.dtype} {images_NCHW.shape}")
    n, c, h, w = images_NCHW.shape
    nrow = nrow or max(1, math.ceil(math.sqrt(n)))
    ncol = math.ceil(n / nrow)
    grid = np.full((padding + ncol * (h + padding), padding + nrow * (w + padding), c), pad_value, np.uint8)
    for i in range(n):
        r, k = divmod(i, nrow)
        y, x = padding + r * (h + padding), padding + k * (w + padding)
        grid[y:y + h, x:x + w] = images_NCHW[i].transpose(1, 2, 0)
    return grid


def save_png(array_HWC: np.ndarray, path: str | Path) -> Path:
    """Write an (H, W, C) uint8 array as PNG, atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "L" if array_HWC.shape[2] == 1 else "RGB"
    img = Image.fromarray(array_HWC[:, :, 0] if mode == "L" else array_HWC, mode=mode)
    tmp = path.with_name(f".{path.name}.tmp")
    img.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def save_grid(images_NCHW: np.ndarray, path: str | Path, *, nrow: int | None = None, scale: int = 1,
              row_labels: list[str] | None = None) -> Path:
    """Save a grid PNG; `scale` enlarges it with nearest-neighbour so 28x28 samples are easy to see.
    `row_labels`: a name written left of each row (a conditional model's grid: one row per class)."""
    grid = make_grid(images_NCHW, nrow=nrow)
    if scale > 1:
        grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    if row_labels:
        h = images_NCHW.shape[2]
        grid = label_rows(grid, row_labels, row_pitch=(h + 2) * scale, first_row=2 * scale)
    return save_png(grid, path)


def label_rows(grid_HWC: np.ndarray, labels: list[str], *, row_pitch: int, first_row: int) -> np.ndarray:
    """The grid with a white strip on its left holding one label per row, vertically centred on the row."""
    from PIL import ImageDraw, ImageFont

    size = max(10, min(20, row_pitch // 3))
    font = ImageFont.load_default(size=size)
    if not all(text.isascii() for text in labels):
        # Pillow's default font (Aileron) has no accented letters: "Ünïcode" came out as boxes
        found = label_font_file(frozenset("".join(labels)) - frozenset(" "))
        if found is not None:
            font = ImageFont.truetype(found, size)
    measure = ImageDraw.Draw(Image.new("L", (1, 1)))
    width = 8 + max(int(measure.textlength(text, font=font)) for text in labels)
    h, w, c = grid_HWC.shape
    strip = Image.new("L", (width, h), 255)
    draw = ImageDraw.Draw(strip)
    for r, text in enumerate(labels):
        draw.text((4, first_row + r * row_pitch + row_pitch // 2), text, fill=0, font=font, anchor="lm")
    strip_HWC = np.asarray(strip)[:, :, None].repeat(c, axis=2)
    return np.concatenate([strip_HWC, grid_HWC], axis=1)


# where macOS and Windows keep fonts with CJK glyphs (DejaVu has none), for machines without fontconfig
KNOWN_FONT_FILES = ("/System/Library/Fonts/PingFang.ttc", "/System/Library/Fonts/Hiragino Sans GB.ttc",
                    "/System/Library/Fonts/AppleSDGothicNeo.ttc", "/Library/Fonts/Arial Unicode.ttf",
                    "C:/Windows/Fonts/msyh.ttc", "C:/Windows/Fonts/YuGothM.ttc", "C:/Windows/Fonts/malgun.ttf")


@functools.lru_cache(maxsize=16)
def label_font_file(chars: frozenset[str]) -> str | None:
    """A font file with a glyph for every character of `chars` (class names): matplotlib's DejaVu Sans (a
    dependency's; Latin, Greek, Cyrillic), else one fontconfig lists as having them all (`fc-list :charset=...`,
    sans-serif first: Noto Sans CJK where installed), else one of KNOWN_FONT_FILES that has them. None, with a
    warning that names the missing characters and the fix, where no font here has them: the labels are then drawn
    in DejaVu Sans, those characters as boxes."""
    import matplotlib

    dejavu = str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")
    if _has_glyphs(dejavu, chars):
        return dejavu
    fc_list = shutil.which("fc-list")
    listed = []
    if fc_list is not None:
        charset = " ".join(f"{ord(ch):x}" for ch in sorted(chars))
        try:
            out = subprocess.run([fc_list, f":charset={charset}", "file"], capture_output=True, text=True,
                                 timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        listed = sorted((line.rsplit(":", 1)[0].strip() for line in out.splitlines() if line.strip()),
                        key=lambda f: ("Sans" not in Path(f).name, "Bold" in Path(f).name, f))
    for path in (*listed, *KNOWN_FONT_FILES):
        if _has_glyphs(path, chars):
            return path
    missing = "".join(sorted(ch for ch in chars if not _has_glyphs(dejavu, frozenset(ch))))
    warnings.warn(f"no font on this machine has the characters {missing!r} of the class names: the grid's labels "
                  "show them as boxes; install a font that has them (CJK: fonts-noto-cjk on Debian/Ubuntu, "
                  "google-noto-sans-cjk-fonts on Fedora)", stacklevel=3)
    return dejavu if Path(dejavu).is_file() else None


def _has_glyphs(path: str, chars: frozenset[str]) -> bool:
    """Whether the font file (the first font of a .ttc collection) maps every character of `chars`."""
    from fontTools.ttLib import TTFont

    try:
        with TTFont(path, fontNumber=0, lazy=True) as font:
            cmap = font.getBestCmap() or {}
    except Exception:  # noqa: BLE001 - missing, unreadable or not a font: not this one
        return False
    return all(ord(ch) in cmap for ch in chars)
