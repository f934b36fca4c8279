"""`fastddpm data prepare|info SOURCE`: the command-line face of fastddpm.data.

The top-level CLI calls `add_data_parser(subparsers)` and, for `data`, `run_data(args)`.
`python -m fastddpm.data.cli ...` runs the same thing standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastddpm.config import positive_int
from fastddpm.data.errors import DataError
from fastddpm.data.named import NAMED_DATASETS
from fastddpm.data.prepare import info, prepare
from fastddpm.data.summary import describe

_DATA_DESCRIPTION = f"""\
Decode a dataset once into a uint8 cache (images.npy, labels.npy, meta.json) that training
memory-maps: no PNG is decoded twice, no per-file I/O during training.

SOURCE is a named dataset ({', '.join(NAMED_DATASETS)}; found locally or downloaded and
md5-checked) or a path to:
  - an MNIST-style folder of IDX files (train-images-idx3-ubyte[.gz], ...), or one IDX images file
  - an image folder ROOT/<label>/*.png|jpg|jpeg|bmp|webp (labels from folder names), or images
    directly in ROOT (unlabeled); train/ and test/ split folders are picked with --split
  - a .zip of such a folder, read in place (never extracted)
  - cifar-10-batches-py/ or cifar-10-python.tar.gz (read in place)
  - a uint8 .npy (N,H,W | N,H,W,C | N,C,H,W) or .npz (images/x/arr_0 [+ labels/y])
To use a local folder called like a named dataset, write it as a path: ./mnist
"""

_PREPARE_EPILOG = """\
examples:
  fastddpm data prepare fashion-mnist
  fastddpm data prepare cifar10 --split test
  fastddpm data prepare ~/data/mnist_png.zip --split test
  fastddpm data prepare ~/data/faces --resize 64 --image-mode RGB --skip-bad
  fastddpm data prepare ~/data/faces --resize 64 --resize-mode stretch --rebuild

Bad files (empty, truncated, not an image, decompression bombs, a minority size or mode) are all
listed with the fix; --skip-bad skips them instead and records them in meta.json.
The cache lives in $FASTDDPM_CACHE (default ~/.cache/fastddpm) unless --cache-dir is given.
"""

_INFO_EPILOG = """\
examples:
  fastddpm data info fashion-mnist
  fastddpm data info ~/data/faces --resize 64
Pass the same options as to `prepare`: they select which cache is described.
"""


_EXPORT_EPILOG = """\
examples:
  fastddpm data export-images fashion-mnist ~/data/fmnist_png
  fastddpm data export-images fashion-mnist ~/data/fmnist_png_test --split test --limit 1000
  fastddpm data export-images ~/data/faces ~/data/faces_png --resize 64 --image-mode RGB --skip-bad

Class folders take the source's class names where reading OUT back gives the same class ids (names that sort
in id order and are plain folder names); otherwise they are the integer labels 0..K-1.
"""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE", help="named dataset or path (see `fastddpm data --help`)")
    parser.add_argument("--split", default="train",
                        help="train (default) or test (alias t10k); val for split folders. Sources without "
                             "splits (a plain folder, .npy) accept only the default")
    _add_reading_options(parser)
    parser.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                        help="cache root (default: $FASTDDPM_CACHE or ~/.cache/fastddpm)")


def _add_reading_options(parser: argparse.ArgumentParser) -> None:
    """How the images are read: the same for prepare, info and export-images (their errors name these flags)."""
    parser.add_argument("--resize", type=positive_int, default=None, metavar="N",
                        help="make every image NxN (default: keep the source size; all images must match)")
    parser.add_argument("--resize-mode", choices=("center-crop", "stretch"), default="center-crop",
                        help="center-crop (default): scale the short side to N, crop the centre; "
                             "stretch: resize straight to NxN")
    parser.add_argument("--image-mode", choices=("L", "RGB"), default=None,
                        help="convert every image to L (grey) or RGB, from L/LA/P/RGB/RGBA/CMYK; alpha is "
                             "dropped (default: keep L/RGB as is; anything else is reported)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip unreadable/mismatched files (recorded in meta.json) instead of stopping")


def add_data_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `data {prepare,info}` to a top-level CLI's subparsers; returns the `data` parser."""
    data = subparsers.add_parser("data", help="prepare a dataset (decode once into a uint8 cache) or describe it",
                                 description=_DATA_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = data.add_subparsers(dest="data_command", metavar="{prepare,info,export-images}", required=True)
    prep = commands.add_parser("prepare", help="decode SOURCE into the cache (reused if already current)",
                               description="Decode SOURCE into the uint8 cache; a current cache is reused.",
                               epilog=_PREPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(prep)
    prep.add_argument("--rebuild", action="store_true", help="rebuild even if a current cache exists")
    inf = commands.add_parser("info", help="describe SOURCE and its cache without building anything",
                              description="Describe SOURCE and its prepared cache. Never decodes or downloads.",
                              epilog=_INFO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(inf)
    exp = commands.add_parser("export-images", help="write SOURCE as the seed's PNG folder OUT/<label>/<index>.png",
                              description="Write SOURCE (prepared first) as one PNG per image in the seed's folder "
                                          "layout OUT/<label>/<index>.png (unlabeled images go straight into OUT). "
                                          "`fastddpm data prepare OUT` reads it back pixel for pixel, ordered by "
                                          "(label, index). `fastddpm bench ladder` rung 0 reads this layout.",
                              epilog=_EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    exp.add_argument("source", metavar="SOURCE", help="named dataset or path (see `fastddpm data --help`)")
    exp.add_argument("out", metavar="OUT", type=Path,
                     help="output folder (created; must be empty or a previous export)")
    exp.add_argument("--split", default="train", help="train (default) or test")
    exp.add_argument("--limit", type=positive_int, default=None, metavar="N", help="export only the first N images")
    exp.add_argument("--overwrite", action="store_true", help="replace the PNGs of a previous, different export in OUT")
    _add_reading_options(exp)
    exp.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                     help="cache root (default: $FASTDDPM_CACHE or ~/.cache/fastddpm)")
    data.set_defaults(func=run_data)
    return data


def run_data(args: argparse.Namespace) -> int:
    """Run `data prepare` / `data info` / `data export-images`; a DataError becomes `error: ...` on stderr and
    exit code 2."""
    if args.data_command == "export-images":
        from fastddpm.data.export import export_source

        try:
            result = export_source(args.source, args.out, split=args.split, limit=args.limit,
                                   overwrite=args.overwrite, cache_dir=args.cache_dir, resize=args.resize,
                                   resize_mode=args.resize_mode, image_mode=args.image_mode,
                                   skip_bad=args.skip_bad)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        verb = "already exported" if result.reused else "wrote"
        print(f"{verb} {result.num_images:,} PNGs under {result.root}")
        return 0
    options = dict(split=args.split, resize=args.resize, resize_mode=args.resize_mode, image_mode=args.image_mode,
                   skip_bad=args.skip_bad, cache_dir=args.cache_dir)
    try:
        if args.data_command == "prepare":
            print(describe(prepare(args.source, rebuild=args.rebuild, **options)))
        else:
            print(info(args.source, **options))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastddpm")
    add_data_parser(parser.add_subparsers(dest="command", required=True))
    return run_data(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
