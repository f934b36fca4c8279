"""`fastddpm export`: ONNX (checked in onnxruntime), torch.export (.pt2, loaded back) and safetensors, each against
PyTorch on the same inputs and a batch size the export never saw; the folder's schedule, config and model card;
and sample_onnx.py, which each ONNX folder holds and samples with onnxruntime and numpy alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fastddpm
from fastddpm.cli import main
from fastddpm.config import ConfigError
from fastddpm.config import apply_overrides, get_preset, resolve_model_shape
from fastddpm.diffusion import schedule_from_config
from fastddpm.export import example_inputs
from fastddpm.export_card import fid_of_these_weights, model_card
from fastddpm.models import UNet
from fastddpm.rundir.locate import locate
from fastddpm.sampling import load_for_sampling
from fastddpm.trainer.loop import train

from conftest import ONE_BLOCK_SEED

ROOT = Path(__file__).resolve().parent.parent


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="session")
def runs(tmp_path_factory, fmnist_npz):
    """Two short runs (unconditional, conditional) of the seed U-Net with one block of each kind: an exporter's
    time grows with the blocks (an ONNX export took 4.0 s against the tiny preset's 5.2-6.4 s)."""
    out = {}
    for name, conditional in (("uncond", False), ("cond", True)):
        cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                                   "train.max_steps": 3, "model.conditional": conditional,
                                                   "train.num_sample_images": 4, "train.sample_steps": 2,
                                                   **ONE_BLOCK_SEED})
        out[name] = tmp_path_factory.mktemp(name) / "run"
        train(cfg, out_dir=out[name], log=quiet)
    return out


def reference(run: Path, batch: int):
    model, cfg = load_for_sampling(run)
    inputs = example_inputs(cfg, batch, seed=11)
    with torch.no_grad():
        return inputs, model(*inputs).numpy(), cfg


def test_torch_export_loads_back_and_matches(runs, tmp_path):
    assert main(["export", str(runs["uncond"]), "--format", "torch-export", "--out", str(tmp_path)]) == 0
    inputs, want, _ = reference(runs["uncond"], 5)
    got = torch.export.load(str(tmp_path / "model.pt2")).module()(*inputs).detach().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert json.loads((tmp_path / "export.json").read_text())["max_abs_diff"] <= 1e-3


@pytest.mark.parametrize("name", ["uncond", "cond"])
def test_onnx_runs_in_onnxruntime_like_pytorch(runs, onnx_export, name):
    ort = pytest.importorskip("onnxruntime", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    tmp_path = onnx_export(name)[0]
    inputs, want, cfg = reference(runs[name], 5)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == (["x", "t", "y"] if name == "cond" else ["x", "t"])
    got = session.run(None, {i.name: v.numpy() for i, v in zip(session.get_inputs(), inputs)})[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
    record = json.loads((tmp_path / "export.json").read_text())
    assert record["max_abs_diff"] <= 1e-3 and record["exporter"].startswith("torch.onnx.export")
    schedule = json.loads((tmp_path / "schedule.json").read_text())
    np.testing.assert_allclose(schedule["betas"], schedule_from_config(cfg.diffusion).betas.double().numpy())
    assert schedule["num_classes"] == (10 if name == "cond" else 0)
    card = (tmp_path / "README.md").read_text()
    assert "images seen: 48 (step 3)" in card and "--format onnx" in card


def test_safetensors_rebuilds_the_unet(runs, tmp_path):
    from safetensors.torch import load_file

    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path)]) == 0
    inputs, want, cfg = reference(runs["uncond"], 2)
    model = UNet(cfg.model).eval()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    with torch.no_grad():
        assert np.array_equal(model(*inputs).numpy(), want)
    again = locate(tmp_path / "model.safetensors")  # the export is itself something fastddpm loads
    assert (again.step, again.images_seen) == (3, 48)


def test_export_json_names_the_weights_and_the_folder_wherever_it_is_read_from(runs, tmp_path, monkeypatch):
    """An export made from a relative path recorded "run/checkpoints/ckpt_...pt": true only where it ran."""
    monkeypatch.chdir(tmp_path)
    run = Path(os.path.relpath(runs["uncond"], tmp_path))
    assert main(["export", str(run), "--format", "safetensors", "--out", "exp"]) == 0
    record = json.loads((tmp_path / "exp" / "export.json").read_text())
    assert Path(record["checkpoint"]["file"]).is_absolute() and Path(record["checkpoint"]["file"]).is_file()
    assert record["out"] == str(tmp_path / "exp")


def test_opset_is_what_the_file_declares_or_a_clear_failure(runs, tmp_path, capfd):
    """The dynamo exporter writes opset 18 where it cannot convert (a warning said so, export.json did not):
    export.json records the file's own opset, and one nobody can write fails naming both exporters' reasons."""
    pytest.importorskip("onnxruntime", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    from fastddpm.export import onnx_opset

    assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(tmp_path / "17"), "--opset",
                 "17"]) == 0
    assert onnx_opset(tmp_path / "17" / "model.onnx") == 17
    assert json.loads((tmp_path / "17" / "export.json").read_text())["opset"] == 17
    capfd.readouterr()
    for folder in ("13", "17"):  # a new folder, and the opset 17 export's: a failure leaves that one whole
        assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(tmp_path / folder), "--opset",
                     "13"]) == 1
        got = capfd.readouterr()
        assert "error: export --opset 13: neither ONNX exporter wrote the model" in got.err
        assert "opset 18, not 13" in got.err
        # one line: not the opset converter's log and traceback, nor the TorchScript graph dumped from C++
        assert "Traceback" not in got.err and "Torch IR graph" not in got.out and len(got.err.splitlines()) <= 3, got
        assert not (tmp_path / folder / "export.partial").exists()
    assert not (tmp_path / "13" / "export.json").exists() and not (tmp_path / "13" / "model.onnx").exists()
    assert onnx_opset(tmp_path / "17" / "model.onnx") == 17
    assert json.loads((tmp_path / "17" / "export.json").read_text())["opset"] == 17
    # the retry the message suggests, into the same folder
    assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(tmp_path / "13")]) == 0


def test_a_file_that_differs_from_pytorch_leaves_the_earlier_export_whole(runs, tmp_path, capsys, monkeypatch):
    """The model file is checked before it replaces the earlier export's, which its export.json describes; the
    failed one is kept for inspection, and a retry (or a killed export's leftover) is written over."""
    import fastddpm.export as export

    out = tmp_path / "e"
    assert main(["export", str(runs["uncond"]), "--format", "torch-export", "--out", str(out)]) == 0
    before = (out / "model.pt2").read_bytes(), (out / "export.json").read_text()
    monkeypatch.setattr(export, "_check_pt2", lambda *a: 1.0)  # what an exporter's numeric bug would measure
    assert main(["export", str(runs["cond"]), "--format", "torch-export", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "differs from PyTorch by 1" in err and f"kept for inspection as {out / 'export.partial' / 'model.pt2'}" \
        in err, err
    assert ((out / "model.pt2").read_bytes(), (out / "export.json").read_text()) == before
    assert (out / "export.partial" / "model.pt2").is_file()
    monkeypatch.undo()
    assert main(["export", str(runs["cond"]), "--format", "torch-export", "--out", str(out)]) == 0
    assert not (out / "export.partial").exists()
    assert json.loads((out / "config.json").read_text())["model"]["conditional"] is True
    # a folder holding only what a killed export left is an export's, written over
    (tmp_path / "killed" / "export.partial").mkdir(parents=True)
    (tmp_path / "killed" / "export.partial" / "model.pt2").write_bytes(b"half")
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path / "killed")]) == 0
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == [
        "README.md", "config.json", "export.json", "model.safetensors", "schedule.json"]


def test_a_large_models_external_weights_are_named_for_the_file_they_sit_beside(runs, tmp_path, monkeypatch):
    """Past 1.5 GB the ONNX exporter writes the weights beside the model as model.onnx.data, named inside
    model.onnx: they move with it, and the folder samples with them (here with the size threshold at 0)."""
    ort = pytest.importorskip("onnxruntime", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    import onnx
    from torch.onnx._internal.exporter import _onnx_program

    monkeypatch.setattr(_onnx_program, "_LARGE_MODEL_THRESHOLD", 0)
    out = tmp_path / "big"
    assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(out)]) == 0
    assert {"model.onnx", "model.onnx.data"} <= {p.name for p in out.iterdir()}
    assert not (out / "export.partial").exists()
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map["fastddpm.weights"] == "ema"  # labelled, weights kept beside
    inputs, want, _ = reference(runs["uncond"], 2)
    np.testing.assert_allclose(session.run(None, {"x": inputs[0].numpy(), "t": inputs[1].numpy()})[0], want,
                               atol=1e-4)
    monkeypatch.undo()  # a small model into the same folder: the large one's weights go with it
    assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(out)]) == 0
    assert not (out / "model.onnx.data").exists()


def test_out_must_be_an_exports_folder_and_onnx_needs_its_packages_before_anything_is_written(runs, tmp_path,
                                                                                          capsys, monkeypatch):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "README.md").write_text("mine")
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path / "project")]) == 2
    assert "holds files an export did not write" in capsys.readouterr().err
    assert (tmp_path / "project" / "README.md").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path / "e")]) == 0
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path / "e")]) == 0
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed
    assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(tmp_path / "no-ort")]) == 2
    assert "pip install" in capsys.readouterr().err and not (tmp_path / "no-ort").exists()


@pytest.mark.parametrize("objective", ["ddpm", "edm", "flow"])
def test_the_card_describes_the_network_of_its_objective(objective):
    cfg = resolve_model_shape(apply_overrides(get_preset("tiny"), {"diffusion.objective": objective}), (1, 1, 28, 28))
    card = model_card(cfg, {"step": 3, "images_seen": 48}, None, "onnx", ["model.onnx"], "cmd")
    want = {"ddpm": ("t int64 (B,) in [0, 999]", "in [-1, 1]", "DDPM/DDIM sampler given schedule.json's betas"),
            "edm": ("t float32 (B,) = 250 ln(sigma)", "c_in", "an EDM sampler"),
            "flow": ("t float32 (B,) = 1000 t", "velocity", "flow-matching")}[objective]
    assert all(w in card for w in want), card
    assert ("int64" in card) == (objective == "ddpm")


def test_the_card_quotes_only_the_fid_of_the_exported_weights():
    evals = [{"event": "eval", "step": 10, "images_seen": 160, "fid": 30.0},
             {"event": "eval", "step": 20, "images_seen": 320, "fid": None},  # non-finite, written as null
             {"event": "eval", "step": 30, "images_seen": 480, "fid": 12.0}]
    assert fid_of_these_weights(evals, {"step": 10, "images_seen": 160})["fid"] == 30.0
    assert fid_of_these_weights(evals, {"step": 20, "images_seen": 320}) is None
    assert fid_of_these_weights(evals, {"step": 7, "images_seen": 112}) is None  # an earlier checkpoint
    cfg = resolve_model_shape(get_preset("tiny"), (1, 1, 28, 28))
    card = model_card(cfg, {"step": 30, "images_seen": 480}, fid_of_these_weights(evals, {"step": 30,
                                                                                          "images_seen": 480}),
                      "onnx", ["model.onnx"], "cmd")
    assert "FID 12.00 at 480 images" in card


def test_the_onnx_folder_samples_itself_without_torch_or_fastddpm(onnx_export, tmp_path):
    """The folder copied elsewhere (an upload, another machine): its own sample_onnx.py, run from the folder as the
    card says, with torch unimportable and fastddpm not on the path, draws the grid and the .npz."""
    folder = tmp_path / "elsewhere" / "exp"
    shutil.copytree(onnx_export("uncond")[0], folder)
    assert (folder / "sample_onnx.py").read_bytes() == (ROOT / "src" / "fastddpm" / "sample_onnx.py").read_bytes()
    code = ("import runpy, sys; sys.modules['torch'] = sys.modules['fastddpm'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, "sample_onnx.py", ".", "--num", "6", "--steps", "3", "--out",
                        "grid.png"], capture_output=True, text=True, timeout=300, cwd=folder)
    assert r.returncode == 0, r.stderr
    from PIL import Image

    with Image.open(folder / "grid.png") as im:  # 3 x 2 images of 28 px with 2 px borders
        assert im.mode == "L" and im.size == (3 * 30 + 2, 2 * 30 + 2)
        pixels = np.asarray(im)
    assert pixels.std() > 0  # not a blank image
    images = np.load(folder / "grid.npz")["images"]
    assert images.shape == (6, 1, 28, 28) and images.dtype == np.uint8


def test_the_onnx_sampler_draws_the_same_images_at_any_batch_size(onnx_export, tmp_path, capsys, monkeypatch):
    """Noise for every image first, then --batch-size images per onnxruntime call: a guided draw of more than 2,048
    images (4,096 rows, the export's batch axis) is split, not refused by onnxruntime, and the split changes no
    image; the grid shows the first GRID_IMAGES (256; 16 here, to keep the draw small), the .npz holds all."""
    import fastddpm.sample_onnx as sampler
    from fastddpm.sample_onnx import main as sample_onnx

    monkeypatch.setattr(sampler, "GRID_IMAGES", 16)
    folder = str(onnx_export("cond")[0])
    base = ["--class", "3", "--guidance", "2", "--steps", "1"]
    for b in (7, 2048):
        assert sample_onnx([folder, *base, "--num", "20", "--batch-size", str(b),
                            "--out", str(tmp_path / f"b{b}.png")]) == 0
    a, b = np.load(tmp_path / "b7.npz"), np.load(tmp_path / "b2048.npz")
    assert a["images"].shape == (20, 1, 28, 28) and a["labels"].tolist() == [3] * 20 and float(a["guidance"]) == 2
    diff = np.abs(a["images"].astype(int) - b["images"].astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # float rounding of another batch size in onnxruntime
    assert "b7.png (16 images)" in capsys.readouterr().out
    from PIL import Image

    with Image.open(tmp_path / "b7.png") as im:  # 4 x 4 of the 20
        assert im.size == (4 * 30 + 2, 4 * 30 + 2)
    with pytest.raises(SystemExit, match="--batch-size 2049: between 1 and 2048 .* a guided call doubles the batch"):
        sample_onnx([folder, *base, "--batch-size", "2049"])
    with pytest.raises(SystemExit, match="--num 0 and --steps 1 must both be >= 1"):
        sample_onnx([folder, *base, "--num", "0"])
    # --out in a folder not there yet is created (a traceback after sampling before); under a file it is refused
    assert sample_onnx([folder, *base, "--num", "2", "--out", str(tmp_path / "new" / "deeper" / "g.png")]) == 0
    assert (tmp_path / "new" / "deeper" / "g.npz").is_file()
    with pytest.raises(SystemExit, match=r"--out .*b7\.png/g\.png: cannot create its folder"):
        sample_onnx([folder, *base, "--num", "2", "--out", str(tmp_path / "b7.png" / "g.png")])
    with pytest.raises(SystemExit, match=r"--out .*new is a folder: give the grid's file name"):
        sample_onnx([folder, *base, "--num", "2", "--out", str(tmp_path / "new")])
    # a name of another kind is refused before any sampling: it was written over with the grid's PNG bytes (the
    # export's own model.onnx, a run's config.json), and its .npz replaced the suffix
    for name in ("model.onnx", "config.json", "grid"):
        mine = Path(folder) / name
        before = mine.read_bytes() if mine.is_file() else None
        with pytest.raises(SystemExit, match=rf"--out .*{name}: the grid is a PNG .* does not end in \.png, so a file "
                                             rf"there .* would be replaced: give a name ending in \.png, e.g. --out "
                                             rf".*{Path(name).stem}\.png$"):
            sample_onnx([folder, *base, "--num", "2", "--out", str(mine)])
        assert (mine.read_bytes() if mine.is_file() else None) == before
        assert not mine.with_suffix(".npz").exists()


def test_the_onnx_example_says_a_model_file_that_does_not_load_and_makes_no_folder(onnx_export, tmp_path):
    from fastddpm.sample_onnx import main as sample_onnx

    folder = shutil.copytree(onnx_export("uncond")[0], tmp_path / "exp")
    (folder / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(SystemExit, match=r"model\.onnx: onnxruntime cannot load it \(.+\): export it again"):
        sample_onnx([str(folder), "--num", "2", "--steps", "1", "--out", str(tmp_path / "new" / "g.png")])
    assert not (tmp_path / "new").exists()


def test_the_onnx_examples_timesteps_are_fastddpms_trailing_ones():
    """Every (T, steps) pair: as many timesteps as steps, from T - 1 down to >= 0, equal to fastddpm's DDIM's (a
    float stride once added a step at t = -1, which reads alpha_bar[-1], the noisiest, and ruined every image)."""
    pytest.importorskip("onnxruntime", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    from fastddpm.diffusion.ode_solvers import trailing_timesteps

    from fastddpm.sample_onnx import trailing
    for T in (10, 100, 1000, 4000):
        for steps in range(1, min(T, 300) + 1):
            assert trailing(T, steps).tolist() == trailing_timesteps(T, steps), (T, steps)


def test_export_refuses_what_it_cannot_export(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nowhere"), "--format", "onnx"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_naming_it(runs, tmp_path, capsys, monkeypatch):
    """A file on --out's path and a folder that is not writable are refused naming the folder, before an exporter
    runs: they were a NotADirectoryError traceback and, for ONNX, both exporters' write errors blamed on the opset."""
    (tmp_path / "notes.txt").write_text("mine")
    bad = tmp_path / "notes.txt" / "x"
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(bad)]) == 2
    assert f"export --out {bad}: cannot create the folder (Not a directory)" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access  # root writes anywhere, so a read-only folder is what os.access says of it
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == locked
                        else access(path, mode, **kw))
    assert main(["export", str(runs["uncond"]), "--format", "torch-export", "--out", str(locked)]) == 2
    assert f"export --out {locked}: the folder is not writable" in capsys.readouterr().err
    assert not any(locked.iterdir())


def test_schedule_json_holds_the_float64_betas_training_used_at_another_t(fmnist_npz, tmp_path):
    """At T = 100 the default linear betas are Ho et al.'s scaled by 1000 / T, 1e-3 to 0.2, and schedule.json holds
    the float64 values the schedule is built from (not their float32 copy: 1e-3 was 0.0010000000474974513)."""
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 1, "diffusion.num_timesteps": 100,
                                               "diffusion.prediction": "v", "train.num_sample_images": 2,
                                               "train.sample_steps": 2})
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    assert main(["export", str(tmp_path / "run"), "--format", "safetensors", "--out", str(tmp_path / "e")]) == 0
    schedule = json.loads((tmp_path / "e" / "schedule.json").read_text())
    assert (schedule["num_timesteps"], schedule["schedule"], schedule["prediction"]) == (100, "linear", "v")
    assert schedule["betas"][0] == 1e-3 and schedule["betas"][-1] == 0.2
    assert schedule["betas"] == torch.linspace(1e-3, 0.2, 100, dtype=torch.float64).tolist()


def test_an_export_in_another_format_replaces_the_earlier_ones_files_and_keeps_the_users(runs, tmp_path, capsys):
    """A folder holds one export: re-exported as torch-export, the safetensors export's model file goes (its card
    would not describe it); a file the user put there stays; --opset outside ONNX is refused, not ignored."""
    out = tmp_path / "e"
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(runs["uncond"]), "--format", "torch-export", "--out", str(out)]) == 0
    logged = capsys.readouterr().out
    assert "removed the earlier export's model.safetensors" in logged
    assert "to keep both, give each format its own --out" in logged  # why, and how to keep both
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "export.json", "model.pt2",
                                                     "notes.txt", "schedule.json"]
    assert json.loads((out / "export.json").read_text())["format"] == "torch-export"
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(out), "--opset", "17"]) == 2
    assert "--opset 17 applies to --format onnx only" in capsys.readouterr().err
    assert (out / "model.pt2").is_file()  # the refusal wrote and removed nothing


def test_an_export_folder_loads_as_its_model_file_or_says_what_it_holds(runs, tmp_path):
    import fastddpm
    from fastddpm.rundir.checkpoint import CheckpointError

    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(tmp_path / "st")]) == 0
    inputs, want, _ = reference(runs["uncond"], 2)
    model = fastddpm.load(tmp_path / "st", device="cpu")  # the folder, as the export printed it
    with torch.no_grad():
        assert np.array_equal(model.net.cpu()(*inputs).numpy(), want)
    assert main(["export", str(runs["uncond"]), "--format", "torch-export", "--out", str(tmp_path / "pt2")]) == 0
    with pytest.raises(CheckpointError, match=r"It holds an export \(model.pt2\)"):
        fastddpm.load(tmp_path / "pt2")
    # the export's own file, not its folder: said as an export too (it was "corrupted ... use an earlier checkpoint")
    with pytest.raises(CheckpointError, match=r"model\.pt2 is an export \(PT2\), which other runtimes load; "
                                              r"fastddpm loads the run it came from"):
        fastddpm.load(tmp_path / "pt2" / "model.pt2")


@pytest.fixture(scope="session")
def onnx_export(runs, tmp_path_factory):
    """onnx_export(name): the ONNX export of runs[name], made once per session, and the warnings it raised."""
    pytest.importorskip("onnxruntime", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    done = {}

    def get(name: str) -> tuple[Path, list]:
        if name not in done:
            out = tmp_path_factory.mktemp(f"onnx-{name}") / "exp"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert main(["export", str(runs[name]), "--format", "onnx", "--out", str(out)]) == 0
            done[name] = out, [f"{w.category.__name__}: {w.message}" for w in caught]
        return done[name]

    return get


def card_code(card: str) -> str:
    return card.split("```python\n", 1)[1].split("```", 1)[0]


def test_each_card_names_only_ways_that_sample_its_folder(runs, onnx_export, tmp_path, capsys, monkeypatch):
    """The card's sampling instructions work on that folder: the safetensors card's command runs, the .pt2 card's
    torch loop draws images, and only the ONNX card points at the folder's sample_onnx.py (which reads model.onnx
    only). Every command runs from the folder, moved after the export: the path it was exported to is gone."""
    folder = onnx_export("cond")[0]
    onnx_card = (folder / "README.md").read_text()
    assert "Sample from this folder with `python sample_onnx.py . --out grid.png`" in onnx_card
    assert "--class NAME|ID" in onnx_card and "`fastddpm sample` does not read ONNX" in onnx_card
    assert "sample_onnx.py" in onnx_card.split("; files: ", 1)[1].splitlines()[0]

    made = tmp_path / "st"
    assert main(["export", str(runs["cond"]), "--format", "safetensors", "--out", str(made)]) == 0
    st = tmp_path / "uploaded" / "st"
    shutil.copytree(made, st)
    shutil.rmtree(made)
    card = (st / "README.md").read_text()
    assert "sample_onnx" not in card and str(made) not in card.split("- made by:", 1)[1].split("\n", 1)[1]
    command = card.split("Sample from this folder with `", 1)[1].split("`", 1)[0]
    assert command == "fastddpm sample --checkpoint ."
    capsys.readouterr()
    monkeypatch.chdir(st)
    assert main([*command.split()[1:], "--num-images", "2", "--steps", "2", "--class", "7", "--no-progress"]) == 0
    assert "2 images" in capsys.readouterr().out and list((st / "samples").glob("*.png"))

    pt2 = tmp_path / "pt2"
    assert main(["export", str(runs["cond"]), "--format", "torch-export", "--out", str(pt2)]) == 0
    card = (pt2 / "README.md").read_text()
    assert "sample_onnx" not in card and "torch.export.load" in card
    # the card's loop from a fixed x_T, against fastddpm's own DDIM on the same network (the null class: the card
    # calls it unguided): the same timesteps, x0 and update, up to float rounding
    x_T = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    code = card_code(card).replace("n, T, steps = 16,", "n, T, steps = 2,").replace(", 20  #", ", 3  #")
    assert code.count("x = torch.randn(") == 1
    scope: dict = {"x_T": x_T}
    assert 'folder = "."  # this folder' in code
    monkeypatch.chdir(pt2)
    exec(code.replace("x = torch.randn(", "x = x_T.double() if True else torch.randn("), scope)
    assert scope["images"].shape == (2, 1, 28, 28) and scope["images"].dtype == torch.uint8
    from fastddpm.diffusion.samplers import ddim_sample

    class Fixed:
        def randn(self, shape):
            return x_T.clone()

    cfg = locate(runs["cond"]).config
    net, K = scope["net"], cfg.model.num_classes
    ours = ddim_sample(lambda x, t: net(x, t, torch.full((2,), K)), schedule_from_config(cfg.diffusion),
                       (2, 1, 28, 28), steps=3, prediction=cfg.diffusion.prediction, noise=Fixed(), device="cpu")
    torch.testing.assert_close(scope["x"].float(), ours, atol=1e-4, rtol=0)


def test_out_holding_other_files_is_refused_naming_them(runs, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(full)]) == 2
    err = capsys.readouterr().err
    assert f"export --out {full} holds files an export did not write (notes.txt)" in err
    assert "it would replace README.md" not in err and f"--out {full / 'export'}" in err
    for i in range(5):
        (full / f"f{i}.png").write_text("")
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(full)]) == 2
    assert "(f0.png, f1.png, f2.png and 3 more)" in capsys.readouterr().err
    assert sorted(p.name for p in full.iterdir()) == ["f0.png", "f1.png", "f2.png", "f3.png", "f4.png", "notes.txt"]
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(full / "export")]) == 0


def test_the_onnx_exporters_known_warnings_are_silenced_and_no_others(recwarn):
    import logging
    import warnings

    from fastddpm.export import _ONNX_NOISE_LOGGER, quiet_onnx_exporter

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger(_ONNX_NOISE_LOGGER)
    logger.addHandler(handler)
    try:
        with quiet_onnx_exporter():
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
            warnings.warn("# The axis name: batch will not be used, since it shares the same shape constraints with "
                          "another axis: batch.", UserWarning)
            logger.warning("torchvision is not installed. Skipping torchvision::nms")
            warnings.warn("something else is deprecated", FutureWarning)
            warnings.warn("# The axis name: batch is odd", UserWarning)
            logger.warning("an unrelated registration problem")
        logger.warning("torchvision is not installed. Skipping torchvision::nms")  # the filter is gone after
    finally:
        logger.removeHandler(handler)
    assert [str(w.message) for w in recwarn] == ["something else is deprecated", "# The axis name: batch is odd"]
    assert logged == ["an unrelated registration problem", "torchvision is not installed. Skipping torchvision::nms"]


def test_a_real_onnx_export_warns_nothing(onnx_export):
    assert onnx_export("cond")[1] == []  # it raised a FutureWarning and two UserWarnings of the exporter's own


def test_the_onnx_example_takes_class_names_and_refuses_what_it_cannot_draw(onnx_export, tmp_path, capsys):
    from fastddpm import sample_onnx as example

    # the test data's classes are named 0-9: give the copy Fashion-MNIST's names, which --class must read
    cond, uncond = tmp_path / "cond", str(onnx_export("uncond")[0])
    shutil.copytree(onnx_export("cond")[0], cond)
    schedule = json.loads((cond / "schedule.json").read_text())
    schedule["class_names"] = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                               "Bag", "Ankle boot"]
    (cond / "schedule.json").write_text(json.dumps(schedule))
    cond = str(cond)
    small = ["--num", "2", "--steps", "2", "--out", str(tmp_path / "g.png")]
    assert example.main([cond, "--class", "sneaker", *small]) == 0
    # the run's train.sample_guidance, read from config.json, as fastddpm sample's default
    assert "class 7 at guidance W = 2," in capsys.readouterr().out
    assert example.main([cond, "--class", "7", "--guidance", "1", *small]) == 0
    assert "class 7 at guidance W = 1," in capsys.readouterr().out
    for argv, message in (([uncond, "--class", "3"], "this export's model is unconditional"),
                          ([cond, "--class", "99"], "--class 99 is out of range: this model has classes 0-9 (0 "),
                          ([cond, "--class", "zebra"], "'zebra' is not one of this model's classes: 0 'T-shirt/top'"),
                          ([cond, "--guidance", "2"], "give --class NAME|ID with it"),
                          ([cond, "--class", "1", "--guidance", "-1"], "--guidance -1 must be a finite number >= 0"),
                          ([str(tmp_path), "--class", "1"], "holds no model.onnx")):
        with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace("|", r"\|")):
            example.main([*argv, *small])


def test_a_model_onnx_alone_carries_its_schedule_and_config_and_samples_as_its_folder(onnx_export, tmp_path,
                                                                                    capsys):
    """model.onnx copied away from its folder (an upload of the file alone) holds schedule.json and config.json in
    its metadata, so sample_onnx.py given the file draws the folder's images with the run's guidance; a file with
    neither beside it nor inside it is refused naming what is missing."""
    import onnx

    from fastddpm import sample_onnx as example

    folder = onnx_export("cond")[0]
    props = {p.key: p.value for p in onnx.load(str(folder / "model.onnx"), load_external_data=False).metadata_props}
    assert json.loads(props["fastddpm.schedule"]) == json.loads((folder / "schedule.json").read_text())
    assert json.loads(props["fastddpm.config"]) == json.loads((folder / "config.json").read_text())
    export = json.loads((folder / "export.json").read_text())
    assert (props["fastddpm.weights"], props["fastddpm.step"]) == ("ema", str(export["checkpoint"]["step"]))
    alone = tmp_path / "upload" / "cond.onnx"
    alone.parent.mkdir()
    shutil.copyfile(folder / "model.onnx", alone)
    small = ["--num", "3", "--steps", "2", "--class", "7", "--seed", "5"]
    assert example.main([str(folder), *small, "--out", str(tmp_path / "folder.png")]) == 0
    assert example.main([str(alone), *small, "--out", str(tmp_path / "alone.png")]) == 0
    assert capsys.readouterr().out.count("class 7 at guidance W = 2,") == 2  # the run's train.sample_guidance
    np.testing.assert_array_equal(np.load(tmp_path / "alone.npz")["images"], np.load(tmp_path / "folder.npz")["images"])
    bare = onnx.load(str(alone))
    del bare.metadata_props[:]  # as an export made before the metadata
    onnx.save(bare, str(alone))
    with pytest.raises(SystemExit, match="has no schedule.json beside it and carries none in its metadata"):
        example.main([str(alone), *small, "--out", str(tmp_path / "bare.png")])


def test_the_onnx_examples_guidance_is_fastddpms(runs, onnx_export):
    """The example's guided network output is fastddpm's classifier-free guidance (the samplers' own function) on
    the same inputs, at W = 2.5, 1 (the conditional output) and 0 (the null class's)."""
    import onnxruntime as ort

    from fastddpm.diffusion.guidance import guided

    from fastddpm.sample_onnx import network
    session = ort.InferenceSession(str(onnx_export("cond")[0] / "model.onnx"), providers=["CPUExecutionProvider"])
    model, cfg = load_for_sampling(runs["cond"])
    x, t, _ = example_inputs(cfg, 3, seed=5)
    labels = torch.full((3,), 4)
    for w in (2.5, 1.0, 0.0):
        with torch.no_grad():
            want = guided(model, labels, w, cfg.model.num_classes)(x, t).numpy()
        got = network(session, 3, 4, w, cfg.model.num_classes, conditional=True)(x.numpy(), t.numpy())
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"W = {w}")


def test_the_exporters_dropped_stdout_works_where_there_is_none():
    """The TorchScript exporter's C++ graph dump is dropped at file descriptor 1; a process whose stdout is closed
    (`>&-`) has none to redirect: the export runs as it is (it failed on sys.stdout being None)."""
    code = ("import os, sys\nos.close(1)\nsys.stdout = None\nfrom fastddpm.export import _fd_stdout_dropped\n"
            "with _fd_stdout_dropped():\n    done = True\nprint('ran', done, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ran True" in r.stderr, r.stderr


def test_weights_model_exports_the_raw_weights_and_says_so(runs, tmp_path, capsys):
    """`fastddpm sample --weights model` draws from the raw weights; export gave only the EMA ones, which after a
    short run or fine-tune lag far behind. With --weights model the file computes the raw network, and the card
    and export.json say which weights it holds (and quote no FID: the run measures its EMA's)."""
    out = tmp_path / "raw"
    assert main(["export", str(runs["uncond"]), "--format", "torch-export", "--out", str(out), "--weights",
                 "model"]) == 0
    raw, cfg = load_for_sampling(runs["uncond"], weights="model")
    ema, _ = load_for_sampling(runs["uncond"])
    inputs = example_inputs(cfg, 4, seed=3)
    got = torch.export.load(str(out / "model.pt2")).module()(*inputs).detach()
    with torch.no_grad():
        want, other = raw(*inputs), ema(*inputs)
    assert (want - other).abs().max() > 1e-3  # the two weight sets compute different functions
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert json.loads((out / "export.json").read_text())["checkpoint"]["weights"] == "model"
    card = (out / "README.md").read_text()
    assert "weights: raw" in card and "--weights model`" in card
    assert fid_of_these_weights([{"event": "eval", "step": 3, "images_seen": 48, "fid": 9.0}],
                                {"step": 3, "images_seen": 48, "weights": "model"}) is None
    # an ema.safetensors holds no raw weights: refused naming the file and the fix, nothing written
    capsys.readouterr()
    assert main(["export", str(runs["uncond"] / "ema.safetensors"), "--format", "safetensors", "--out",
                 str(tmp_path / "none"), "--weights", "model"]) == 2
    err = capsys.readouterr().err
    assert "ema.safetensors holds only the EMA weights" in err and "ckpt_*.pt" in err
    assert not (tmp_path / "none").exists()


def test_a_safetensors_export_of_the_raw_weights_loads_as_them_not_as_ema(runs, tmp_path, capsys):
    """The file's metadata says it holds the raw weights; reading it back called them EMA (sample and eval label
    them so) and refused --weights model on it. Now the default (EMA) is refused, naming --weights model, and the
    raw weights load as what they are."""
    out = tmp_path / "raw"
    assert main(["export", str(runs["uncond"]), "--format", "safetensors", "--out", str(out), "--weights",
                 "model"]) == 0
    raw, cfg = load_for_sampling(runs["uncond"], weights="model")
    got, _ = load_for_sampling(out, weights="model")
    inputs = example_inputs(cfg, 2, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(got(*inputs), raw(*inputs), atol=0, rtol=0)
    assert locate(out).held == "model" and locate(runs["uncond"] / "ema.safetensors").held == "ema"
    with pytest.raises(ConfigError, match=r"holds only the raw weights: load it with weights='model'"):
        fastddpm.load(out)
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(out), "--num-images", "1", "--steps", "2", "--out",
                 str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors holds only the raw weights; use --weights model" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("objective,conditional", [("edm", False), ("flow", True)])
def test_the_pt2_cards_euler_loop_draws_fastddpms_euler_images(fmnist_npz, tmp_path, monkeypatch, objective,
                                                              conditional):
    """The .pt2 card of an EDM or flow export said only `out = net(x, t)`: a user with torch alone had to write
    the sampler. Its loop, run from the folder on a fixed x_T, draws what fastddpm's Euler sampler draws with the
    same network and levels."""
    from fastddpm.config import default_spacing
    from fastddpm.diffusion.samplers import continuous_sample

    # one block of each kind, no attention: the card's loop calls whatever network the folder holds
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 3, "diffusion.objective": objective,
                                               "model.conditional": conditional, "train.num_sample_images": 4,
                                               "train.sample_steps": 2, **ONE_BLOCK_SEED, "model.attention": False})
    train(cfg, out_dir=tmp_path / "run", log=quiet)
    folder = tmp_path / "pt2"
    assert main(["export", str(tmp_path / "run"), "--format", "torch-export", "--out", str(folder)]) == 0
    card = (folder / "README.md").read_text()
    assert "x0 in [-1, 1]" in card  # the data range the network's input is made from
    code = card_code(card)
    assert code.count("n, steps = 16, 20") == 1 and code.count("torch.randn(") == 1
    x_T = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    scope: dict = {"x_T": x_T}
    monkeypatch.chdir(folder)
    exec(code.replace("n, steps = 16, 20", "n, steps = 2, 4").replace("torch.randn(", "x_T.double() if True else "
                                                                      "torch.randn("), scope)
    assert scope["images"].shape == (2, 1, 28, 28) and scope["images"].dtype == torch.uint8

    class Fixed:
        def randn(self, shape):
            return x_T.clone()

    run_cfg = locate(tmp_path / "run").config
    net = scope["net"]
    model = (lambda x, t: net(x, t, torch.full((2,), 10))) if conditional else net
    with torch.no_grad():
        ours = continuous_sample(model, schedule_from_config(run_cfg.diffusion), (2, 1, 28, 28), sampler="euler",
                                 steps=4, spacing=default_spacing("euler", objective), noise=Fixed(), device="cpu")
    assert ours.std() > 0.1
    torch.testing.assert_close(scope["x"].float(), ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("opset", ["0", "99"])
def test_an_opset_onnx_does_not_know_is_refused_before_anything_runs_or_is_written(runs, tmp_path, capsys, opset):
    """--opset 99 ran both ONNX exporters (minutes on a large model), printed torch's warning and left an empty
    --out folder, then blamed the dynamo exporter ("it wrote opset 18, not 99")."""
    pytest.importorskip("onnx", reason="onnx export is an extra: pip install 'fastddpm[onnx]'")
    import onnx

    out = tmp_path / "never"
    assert main(["export", str(runs["uncond"]), "--format", "onnx", "--out", str(out), "--opset", opset]) == 2
    err = capsys.readouterr().err
    assert f"export --opset {opset}: the installed onnx knows opsets 1 to {onnx.defs.onnx_opset_version()}" in err
    assert "Warning" not in err and not out.exists()


def test_the_card_quotes_fastddpm_evals_fid_of_exactly_the_exported_weights(fmnist_npz, tmp_path, monkeypatch):
    """After `fastddpm eval` of a checkpoint, its export's card said "FID: not measured for these weights by the
    run". It quotes eval's result where the record is of exactly these weights (eval records their digest), naming
    the record and how it was measured; an earlier checkpoint or the raw weights are other weights, and get none."""
    from fastddpm.eval import classifier, features

    # the feature network eval trains once per dataset, on a short recipe: the FID's value is not what is checked
    monkeypatch.setattr(features, "ClassifierRecipe", lambda: classifier.ClassifierRecipe(epochs=0.05, min_steps=20))
    run = tmp_path / "run"
    cfg = apply_overrides(get_preset("tiny"), {"data.source": str(fmnist_npz), "train.progress": False,
                                               "train.max_steps": 2, "train.checkpoint_every": 1,
                                               "model.attention": False, "train.num_sample_images": 2,
                                               "train.sample_steps": 2})
    train(cfg, out_dir=run, log=quiet)
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--sampler", "ddim", "--steps", "2",
                 "--no-progress"]) == 0
    record = json.loads(next((run / "eval").glob("eval_*.json")).read_text())
    assert record["checkpoint"]["step"] == 2 and len(record["checkpoint"]["weights_sha256"]) == 64
    name = "eval/eval_ddim2_n10_seed0_step2.json"
    assert (run / name).is_file()
    assert main(["export", str(run), "--format", "safetensors", "--out", str(tmp_path / "e")]) == 0
    card = (tmp_path / "e" / "README.md").read_text()
    assert (f"- FID {record['fid']:.2f} by `fastddpm eval` of these weights (the run's {name}): ddim 2 steps, 10 "
            f"samples, {record['features']['label']}\n") in card, card
    assert "not measured" not in card
    # the same weights from another file (the run's ema.safetensors, written at step 2) are still these weights
    assert main(["export", str(run / "ema.safetensors"), "--format", "safetensors", "--out", str(tmp_path / "f")]) == 0
    assert f"by `fastddpm eval` of these weights (the run's {name})" in (tmp_path / "f" / "README.md").read_text()
    for other, flags in ((run / "checkpoints" / "ckpt_000000001.pt", []), (run, ["--weights", "model"])):
        out = tmp_path / f"other{len(flags)}"
        assert main(["export", str(other), "--format", "safetensors", "--out", str(out), *flags]) == 0
        card = (out / "README.md").read_text()
        assert "fastddpm eval` of these" not in card and "- FID: not measured for these weights" in card


def test_the_onnx_example_says_a_conditional_model_drawn_without_a_class_is_unconditional(onnx_export, tmp_path,
                                                                                          capsys):
    """As `fastddpm sample` notes it: the null class's images, and how to draw a class."""
    from fastddpm import sample_onnx as example

    small = ["--num", "2", "--steps", "2", "--out", str(tmp_path / "g.png")]
    assert example.main([str(onnx_export("cond")[0]), *small]) == 0
    assert ", unconditional (the null class; --class NAME|ID draws one of the model's 10 classes, guided at W = 2)" \
        in capsys.readouterr().out
    assert example.main([str(onnx_export("uncond")[0]), *small]) == 0
    assert "unconditional" not in capsys.readouterr().out
