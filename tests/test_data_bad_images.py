"""RELIABILITY promise 11/12 for images: every bad path listed with the fix; skip mode counts them and
keeps one shape; decompression bombs refused before decoding; never a half-built cache."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from data_fixtures import (
    cache_dir,  # noqa: F401  (fixture)
    encode,
    huge_header_png,
    leftovers,
    rng_images,
    save_image,
    truncated,
)
from fastddpm.data import DataError, prepare


def _good(root: Path, n: int = 6, size: int = 12, seed: int = 0) -> np.ndarray:
    """n good grey PNGs in root/0/ named g0.png..; returns them (n, size, size)."""
    images = rng_images(n, size, size, seed=seed)
    for i, im in enumerate(images):
        save_image(root / "0" / f"g{i}.png", im)
    return images


def _plant_every_fault(root: Path) -> dict[str, str]:
    """One file per fault kind; returns {relative path: a word the reason must contain}."""
    grey = rng_images(1, 12, 12, seed=9)[0]
    rgb = rng_images(1, 12, 12, c=3, seed=9)[0]
    faults = {
        "0/empty.png": (b"", "empty file"),
        "0/half.png": (truncated(encode(grey, "PNG")), "truncated"),
        "0/half.jpg": (truncated(encode(grey, "JPEG")), "truncated"),  # cut inside the header
        "0/tail.jpg": (encode(grey, "JPEG", quality=95)[:-40], "truncated or corrupt image data"),
        "0/notes.png": (b"this is text with an image extension\n" * 20, "not an image"),
        "0/big.png": (encode(rng_images(1, 20, 20)[0], "PNG"), "size 20x20"),
        "0/color.png": (encode(rgb, "PNG"), "mode RGB"),
        "0/alpha.png": (encode(np.dstack([rgb, rgb[..., :1]]), "PNG"), "mode RGBA"),
        "0/print.jpg": (_cmyk_jpeg(12), "mode CMYK"),
        "0/deep.png": (encode((grey.astype(np.uint16) * 257), "PNG"), "16-bit/float"),
    }
    for rel, (data, _) in faults.items():
        (root / rel).write_bytes(data)
    return {rel: word for rel, (_, word) in faults.items()}


def _cmyk_jpeg(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("CMYK", (size, size), (10, 20, 30, 40)).save(buf, format="JPEG")
    return buf.getvalue()


def test_strict_mode_lists_every_bad_path_and_the_fix(tmp_path: Path, cache_dir: Path) -> None:
    _good(tmp_path / "root")
    faults = _plant_every_fault(tmp_path / "root")
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert f"{len(faults)} of {len(faults) + 6} image files in {tmp_path / 'root'} are bad" in message
    for rel, word in faults.items():
        line = next((line for line in message.splitlines() if line.strip().startswith(rel + ":")), None)
        assert line is not None, f"{rel} missing from:\n{message}"
        assert word in line, f"{rel}: expected {word!r} in {line!r}"
    fix = message.splitlines()[-1]
    assert fix.startswith("Fix:") and "--resize" in fix and "--image-mode" in fix and "--skip-bad" in fix
    assert leftovers(cache_dir) == []


def test_skip_bad_skips_counts_and_keeps_one_shape(tmp_path: Path, cache_dir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    good = _good(tmp_path / "root")
    faults = _plant_every_fault(tmp_path / "root")
    data = prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    assert data.images.shape == (6, 1, 12, 12)
    np.testing.assert_array_equal(data.images[:, 0], good)
    assert sorted(s["path"] for s in data.meta["skipped"]) == sorted(faults)
    assert data.meta["total_files"] == 6 + len(faults)
    assert f"skipped {len(faults)} of {6 + len(faults)} files" in capsys.readouterr().err


def test_truncated_files_found_only_by_full_decode_shrink_the_cache(tmp_path: Path, cache_dir: Path) -> None:
    good = _good(tmp_path / "root", n=5)
    grey = rng_images(2, 12, 12, seed=4)
    (tmp_path / "root" / "0" / "g2_half.png").write_bytes(truncated(encode(grey[0], "PNG")))
    (tmp_path / "root" / "0" / "zz_half.jpg").write_bytes(truncated(encode(grey[1], "JPEG")))
    data = prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    # The header pass planned 7 rows; the decode pass found 2 truncated: the header is patched to 5.
    assert data.images.shape == (5, 1, 12, 12) and data.labels.shape == (5,)
    np.testing.assert_array_equal(data.images[:, 0], good)
    assert {s["path"] for s in data.meta["skipped"]} == {"0/g2_half.png", "0/zz_half.jpg"}


def test_all_files_bad_is_an_error_even_with_skip_bad(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "root" / "0").mkdir(parents=True)
    (tmp_path / "root" / "0" / "a.png").write_bytes(b"")
    (tmp_path / "root" / "0" / "b.jpg").write_bytes(b"GIF89a? no")
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert "all 2 image files" in message and "0/a.png" in message and "0/b.jpg" in message
    assert "nothing would be left" in message
    assert leftovers(cache_dir) == []


def test_image_mode_converts_l_p_rgba_cmyk_like_pillow(tmp_path: Path, cache_dir: Path) -> None:
    rgb = rng_images(1, 10, 10, c=3, seed=3)[0]
    sources = {
        "a_l.png": Image.fromarray(rgb[..., 0]),
        "b_p.png": Image.fromarray(rgb).convert("P"),
        "c_rgba.png": Image.fromarray(np.dstack([rgb, rgb[..., :1]])),
        "d_rgb.png": Image.fromarray(rgb),
        "e_1bit.png": Image.fromarray(rgb[..., 0]).convert("1"),
    }
    (tmp_path / "root" / "0").mkdir(parents=True)
    for name, im in sources.items():
        im.save(tmp_path / "root" / "0" / name)
    (tmp_path / "root" / "0" / "f_cmyk.jpg").write_bytes(_cmyk_jpeg(10))
    for mode in ("L", "RGB"):
        data = prepare(tmp_path / "root", image_mode=mode, cache_dir=cache_dir, progress=False)
        files = sorted((tmp_path / "root" / "0").iterdir())
        assert data.images.shape == (len(files), 1 if mode == "L" else 3, 10, 10)
        for row, path in enumerate(files):
            with Image.open(path) as im:
                expected = np.asarray(im.convert(mode))
            expected = expected[None] if mode == "L" else expected.transpose(2, 0, 1)
            np.testing.assert_array_equal(data.images[row], expected, err_msg=path.name)


def test_resize_resolves_mixed_sizes(tmp_path: Path, cache_dir: Path) -> None:
    save_image(tmp_path / "root" / "0" / "a.png", rng_images(1, 12, 12)[0])
    save_image(tmp_path / "root" / "0" / "b.png", rng_images(1, 30, 20)[0])
    with pytest.raises(DataError, match="size 20x30, but most images are 12x12|size 12x12, but most"):
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    data = prepare(tmp_path / "root", resize=8, cache_dir=cache_dir, progress=False)
    assert data.images.shape == (2, 1, 8, 8)


def test_decompression_bomb_is_refused_before_decoding(tmp_path: Path, cache_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _good(tmp_path / "root")
    bomb = huge_header_png(10_000, 10_000)  # ~12 KB file claiming 100 megapixels
    assert len(bomb) < 50_000
    (tmp_path / "root" / "0" / "bomb.png").write_bytes(bomb)
    loaded_sizes: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def spying_load(self: ImageFile.ImageFile) -> object:
        loaded_sizes.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spying_load)
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    line = next(line for line in str(err.value).splitlines() if "0/bomb.png" in line)
    assert "10,000x10,000" in line and "decompression bomb" in line
    assert (10_000, 10_000) not in loaded_sizes and (12, 12) in loaded_sizes
    data = prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    assert data.num_images == 6 and data.meta["skipped"][0]["path"] == "0/bomb.png"


def test_max_image_pixels_is_the_limit(tmp_path: Path, cache_dir: Path) -> None:
    _good(tmp_path / "root", size=12)
    with pytest.raises(DataError, match=r"12x12 = 144 pixels, over the limit of 100"):
        prepare(tmp_path / "root", max_image_pixels=100, cache_dir=cache_dir, progress=False)


def test_a_raised_limit_rebuilds_a_cache_that_skipped_images_over_the_old_one(tmp_path: Path,
                                                                              cache_dir: Path) -> None:
    """The limit is not part of the cache's key: a --skip-bad cache that skipped images as too large would be
    reused, still without them, after the limit was raised."""
    _good(tmp_path / "root", n=2, size=8)
    save_image(tmp_path / "root" / "0" / "big.png", rng_images(1, 12, 12)[0])
    small = prepare(tmp_path / "root", max_image_pixels=100, resize=8, skip_bad=True, cache_dir=cache_dir,
                    progress=False)
    assert small.num_images == 2 and small.meta["skipped"][0]["kind"] == "bomb"
    again = prepare(tmp_path / "root", max_image_pixels=100, resize=8, skip_bad=True, cache_dir=cache_dir,
                    progress=False)
    assert again.meta["created"] == small.meta["created"]  # the same limit: reused
    raised = prepare(tmp_path / "root", max_image_pixels=200, resize=8, skip_bad=True, cache_dir=cache_dir,
                     progress=False)
    assert raised.num_images == 3 and raised.meta["skipped"] == []


def test_more_than_fifty_bad_files_are_capped_with_a_full_list(tmp_path: Path, cache_dir: Path) -> None:
    _good(tmp_path / "root", n=2)
    for i in range(57):
        (tmp_path / "root" / "0" / f"empty{i:02d}.png").write_bytes(b"")
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    message = str(err.value)
    assert "57 of 59 image files" in message and "... and 7 more" in message
    full = next(word for word in message.split() if word.endswith(".bad-files.txt"))
    listed = Path(full).read_text().splitlines()
    assert len(listed) == 57 and all("empty file" in line for line in listed)
    assert sorted(line.split("\t")[0] for line in listed) == [f"0/empty{i:02d}.png" for i in range(57)]
    data = prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    assert data.num_images == 2 and not Path(full).exists()  # a stale bad list is removed on success


def test_stray_image_beside_class_folders_is_a_bad_file(tmp_path: Path, cache_dir: Path) -> None:
    _good(tmp_path / "root")
    save_image(tmp_path / "root" / "stray.png", rng_images(1, 12, 12)[0])
    with pytest.raises(DataError, match=r"stray\.png: image beside the class folders"):
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)


def test_strict_prepare_does_not_silently_reuse_a_skip_bad_cache(tmp_path: Path, cache_dir: Path) -> None:
    _good(tmp_path / "root")
    (tmp_path / "root" / "0" / "empty.png").write_bytes(b"")
    prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    with pytest.raises(DataError) as err:
        prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    assert "0/empty.png: empty file (0 bytes)" in str(err.value) and "--skip-bad" in str(err.value)


def test_bad_zip_members_are_listed_by_member_name(tmp_path: Path, cache_dir: Path) -> None:
    zip_path = tmp_path / "data.zip"
    good = rng_images(3, 8, 8)
    with zipfile.ZipFile(zip_path, "w") as zf:
        for i, im in enumerate(good):
            zf.writestr(f"set/cls/{i}.png", encode(im, "PNG"))
        zf.writestr("set/cls/zero.png", b"")
        zf.writestr("set/cls/cut.png", truncated(encode(good[0], "PNG")))
    with pytest.raises(DataError) as err:
        prepare(zip_path, cache_dir=cache_dir, progress=False)
    assert "set/cls/zero.png: empty file" in str(err.value) and "set/cls/cut.png: truncated" in str(err.value)
    data = prepare(zip_path, skip_bad=True, cache_dir=cache_dir, progress=False)
    np.testing.assert_array_equal(data.images[:, 0], good)


def test_zip_member_inflating_far_beyond_an_image_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    zip_path = tmp_path / "bomb.zip"
    good = rng_images(2, 8, 8)
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for i, im in enumerate(good):
            zf.writestr(f"c/{i}.png", encode(im, "PNG"))
        zf.writestr("c/huge.png", b"\0" * (3 * 2**20))  # 3 MiB of zeros: a few KB compressed
    assert zip_path.stat().st_size < 100_000
    # max_image_pixels=1000 allows members up to 4 * 1000 bytes + 1 MiB.
    with pytest.raises(DataError) as err:
        prepare(zip_path, max_image_pixels=1000, cache_dir=cache_dir, progress=False)
    assert "c/huge.png: zip member claims 3,145,728 bytes uncompressed" in str(err.value)
    assert "zip bomb" in str(err.value)
