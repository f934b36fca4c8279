"""`fastddpm data prepare|info` and info()/describe(): what users read."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from data_fixtures import cache_dir, make_class_folder, make_idx_folder, rng_images, save_image  # noqa: F401
from fastddpm.data import describe, info, prepare
from fastddpm.data.cli import add_data_parser, main, run_data


def test_info_on_an_unprepared_source_says_what_it_is_and_builds_nothing(tmp_path: Path, cache_dir: Path) -> None:
    make_class_folder(tmp_path / "faces", {"a": rng_images(3, 8, 8), "b": rng_images(2, 8, 8)})
    text = info(tmp_path / "faces", resize=4, cache_dir=cache_dir)
    assert "image-folder" in text and "5 image files, 2 class folders (a, b)" in text
    assert f"not prepared yet: run `fastddpm data prepare {tmp_path / 'faces'} --resize 4 --cache-dir" in text
    assert not cache_dir.exists()


def test_info_names_the_options_a_source_was_prepared_with(tmp_path: Path, cache_dir: Path) -> None:
    """Prepared with --resize only (its sizes differ), `data info X` said "not prepared yet: run data prepare X",
    a command that fails on it."""
    make_class_folder(tmp_path / "mixed", {"a": rng_images(3, 8, 8), "b": rng_images(2, 12, 12)})
    prepare(tmp_path / "mixed", resize=8, image_mode="L", cache_dir=cache_dir, progress=False)
    make_class_folder(tmp_path / "other", {"a": rng_images(3, 8, 8)})
    prepare(tmp_path / "other", resize=4, cache_dir=cache_dir, progress=False)  # another source: not named
    text = info(tmp_path / "mixed", cache_dir=cache_dir)
    assert f"not prepared yet: run `fastddpm data prepare {tmp_path / 'mixed'} --cache-dir" in text
    others = [line for line in text.splitlines() if "prepared with other options" in line]
    assert others == [f"  prepared with other options: `fastddpm data prepare {tmp_path / 'mixed'} --resize 8 "
                      f"--image-mode L --cache-dir {cache_dir}` (`data info` with them describes it)"]
    assert "prepared with other options" not in info(tmp_path / "mixed", resize=8, image_mode="L",
                                                     cache_dir=cache_dir)


def test_info_on_a_prepared_source_summarises_the_cache(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m", n_train=12)
    data = prepare(tmp_path / "m", cache_dir=cache_dir, progress=False)
    text = info(tmp_path / "m", cache_dir=cache_dir)
    assert text == describe(data)
    assert "12 images, 1x28x28 uint8" in text
    assert "classes:     10" in text and "      9  9" in text
    assert str(data.cache_path) in text and "MiB on disk" in text
    assert f"fingerprint: {data.meta['fingerprint']}" in text and "skipped:     none" in text


def test_info_reports_a_stale_cache(tmp_path: Path, cache_dir: Path) -> None:
    make_class_folder(tmp_path / "root", {"0": rng_images(2, 8, 8)})
    prepare(tmp_path / "root", cache_dir=cache_dir, progress=False)
    save_image(tmp_path / "root" / "0" / "new.png", rng_images(1, 8, 8, seed=3)[0])
    text = info(tmp_path / "root", cache_dir=cache_dir)
    assert "STALE: source changed" in text and "3 image files" in text


def test_describe_lists_skipped_files(tmp_path: Path, cache_dir: Path) -> None:
    make_class_folder(tmp_path / "root", {"0": rng_images(2, 8, 8)})
    (tmp_path / "root" / "0" / "zero.png").write_bytes(b"")
    data = prepare(tmp_path / "root", skip_bad=True, cache_dir=cache_dir, progress=False)
    text = describe(data)
    assert "skipped:     1 of 3 files" in text and "0/zero.png: empty file (0 bytes)" in text


def test_cli_prepare_then_info(tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_idx_folder(tmp_path / "m", n_test=5)
    assert main(["data", "prepare", str(tmp_path / "m"), "--split", "t10k", "--resize", "14",
                 "--image-mode", "RGB", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert "5 images, 3x14x14 uint8" in out and "resize to 14x14 (center-crop), convert to RGB" in out
    assert main(["data", "info", str(tmp_path / "m"), "--split", "test", "--resize", "14", "--image-mode", "RGB",
                 "--cache-dir", str(cache_dir)]) == 0
    assert "5 images, 3x14x14 uint8" in capsys.readouterr().out


def test_cli_data_error_is_printed_and_exits_2(tmp_path: Path, cache_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "root" / "0").mkdir(parents=True)
    (tmp_path / "root" / "0" / "a.png").write_bytes(b"")
    save_image(tmp_path / "root" / "0" / "b.png", rng_images(1, 4, 4)[0])
    assert main(["data", "prepare", str(tmp_path / "root"), "--cache-dir", str(cache_dir)]) == 2
    err = capsys.readouterr().err
    assert any(line.startswith("error: 1 of 2 image files") for line in err.splitlines())
    assert "0/a.png: empty file" in err
    assert "Traceback" not in err
    assert main(["data", "prepare", str(tmp_path / "root"), "--skip-bad", "--cache-dir", str(cache_dir)]) == 0


def test_cli_missing_source_is_an_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "info", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_parser_plugs_into_a_top_level_cli(tmp_path: Path, cache_dir: Path) -> None:
    parser = argparse.ArgumentParser(prog="fastddpm")
    sub = parser.add_subparsers(dest="command")
    add_data_parser(sub)
    sub.add_parser("train")  # the other engineer's commands live beside ours
    args = parser.parse_args(["data", "prepare", "mnist", "--rebuild", "--resize-mode", "stretch", "--skip-bad"])
    assert (args.command, args.data_command, args.source, args.rebuild, args.resize_mode, args.skip_bad) == (
        "data", "prepare", "mnist", True, "stretch", True)
    assert args.func is run_data
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "info", "mnist", "--rebuild"])  # prepare-only flag
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "prepare", "mnist", "--resize", "0"])


@pytest.mark.parametrize("command", ["prepare", "info"])
def test_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["data", command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"fastddpm data {command} fashion-mnist" in out
    for flag in ("--split", "--resize", "--resize-mode", "--image-mode", "--skip-bad", "--cache-dir"):
        assert flag in out
    assert ("--rebuild" in out) == (command == "prepare")


def test_fastddpm_cache_env_is_used_by_the_cli(tmp_path: Path, cache_dir: Path) -> None:
    make_idx_folder(tmp_path / "m")
    assert main(["data", "prepare", str(tmp_path / "m")]) == 0
    assert os.environ["FASTDDPM_CACHE"] == str(cache_dir) and any((cache_dir / "prepared").iterdir())


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path, cache_dir: Path) -> None:
    """`fastddpm data info X | head -1` ended in a BrokenPipeError traceback once head had left."""
    import subprocess
    import sys

    make_class_folder(tmp_path / "root", {"a": rng_images(2, 6, 6, seed=1)})
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        r = subprocess.run([sys.executable, "-m", "fastddpm", "data", "info", str(tmp_path / "root")], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120,
                           env={**os.environ, "FASTDDPM_CACHE": str(cache_dir)})
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_prepare_into_a_pipe_writes_whole_lines_not_carriage_return_bars(tmp_path: Path, cache_dir: Path) -> None:
    """`fastddpm data prepare X 2>&1 | tee log` (a log file, CI): tqdm redrew its bars with carriage returns into
    the pipe, as `train` and `sample` do not (fastddpm.progress: whole lines where there is no terminal). Both
    passes of an image folder and the copy of an array source say where they ended, one line each."""
    import subprocess
    import sys

    make_class_folder(tmp_path / "root", {"a": rng_images(3, 6, 6, seed=1), "b": rng_images(3, 6, 6, seed=2)})
    make_idx_folder(tmp_path / "m")
    for source, bars in (("root", ("checking headers", "decoding")), ("m", ("writing cache",))):
        r = subprocess.run([sys.executable, "-m", "fastddpm", "data", "prepare", str(tmp_path / source)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120,
                           env={**os.environ, "FASTDDPM_CACHE": str(cache_dir)})
        assert r.returncode == 0, r.stderr
        assert "\r" not in r.stderr and "%|" not in r.stderr, r.stderr
        for bar in bars:
            assert f"{bar} | img " in r.stderr and "(100%)" in r.stderr, r.stderr
