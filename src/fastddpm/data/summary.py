"""Human-readable summaries: of a prepared dataset (`describe`) and of a source not prepared yet."""

from __future__ import annotations

import gzip
import shlex
import struct
import zipfile
from pathlib import Path

import numpy as np

from fastddpm.data import arrays, named
from fastddpm.data.cache import PreparedData
from fastddpm.data.errors import MAX_LISTED_BAD_FILES
from fastddpm.data.imagefolder import (image_less_folders_note, member_path, open_zip, plan_layout,
                                       unread_images_note, zip_image_members)
from fastddpm.data.options import PrepareOptions
from fastddpm.data.sources import Source

_LABEL_WIDTH = 13


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def _transform_text(transform: dict) -> str:
    parts = []
    if transform.get("resize"):
        parts.append(f"resize to {transform['resize']}x{transform['resize']} ({transform['resize_mode']})")
    if transform.get("image_mode"):
        parts.append(f"convert to {transform['image_mode']}")
    return ", ".join(parts) or "none (pixels as in the source)"


def describe(prepared: PreparedData) -> str:
    """The summary of a prepared dataset: size, shape, classes, where it lives, what was skipped."""
    meta = prepared.meta
    split = f", {meta['split']} split" if meta.get("split") else ""
    disk_bytes = sum(f.stat().st_size for f in prepared.cache_path.iterdir() if f.is_file())
    lines = [
        f"{meta['source']}{split}: {prepared.num_images:,} images, "
        f"{prepared.channels}x{prepared.height}x{prepared.width} uint8 (C x H x W)",
        f"  source:      {meta['kind']}  {meta['source_path']}",
        f"  transform:   {_transform_text(meta['transform'])}",
    ]
    if meta["labeled"]:
        lines.append(f"  classes:     {len(prepared.class_names)}")
        width = max([_LABEL_WIDTH, *(len(n) for n in prepared.class_names)])
        for label, name in enumerate(prepared.class_names):
            lines.append(f"    {label:>3}  {name:<{width}} {meta['class_counts'][name]:>10,}")
        unlabeled = prepared.num_images - sum(meta["class_counts"].values())
        if unlabeled:
            lines.append(f"    {'-1':>3}  {'(unlabeled)':<{width}} {unlabeled:>10,}")
    else:
        lines.append("  classes:     none (unlabeled: labels are -1)")
    lines += [
        f"  cache:       {prepared.cache_path}  ({_mib(disk_bytes)} on disk)",
        f"  fingerprint: {meta['fingerprint']}",
        f"  built:       {meta['created']} in {meta['build_seconds']:.1f} s",
    ]
    skipped = meta["skipped"]
    if not skipped:
        lines.append("  skipped:     none")
    else:
        lines.append(f"  skipped:     {len(skipped):,} of {meta['total_files']:,} files (prepared with --skip-bad):")
        lines += [f"    {s['path']}: {s['reason']}" for s in skipped[:MAX_LISTED_BAD_FILES]]
        if len(skipped) > MAX_LISTED_BAD_FILES:
            lines.append(f"    ... and {len(skipped) - MAX_LISTED_BAD_FILES:,} more (all in meta.json)")
    lines += [f"  note:        {n}" for n in meta.get("notes", [])]
    return "\n".join(lines)


def prepare_command(display: str, options: PrepareOptions, cache_dir: Path | None) -> str:
    """The exact `fastddpm data prepare` line that builds the cache `info` looked for."""
    args = ["fastddpm", "data", "prepare", display]
    if options.split != "train":
        args += ["--split", options.split]
    if options.resize is not None:
        args += ["--resize", str(options.resize)]
        if options.resize_mode != "center-crop":
            args += ["--resize-mode", options.resize_mode]
    if options.image_mode:
        args += ["--image-mode", options.image_mode]
    if options.skip_bad:
        args.append("--skip-bad")
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    return shlex.join(args)


def _idx_count(path: Path) -> str:
    """'60,000 images of 28x28' from the 16-byte header, without reading the rest."""
    with open(path, "rb") as raw:
        is_gzip = raw.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if is_gzip else open(path, "rb")) as f:
        header = f.read(16)
    if len(header) < 16:
        return "unreadable header"
    _, n, h, w = struct.unpack(">4I", header)
    return f"{n:,} images of {h}x{w}"


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    return tuple(array.shape), array.dtype


def _npz_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of each array in an .npz, read from the member headers only."""
    headers = {}
    with zipfile.ZipFile(path) as zf:
        for member in zf.namelist():
            with zf.open(member) as f:
                version = np.lib.format.read_magic(f)
                shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0(f))
            headers[member.removesuffix(".npy")] = (tuple(shape), dtype)
    return headers


def _array_lines(src: Source) -> list[str]:
    """An .npy's or .npz's arrays, and what `data prepare` will refuse in its images' dtype, in its own words."""
    if src.kind == "npy":
        shape, dtype = _npy_header(src.path)
        lines, problem = [f"  array shape {shape}, {dtype}"], arrays.dtype_problem(dtype, source=str(src.path))
    else:
        headers = _npz_headers(src.path)
        lines = [f"  arrays: {', '.join(f'{k} {shape} {dtype}' for k, (shape, dtype) in headers.items())}"]
        key = arrays.image_key(list(headers), src.split or "train")
        problem = None if key is None else arrays.dtype_problem(headers[key][1], source=f"{src.path}[{key}]")
    return lines + ([f"  PROBLEM: `data prepare` will stop here: {problem}"] if problem else [])


def _layout_notes(layout, others: list[str], *, skip_bad: bool) -> list[str]:
    """What `data prepare` would stop on (or skip), or leave out, in an image folder or zip: said before it builds."""
    lines = []
    if layout.stray:
        fate = ("--skip-bad skips them" if skip_bad else "`data prepare` stops on them (move them into a "
                "class folder or delete them, or pass --skip-bad)")
        lines.append(f"  note: {len(layout.stray):,} image(s) beside the class folders have no label, e.g. "
                     f"{', '.join(layout.stray[:3])}: {fate}")
    return lines + [f"  note: {n}" for n in unread_images_note(others) + image_less_folders_note(others, layout)]


def describe_source(src: Source, cache_root: Path, *, skip_bad: bool = False) -> list[str]:
    """What the source is, from names and headers only (no decoding); `skip_bad`: the build asked for skips bad
    files instead of stopping on them."""
    split = f", {src.split} split" if src.split else ""
    if src.path is None:
        ds = named.DATASETS[src.name]
        files = ", ".join(ds.files_for(src.split or "train"))
        return [f"{src.name}{split}: named dataset, not downloaded yet",
                f"  prepare downloads {files} from {named.mirrors(ds)[0]}",
                f"  into {named.download_dir(cache_root, ds.name)} (looked for a local copy in: "
                + ", ".join(str(d) for d in named.search_dirs(ds, cache_root)) + ")"]
    lines = [f"{src.display}{split}: {src.label} at {src.path}"]
    if src.kind == "image-folder":
        layout = plan_layout([s.rel for s in src.tree], split=src.split or "train", where=str(src.path),
                             strip_top=False)
        classes = (f"{len(layout.class_names)} class folders ({', '.join(layout.class_names[:10])}"
                   f"{', ...' if len(layout.class_names) > 10 else ''})" if layout.labeled else "no class folders")
        lines.append(f"  {len(layout.items):,} image files, {classes}, {_mib(sum(s.size for s in src.tree))}")
        lines += _layout_notes(layout, list(src.others), skip_bad=skip_bad)
    elif src.kind == "zip":
        with open_zip(src.path) as zf:
            members, others = zip_image_members(zf)
        lines.append(f"  {len(members):,} image members, {_mib(src.path.stat().st_size)} zip")
        layout = plan_layout([member_path(m) for m in members], split=src.split or "train", where=str(src.path),
                             strip_top=True)
        lines += _layout_notes(layout, others, skip_bad=skip_bad)
    elif src.kind == "idx":
        lines += [f"  {f.name}: {_idx_count(f) if 'idx3' in f.name else 'labels'}" for f in src.files]
    elif src.kind in ("npy", "npz"):
        lines += _array_lines(src)
    else:
        lines += [f"  {f.name} ({_mib(f.stat().st_size)})" for f in src.files]
        if src.label != src.kind:  # a tar not named as CIFAR-10's: said before prepare opens it
            lines.append(f"  note: a tar is read only as CIFAR-10's python archive ({named.CIFAR10_ARCHIVE}, "
                         "with cifar-10-batches-py/ inside); for your own images use a folder or a .zip")
    return lines
