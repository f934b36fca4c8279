"""Safe decoding of one image file: header checks before any pixel is decoded, then a full decode.

Two steps, because they catch different faults at different costs:
  probe_image   reads only the header (a few hundred bytes): unreadable/empty/non-image files,
                decompression bombs, 16-bit data, and the size/mode used to find the majority.
  decode_image  forces a full decode (`im.load()`), which is the only way to find truncated files:
                Pillow opens a PNG cut in half without complaint and fails only when pixels are read.
Both raise `BadImage(reason)`; the caller collects them so the user sees every bad path at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import IO, Callable

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
# Modes that `image_mode` can convert from with Pillow's own, well-defined conversions
# (alpha is dropped, palettes are expanded, CMYK uses Pillow's naive inversion).
CONVERTIBLE_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK"})
# Pillow's convert() clips these to 0..255 instead of rescaling, which silently destroys the image,
# so we refuse them rather than guess the range.
HIGH_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I", "F"})

OpenFn = Callable[[], IO[bytes]]  # returns a fresh binary stream positioned at the image's first byte


class BadImage(Exception):
    """This file cannot become a training image; `reason` is shown to the user next to its path."""

    def __init__(self, reason: str, kind: str = "corrupt") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind  # see errors.BadFile.kind


@dataclass(kw_only=True, frozen=True)
class Probe:
    """What an image's header says, without decoding it."""

    width: int
    height: int
    mode: str


@dataclass(kw_only=True, frozen=True)
class Target:
    """What every decoded image must become: the shape of one row of the cache."""

    image_mode: str | None  # convert to this, or None: the image must already be `expected_mode`
    expected_mode: str  # "L" or "RGB": the mode of the output
    expected_size: tuple[int, int] | None  # (width, height) every source image must have; None with resize
    resize: int | None
    resize_mode: str
    max_pixels: int

    @property
    def channels(self) -> int:
        return 1 if self.expected_mode == "L" else 3


def _stream(open_fn: OpenFn) -> IO[bytes]:
    """open_fn() with read failures (permissions, broken symlinks, corrupt or encrypted zip members) as BadImage."""
    try:
        return open_fn()
    except BadImage:
        raise
    except Exception as e:  # OSError; zip members add BadZipFile (bad CRC), RuntimeError (encrypted), zlib.error
        raise BadImage(f"cannot read the file ({type(e).__name__}: {e})") from None


def _open(stream: IO[bytes], *, max_pixels: int) -> Image.Image:
    """Image.open with every way it fails on bad bytes turned into BadImage."""
    try:
        im = Image.open(stream)
    except Image.DecompressionBombError as e:
        # Pillow's own guard (2x its MAX_IMAGE_PIXELS); only reachable when max_pixels is above it.
        raise BadImage(f"refused as a possible decompression bomb ({e})", "bomb") from None
    except Image.UnidentifiedImageError:
        raise BadImage("not an image (Pillow cannot identify the format)") from None
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, struct.error... on bad headers
        raise BadImage(f"truncated or corrupt image header ({type(e).__name__}: {e})") from None
    pixels = im.width * im.height
    if pixels > max_pixels:
        im.close()
        raise BadImage(
            f"header claims {im.width:,}x{im.height:,} = {pixels:,} pixels, over the limit of {max_pixels:,}; "
            "refused before decoding as a possible decompression bomb",
            "bomb",
        )
    return im


def probe_image(open_fn: OpenFn, *, size_bytes: int, max_pixels: int) -> Probe:
    """Read the header only. Raises BadImage for empty, non-image, bomb and 16-bit/float files."""
    if size_bytes == 0:
        raise BadImage("empty file (0 bytes)")
    with _stream(open_fn) as stream, warnings.catch_warnings():
        # Pillow warns (DecompressionBombWarning) for images between its limit and 2x; we make our
        # own, stricter decision just below, so the warning would only be noise.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with _open(stream, max_pixels=max_pixels) as im:
            if im.mode in HIGH_BIT_MODES:
                raise BadImage(f"16-bit/float image (mode {im.mode}): convert it to 8-bit first", "depth")
            width, height = _upright_size(im, _orientation(im))
            return Probe(width=width, height=height, mode=im.mode)


_EXIF_ORIENTATION = 0x0112  # 1 = upright; 5-8 turn the stored pixels by 90 degrees (width and height swap)
# what shows each orientation upright (EXIF 2.32, as Pillow's ImageOps.exif_transpose)
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}


def _orientation(im: Image.Image) -> int:
    """The EXIF orientation in the header the file was opened with (im.info["exif"]: a JPEG's APP1, a PNG's eXIf
    chunk before its pixels). Not im.getexif(): on a PNG without EXIF it decodes the whole image to look after the
    pixels, which made the header pass decode every file. The same header answer in both passes keeps the probe's
    size and the decoded image's in agreement."""
    raw = im.info.get("exif")
    if not raw:
        return 1
    try:
        exif = Image.Exif()
        exif.load(raw)
        orientation = int(exif.get(_EXIF_ORIENTATION, 1))
    except Exception:  # a malformed EXIF block: the pixels as stored, as a viewer that cannot read it shows them
        return 1
    return orientation if orientation in _UPRIGHT else 1


def _upright_size(im: Image.Image, orientation: int) -> tuple[int, int]:
    """(width, height) as shown: orientations 5-8 turn the stored pixels by 90 degrees."""
    return (im.height, im.width) if orientation in (5, 6, 7, 8) else im.size



def decode_image(open_fn: OpenFn, *, target: Target) -> np.ndarray:
    """Fully decode one image into a uint8 (C, H, W) array of the target's shape, or raise BadImage."""
    with _stream(open_fn) as stream:
        with _open(stream, max_pixels=target.max_pixels) as im:
            # Re-check what the probe saw: the file may have changed between the passes, and a wrong
            # shape here would corrupt the fixed-shape cache instead of being reported.
            if target.image_mode is None and im.mode != target.expected_mode:
                raise BadImage(f"mode {im.mode}, but the other images are {target.expected_mode}", "mode")
            if target.image_mode is not None and im.mode not in CONVERTIBLE_MODES:
                raise BadImage(f"mode {im.mode} cannot be converted to {target.image_mode}", "mode")
            orientation = _orientation(im)  # from the header, before the decode, as the probe read it
            upright = _upright_size(im, orientation)
            if target.expected_size is not None and upright != target.expected_size:
                w, h = target.expected_size
                raise BadImage(f"size {upright[0]}x{upright[1]}, but the other images are {w}x{h}", "size")
            try:
                im.load()  # the full decode: the only step that notices truncated pixel data
            except Image.DecompressionBombError as e:
                raise BadImage(f"refused as a possible decompression bomb ({e})", "bomb") from None
            except Exception as e:  # truncation shows up as OSError, SyntaxError, zlib.error, EOFError...
                raise BadImage(f"truncated or corrupt image data ({type(e).__name__}: {e})") from None
            if orientation != 1:  # upright, as every viewer shows it (a phone's photo is stored sideways)
                im = im.transpose(_UPRIGHT[orientation])
            return finish_image(im, image_mode=target.image_mode, resize=target.resize,
                                resize_mode=target.resize_mode)


def finish_image(im: Image.Image, *, image_mode: str | None, resize: int | None, resize_mode: str) -> np.ndarray:
    """Convert mode, then resize/crop, then lay out as uint8 (C, H, W).

    Mode first so that palette and 1-bit images are resampled as real intensities, not as indices.
    """
    if image_mode is not None and im.mode != image_mode:
        im = im.convert(image_mode)
    if resize is not None and im.size != (resize, resize):
        im = resize_square(im, side=resize, resize_mode=resize_mode)
    hw_or_hwc = np.asarray(im, dtype=np.uint8)
    if hw_or_hwc.ndim == 2:
        return hw_or_hwc[None]  # (1, H, W)
    return np.ascontiguousarray(hw_or_hwc.transpose(2, 0, 1))  # (H, W, C) -> (C, H, W)


def resize_square(im: Image.Image, *, side: int, resize_mode: str) -> Image.Image:
    """Make a side x side image: 'center-crop' keeps the aspect ratio, 'stretch' does not.

    Center-crop is done as one resample of the central square (Pillow's `box=`), which is the same
    as "scale the short side to `side`, crop the centre" without resampling pixels we then discard.
    """
    w, h = im.size
    if resize_mode == "center-crop":
        square = min(w, h)
        left, top = (w - square) // 2, (h - square) // 2
        box = (left, top, left + square, top + square)
    else:
        box = (0, 0, w, h)
    box_w, box_h = box[2] - box[0], box[3] - box[1]
    if (box_w, box_h) == (side, side):
        return im.crop(box)  # pure crop: keep the source pixels exactly
    # LANCZOS antialiases when shrinking (no moire on fine textures); BICUBIC is the usual choice
    # for enlarging, where LANCZOS only adds ringing.
    resample = Image.Resampling.LANCZOS if max(box_w, box_h) > side else Image.Resampling.BICUBIC
    return im.resize((side, side), resample=resample, box=box)


def array_to_image(chw: np.ndarray) -> Image.Image:
    """A uint8 (C, H, W) array with C in {1, 3, 4} as a Pillow image, so arrays share finish_image."""
    if chw.shape[0] == 1:
        return Image.fromarray(chw[0])
    return Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0)))
