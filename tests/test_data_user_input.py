"""A user's own data, read the way a first-time user brings it: what is refused, what is warned about, and that
every message names the file or value and the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastddpm.cli import main
from fastddpm.config import ConfigError, apply_overrides, get_preset, resolve_classes, resolve_model_shape

from data_fixtures import cache_dir, rng_images  # noqa: F401 - cache_dir is a fixture


def _conditional(names: str | None = None):
    over = {"model.conditional": True, **({"model.class_names": names} if names is not None else {})}
    return resolve_model_shape(apply_overrides(get_preset("tiny"), over), (1, 1, 8, 8))


# ------------------------------------------------------------------------------------------------ --class-names
def test_class_names_name_unnamed_classes_and_never_silently_lose_to_the_datas() -> None:
    labels = np.array([0, 1, 2, 1])
    # the data only numbers its classes (an .npz without class_names, folders 0/ 1/ 2/): the given names are used
    for data_names in ([], ["0", "1", "2"]):
        cfg = resolve_classes(_conditional("cat,dog,bird"), labels, data_names, "x.npz")
        assert cfg.model.class_names == ("cat", "dog", "bird") and cfg.model.num_classes == 3
    # a resume: config.json holds the data's names, which it gave
    same = resolve_classes(_conditional("cat,dog,bird"), labels, ["cat", "dog", "bird"], "x.npz")
    assert same.model.class_names == ("cat", "dog", "bird")
    with pytest.raises(ConfigError) as e:
        resolve_classes(_conditional("a,b,c"), labels, ["cat", "dog", "bird"], "x.npz")
    message = str(e.value)
    assert "--class-names a,b,c" in message and "cat, dog, bird" in message and "x.npz" in message
    assert "drop --class-names" in message and "prepare the data again" in message
    with pytest.raises(ConfigError, match=r"names 2 classes, but x.npz has labels up to 2, 3 classes"):
        resolve_classes(_conditional("a,b"), labels, [], "x.npz")
    assert resolve_classes(_conditional(), labels, [], "x.npz").model.class_names == ("0", "1", "2")


def test_train_refuses_class_names_that_differ_from_the_datas(tmp_path: Path, cache_dir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "named.npz"
    np.savez(src, images=rng_images(8, 8, 8), labels=np.arange(8) % 2, class_names=np.array(["cat", "dog"]))
    code = main(["train", "--data", str(src), "--out", str(tmp_path / "run"), "--preset", "tiny", "--conditional",
                 "--class-names", "left,right", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--class-names left,right" in err and "cat, dog" in err and "drop --class-names" in err
    assert not (tmp_path / "run" / "config.json").exists()


# ------------------------------------------------------------------------------------------------ dim uint8 arrays
def test_a_uint8_array_of_zeros_and_ones_is_warned_about_once_naming_the_file_and_the_fix(
        tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fastddpm.data import prepare

    src = tmp_path / "scaled.npy"
    np.save(src, (rng_images(6) > 127).astype(np.uint8))  # floats in [0, 1] cast to uint8: 0 and 1
    prepared = prepare(src, cache_dir=cache_dir, progress=False)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert str(src) in err and "brightest pixel of these uint8 images is 1" in err
    assert "(x * 255).round().astype(np.uint8)" in err
    assert any("near-black" in n for n in prepared.meta["notes"])  # `data info` says it too
    prepare(src, cache_dir=cache_dir, progress=False)  # the cache is reused: said once, when it was built
    assert "warning:" not in capsys.readouterr().err
    # the same images at 0..255, or resized on the way in, are not warned about / are
    np.save(src, rng_images(6))
    prepare(src, cache_dir=cache_dir, progress=False)
    assert "warning:" not in capsys.readouterr().err
    np.save(src, (rng_images(6) > 127).astype(np.uint8))
    prepare(src, cache_dir=cache_dir, progress=False, resize=4)
    assert "brightest pixel of these uint8 images is 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ label ids with gaps
def test_label_ids_with_gaps_are_warned_about_naming_the_missing_count_and_the_present_ids(
        tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fastddpm.data import prepare

    src = tmp_path / "coded.npz"
    labels = np.array([3, 7, 42, 3, 7, 42])
    np.savez(src, images=rng_images(6), labels=labels)
    prepared = prepare(src, cache_dir=cache_dir, progress=False)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert str(src) in err and "3 of the class ids 0-42 (3, 7, 42)" in err and "other 40 ids have no image" in err
    assert "np.unique(labels, return_inverse=True)[1]" in err
    # nothing renumbered: the ids stay what the file says
    assert np.array_equal(np.asarray(prepared.labels), labels) and len(prepared.class_names) == 43
    np.savez(src, images=rng_images(6), labels=np.array([0, 1, 2, 2, 1, 0]))
    prepare(src, cache_dir=cache_dir, progress=False)
    assert "warning:" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ data info on floats
@pytest.mark.parametrize("kind", ["npy", "npz", "npz-splits"])
def test_info_says_what_prepare_will_refuse_in_a_float_array(tmp_path: Path, cache_dir: Path, kind: str) -> None:
    from fastddpm.data import DataError, info, prepare

    floats = rng_images(4).astype(np.float32) / 255
    src = tmp_path / f"floats.{kind[:3]}"
    if kind == "npy":
        np.save(src, floats)
    elif kind == "npz":
        np.savez(src, images=floats, labels=np.arange(4))
    else:
        np.savez(src, x_train=floats, y_train=np.arange(4), x_test=rng_images(2), y_test=np.arange(2))
    said = info(src, cache_dir=cache_dir)
    with pytest.raises(DataError) as refused:
        prepare(src, cache_dir=cache_dir, progress=False)
    assert "`data prepare` will stop here" in said and str(refused.value) in said
    assert "float32" in said and "(x * 255).round().astype(np.uint8)" in said
    if kind == "npz-splits":  # the test split is uint8: nothing to say about it
        assert "will stop here" not in info(src, cache_dir=cache_dir, split="test")


# ------------------------------------------------------------------------------------------------ the build lock
def test_a_refused_prepare_leaves_no_lock_file_and_a_waiter_locks_the_file_that_is_there(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from fastddpm.data import DataError, prepare
    from fastddpm.data import cache as cache_module

    src = tmp_path / "floats.npy"
    np.save(src, np.zeros((2, 4, 4), np.float32))
    with pytest.raises(DataError, match="images are float32"):
        prepare(src, cache_dir=cache_dir, progress=False)
    assert [p.name for p in (cache_dir / "prepared").iterdir()] == []
    np.save(src, rng_images(2, 4, 4))
    prepare(src, cache_dir=cache_dir, progress=False)  # a good build afterwards still works
    # a process that locked the file its holder then removed (the holder failed) takes the new one: its lock on
    # the removed file would exclude no one
    final = cache_dir / "prepared" / "x"
    lock_path = final.parent / ".x.lock"
    opened = []
    real_open = open

    def open_and_remove_once(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if path == lock_path and not opened:
            os.unlink(path)  # as the failed holder does, after this process opened it
        opened.append(path)
        return f

    monkeypatch.setattr(cache_module, "open", open_and_remove_once, raising=False)
    with cache_module.build_lock(final, say=lambda message: None):
        assert lock_path.exists() and len(opened) == 2


# ------------------------------------------------------------------------------------------------ 16-bit images
def test_a_16_bit_png_is_given_a_fix_that_works_not_image_mode(tmp_path: Path, cache_dir: Path) -> None:
    from PIL import Image

    from fastddpm.data import DataError, prepare

    root = tmp_path / "scans"
    (root / "0").mkdir(parents=True)
    for i, grey in enumerate(rng_images(3)):
        Image.fromarray(grey.astype(np.uint16) * 257).save(root / "0" / f"s{i}.png")
    assert Image.open(root / "0" / "s0.png").mode == "I;16"
    for image_mode in (None, "L"):  # --image-mode L, the old hint, is refused just the same
        with pytest.raises(DataError) as e:
            prepare(root, cache_dir=cache_dir, progress=False, image_mode=image_mode)
        fix = str(e.value).splitlines()[-1]
        assert "16-bit/float" in str(e.value) and fix.startswith("Fix:")
        assert "--image-mode L or RGB" not in fix and "--image-mode does not convert them" in fix
    # the fix as written turns them into images prepare takes, the same pixels' top 8 bits
    for p in sorted((root / "0").iterdir()):
        Image.fromarray((np.asarray(Image.open(p)) >> 8).astype(np.uint8)).save(p)
    prepared = prepare(root, cache_dir=cache_dir, progress=False)
    assert np.array_equal(np.asarray(prepared.images)[:, 0], rng_images(3))


# ------------------------------------------------------------------------------------------------ a user's own tar
def test_a_users_own_tar_is_not_called_cifar10(tmp_path: Path, cache_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import tarfile

    from fastddpm.data import DataError, info, prepare

    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    np.save(tmp_path / "imgs" / "cat" / "a.npy", rng_images(1))
    src = tmp_path / "holiday.tar.gz"
    with tarfile.open(src, "w:gz") as tar:
        tar.add(tmp_path / "imgs", arcname="imgs")
    said = info(src, cache_dir=cache_dir)
    assert said.splitlines()[0].endswith(f"tar archive at {src}") and "cifar10" not in said
    assert "for your own images use a folder or a .zip" in said
    with pytest.raises(DataError, match="for your own images use a folder or a .zip"):
        prepare(src, cache_dir=cache_dir, progress=True)
    err = capsys.readouterr().err
    assert f"preparing {src} (tar archive, train)" in err and "cifar10" not in err


def test_names_given_to_numbered_classes_are_the_runs_own_on_resume(tmp_path: Path, cache_dir: Path) -> None:
    import json

    from fastddpm.trainer.loop import train

    src = tmp_path / "numbered.npz"
    np.savez(src, images=rng_images(8, 16, 16), labels=np.arange(8) % 2)  # no class_names: classes 0 and 1

    def cfg(**over):
        # a fresh preset each time, as a resume given --preset starts from the preset's values, not the run's
        return apply_overrides(get_preset("tiny"), {
            "data.source": str(src), "model.conditional": True, "train.progress": False, "train.batch_size": 4,
            "train.num_sample_images": 2, "train.sample_steps": 2, "train.checkpoint_every": 1, **over})

    run = tmp_path / "run"
    train(cfg(**{"model.class_names": "left,right", "train.max_steps": 1}), out_dir=run, log=lambda *a, **k: None)
    assert json.loads((run / "config.json").read_text())["model"]["class_names"] == ["left", "right"]
    train(cfg(**{"train.max_steps": 2}), out_dir=run, resume="latest", log=lambda *a, **k: None)
    assert json.loads((run / "config.json").read_text())["model"]["class_names"] == ["left", "right"]


def test_an_output_folder_inside_the_image_folder_being_read_is_refused_before_anything_is_written(
        tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --out` (or `data export-images OUT_DIR`) at or under the image folder it reads: the run's sample grids
    (the export's PNGs) landed among the dataset's images, and its next prepare read them as a class of their own
    (under --resize, trained on without a word) or as bad files that stopped the resume. An IDX folder reads only
    its named files: a run beside them is left alone."""
    from PIL import Image

    from data_fixtures import write_idx

    images = tmp_path / "images"
    for i, im in enumerate(rng_images(8, 8, 8)):
        (images / str(i % 2)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(images / str(i % 2) / f"{i}.png")
    before = sorted(p.relative_to(images) for p in images.rglob("*"))
    monkeypatch.chdir(images)
    for out in (images / "runs" / "a", images, Path(".")):
        assert main(["train", "--data", ".", "--out", str(out), "--preset", "tiny", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"error: --out {out} is" in err and f"the image folder the data is read from ({images}): its sample " \
            f"grids (samples/*.png) would be read as images of the dataset" in err
        assert err.rstrip().endswith(f"Fix: give --out a folder outside {images}.")
    assert main(["data", "export-images", str(images), str(images / "png")]) == 2
    assert f"export-images OUT_DIR {images / 'png'} is inside the image folder" in capsys.readouterr().err
    assert sorted(p.relative_to(images) for p in images.rglob("*")) == before  # nothing written, no folder made
    monkeypatch.chdir(tmp_path)
    # outside it, or beside the files of an IDX folder, the run goes ahead
    assert main(["data", "export-images", str(images / "0"), str(tmp_path / "zero")]) == 0
    idx = tmp_path / "idx"
    idx.mkdir()
    write_idx(idx / "train-images-idx3-ubyte.gz", rng_images(16, 8, 8))
    assert main(["train", "--data", str(idx), "--out", str(idx / "run"), "--preset", "tiny", "--max-steps", "1",
                 "--batch-size", "4", "--no-progress", "--device", "cpu"]) == 0


def test_sample_and_eval_out_inside_the_image_folder_of_the_run_are_refused_before_anything_is_written(
        tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sample --out` and `eval --out` at or under the image folder the run trained on (or `eval --data` reads)
    wrote their grids there, where the folder's next prepare (the run's resume) read them as images of the dataset;
    `train --out` and `data export-images` refuse it already. Outside it, both go ahead."""
    from PIL import Image

    images = tmp_path / "images"
    for i, im in enumerate(rng_images(8, 8, 8)):
        (images / str(i % 2)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(images / str(i % 2) / f"{i}.png")
    run = tmp_path / "run"
    assert main(["train", "--data", str(images), "--out", str(run), "--preset", "tiny", "--max-steps", "1",
                 "--batch-size", "4", "--no-attention", "--num-sample-images", "2", "--sample-steps", "2",
                 "--no-progress", "--device", "cpu"]) == 0
    other = tmp_path / "other"
    (other / "a").mkdir(parents=True)
    Image.fromarray(rng_images(1, 8, 8, seed=3)[0]).save(other / "a" / "x.png")
    before = sorted(p.relative_to(tmp_path) for p in (*images.rglob("*"), *other.rglob("*")))
    capsys.readouterr()
    sample = ["sample", "--checkpoint", str(run), "--num-images", "2", "--sampler", "ddim", "--steps", "2",
              "--no-progress", "--out"]
    for out, named in ((images, images), (images / "samples", images / "samples"), (images / "0" / "grid.png",
                                                                                     images / "0")):
        assert main([*sample, str(out)]) == 2
        err = capsys.readouterr().err
        where = "is" if named == images else "is inside"
        assert f"error: --out {named} {where} the image folder the data is read from ({images}): the grid and the " \
               ".npz would be read as images of the dataset" in err
        assert err.rstrip().endswith(f"Fix: give --out a folder outside {images}.")
    evaluate = ["eval", "--checkpoint", str(run), "--num-samples", "10", "--steps", "2", "--no-progress", "--out"]
    assert main([*evaluate, str(images / "eval")]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {images / 'eval'} is inside the image folder the data is read from ({images}): the " \
           "result's grid and .json would be read" in err
    assert main([*evaluate, str(other / "eval"), "--data", str(other)]) == 2  # the folder eval reads, too
    assert f"--out {other / 'eval'} is inside the image folder the data is read from ({other})" in \
        capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in (*images.rglob("*"), *other.rglob("*"))) == before
    assert main([*sample, str(tmp_path / "s")]) == 0  # outside it
    assert (tmp_path / "s" / "ddim2_n2_seed0_step1.png").is_file()


def test_sample_and_eval_without_out_refuse_a_run_folder_inside_the_image_folder_it_trained_on(
        tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run trained before `train --out` inside its image folder was refused can sit there; `sample` and `eval`
    without --out wrote their grids into RUN_DIR/samples and RUN_DIR/eval, among the images, where `--out` there
    is refused. The default goes through the same check, and the error says --out was not given."""
    import shutil

    from PIL import Image

    images = tmp_path / "images"
    for i, im in enumerate(rng_images(8, 8, 8)):
        (images / str(i % 2)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(images / str(i % 2) / f"{i}.png")
    assert main(["train", "--data", str(images), "--out", str(tmp_path / "run"), "--preset", "tiny", "--max-steps",
                 "1", "--batch-size", "4", "--no-attention", "--num-sample-images", "2", "--sample-steps", "2",
                 "--no-progress", "--device", "cpu"]) == 0
    run = images / "run"  # where an older fastddpm let `train --out` put it (data.source is absolute: still read)
    shutil.move(tmp_path / "run", run)
    before = sorted(p.relative_to(tmp_path) for p in images.rglob("*"))
    capsys.readouterr()
    for command, default, what in (
            (["sample", "--num-images", "2"], run / "samples", "the grid and the .npz"),
            (["eval", "--num-samples", "10"], run / "eval", "the result's grid and .json")):
        assert main([*command, "--checkpoint", str(run), "--sampler", "ddim", "--steps", "2", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"error: --out was not given, and its default, {default}, is inside the image folder the data is " \
               f"read from ({images}): {what} would be read as images of the dataset" in err, err
        assert err.rstrip().endswith(f"Fix: give --out a folder outside {images}.")
    assert sorted(p.relative_to(tmp_path) for p in images.rglob("*")) == before
    assert main(["sample", "--checkpoint", str(run), "--num-images", "2", "--sampler", "ddim", "--steps", "2",
                 "--no-progress", "--out", str(tmp_path / "s")]) == 0  # outside it
