"""The options of `prepare`/`info`, validated once, and the part of them that keys the cache."""

from __future__ import annotations

from dataclasses import dataclass

from fastddpm.data.errors import DataError

RESIZE_MODES = ("center-crop", "stretch")
IMAGE_MODES = ("L", "RGB")  # what a DDPM trains on: 1 or 3 channels of uint8

# Every spelling of a split that people's folders and files use, mapped to one canonical name.
# "t10k" is what the MNIST/Fashion-MNIST files call their test split.
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "test": "test",
    "t10k": "test",
    "testing": "test",
    "val": "val",
    "valid": "val",
    "validation": "val",
}
SPLITS = ("train", "test", "val")


def canonical_split(split: str) -> str:
    """'t10k' -> 'test' etc.; a DataError naming the accepted spellings otherwise."""
    try:
        return SPLIT_ALIASES[str(split).lower()]
    except KeyError:
        raise DataError(
            f"unknown split {split!r}: use one of {', '.join(SPLITS)} "
            f"(aliases: {', '.join(k for k in SPLIT_ALIASES if k not in SPLITS)})"
        ) from None


@dataclass(kw_only=True, frozen=True)
class PrepareOptions:
    """How to turn a source into the uint8 cache. Fields that change pixels are part of the cache key."""

    # Which split to read where the source has several (IDX, CIFAR, split folders, Keras-style npz).
    split: str = "train"
    # Side length S of the square output; None keeps the source size (then all images must match).
    resize: int | None = None
    # "center-crop": scale the short side to S, crop the centre SxS (keeps aspect ratio);
    # "stretch": resize straight to SxS (distorts non-square images).
    resize_mode: str = "center-crop"
    # "L" or "RGB" converts every image (from L, LA, P, RGB, RGBA, CMYK, 1-bit); None keeps L/RGB as
    # they are and reports any other mode (or a minority mode) as a bad file.
    image_mode: str | None = None
    # False: any bad file stops prepare with the full list. True: skip them, record them in meta.json.
    skip_bad: bool = False
    # Images whose header claims more pixels than this are refused before decoding (decompression
    # bombs: a 50 KB PNG can claim 100k x 100k and ask for 10 GB of RAM).
    max_image_pixels: int = 2**26

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", canonical_split(self.split))
        if self.resize is not None:
            if isinstance(self.resize, bool) or not isinstance(self.resize, int) or self.resize < 1:
                raise DataError(f"resize={self.resize!r}: pass a positive integer side length, e.g. --resize 32")
        if self.resize_mode not in RESIZE_MODES:
            raise DataError(f"resize_mode={self.resize_mode!r}: use one of {', '.join(RESIZE_MODES)}")
        if self.image_mode is not None and self.image_mode not in IMAGE_MODES:
            hint = " (RGBA/CMYK/P sources are converted *from*; the output is L or RGB)" if self.image_mode in (
                "RGBA", "CMYK", "P", "LA") else ""
            raise DataError(f"image_mode={self.image_mode!r}: use L or RGB{hint}")
        if not isinstance(self.max_image_pixels, int) or self.max_image_pixels < 1:
            raise DataError(f"max_image_pixels={self.max_image_pixels!r}: pass a positive integer")

    def transform_key(self) -> dict:
        """The options that change the pixels, normalised so equivalent requests share one cache."""
        return {
            "resize": self.resize,
            # Without a resize the mode is irrelevant; don't let it split the cache in two.
            "resize_mode": self.resize_mode if self.resize is not None else None,
            "image_mode": self.image_mode,
        }
