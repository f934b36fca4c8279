"""The Python API (fastddpm.api): train, load, sample, evaluate, and the README's example run as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
import pytest

import fastddpm
from fastddpm.cli import main
from fastddpm.config import ConfigError


def quiet(*args, **kwargs):
    pass


# A final grid of 4 images in 2 sampler steps (the tiny preset's: 16 in 10), for the runs whose grid nobody looks at
SMALL_GRID = dict(num_sample_images=4, sample_steps=2)


@pytest.fixture(scope="session")
def api_run(tmp_path_factory, fmnist_npz):
    out = tmp_path_factory.mktemp("api") / "run"
    # its final grid is 4 images in 2 sampler steps (the preset's: 16 in 10): no test here looks at it
    result = fastddpm.train("tiny", out=out, data=str(fmnist_npz), max_steps=6, log_every=3, progress=False,
                            num_sample_images=4, sample_steps=2, log=quiet)
    return result


def test_train_takes_a_preset_and_config_fields_as_keywords(api_run):
    assert api_run.step == 6 and api_run.images_seen == 6 * 16 and api_run.last_loss > 0
    assert (api_run.run_dir / "ema.safetensors").is_file() and (api_run.run_dir / "loss.png").is_file()
    import fastddpm.trainer.loop  # noqa: F401  (the trainer's package has its own name: fastddpm.train stays the API's)

    assert fastddpm.train is fastddpm.api.train


def test_train_names_a_field_it_cannot_place(tmp_path):
    with pytest.raises(ConfigError, match="in no config section"):
        fastddpm.train("tiny", out=tmp_path, max_stepz=3)
    with pytest.raises(ConfigError, match=r"did you mean max_steps \(train.max_steps\)"):  # the fix, named
        fastddpm.train("tiny", out=tmp_path, max_stepz=3)


def test_sample_is_the_clis_sample(api_run, tmp_path):
    """Same seed: the same images as `fastddpm sample` (at the same batch size: bit for bit); deterministic; a
    draw split with first_image / --first-image is the draw whole (equal where the batches are; elsewhere to a
    pixel level of float rounding); PIL on request."""
    model = fastddpm.load(api_run.run_dir)
    images = model.sample(5, steps=3, seed=7, batch_size=2)
    assert images.dtype == np.uint8 and images.shape == (5, 1, 28, 28)
    assert np.array_equal(images, model.sample(5, steps=3, seed=7, batch_size=2))
    assert main(["sample", "--checkpoint", str(api_run.run_dir), "--num-images", "5", "--steps", "3", "--seed", "7",
                 "--batch-size", "2", "--no-progress", "--out", str(tmp_path)]) == 0
    cli = np.load(next(tmp_path.glob("*.npz")))["images"]
    assert np.array_equal(images, cli)
    wide = tmp_path / "wide"
    assert main(["sample", "--checkpoint", str(api_run.run_dir), "--num-images", "5", "--steps", "3", "--seed", "7",
                 "--batch-size", "5", "--no-progress", "--out", str(wide)]) == 0
    one_batch = np.load(next(wide.glob("*.npz")))["images"].astype(int)
    assert np.abs(one_batch - images.astype(int)).max() <= 1 and (one_batch != images).mean() < 0.01
    assert np.array_equal(model.sample(3, steps=3, seed=7, batch_size=2, first_image=2)[:2], images[2:4])
    split = tmp_path / "split"
    assert main(["sample", "--checkpoint", str(api_run.run_dir), "--num-images", "3", "--first-image", "2", "--steps",
                 "3", "--seed", "7", "--batch-size", "3", "--no-progress", "--out", str(split)]) == 0
    (npz,) = split.glob("*.npz")
    assert "_n3_from2_seed7_" in npz.name
    tail = np.load(npz)["images"].astype(int)
    assert np.abs(tail - images[2:].astype(int)).max() <= 1 and (tail != images[2:]).mean() < 0.01
    with pytest.raises(ConfigError, match="first_image=-1 must be >= 0"):
        model.sample(1, steps=1, first_image=-1)
    assert main(["sample", "--checkpoint", str(api_run.run_dir), "--first-image", "-3", "--no-progress"]) == 2
    pictures = model.sample(2, steps=2, output="pil")
    assert len(pictures) == 2 and pictures[0].size == (28, 28) and pictures[0].mode == "L"
    with pytest.raises(ConfigError, match="unconditional"):
        model.sample(2, guidance=3.0)
    with pytest.raises(Exception, match="does not exist"):
        fastddpm.load(tmp_path / "nowhere")


def test_sample_refuses_a_precision_it_does_not_know(api_run):
    """"half" or "bfloat16" were read as fp16 (CPU) or fp32 (CUDA) without a word."""
    model = fastddpm.load(api_run.run_dir, device="cpu")
    for name in ("half", "bfloat16", "FP32"):
        with pytest.raises(ConfigError, match=rf"precision='{name}' is not one of auto, fp32, bf16, fp16"):
            model.sample(1, steps=1, precision=name)


def test_counts_and_seeds_are_whole_numbers_and_eta_a_number(api_run):
    """2.5 steps, a bool or text as a count ended in a TypeError deep in sampling (steps=2.5: "slice indices must
    be integers"), and seed=1.5 or "a" sampled without a word; numpy ints and whole floats are counts."""
    model = fastddpm.load(api_run.run_dir, device="cpu")
    want = model.sample(2, steps=2, seed=3)
    assert np.array_equal(model.sample(np.int64(2), steps=2.0, seed=np.int32(3), batch_size=torch.tensor(2)), want)
    for kw, shown in ((dict(n=2.5), "n=2.5"), (dict(n=True), "n=True"), (dict(n=2, steps=2.5), "steps=2.5"),
                      (dict(n=2, steps="3"), "steps='3'"), (dict(n=2, seed=1.5), "seed=1.5"),
                      (dict(n=2, seed="a"), "seed='a'"), (dict(n=2, batch_size=1.5), "batch_size=1.5"),
                      (dict(n=2, first_image=0.5), "first_image=0.5"), (dict(n=2, steps=float("nan")), "steps=nan")):
        with pytest.raises(ConfigError, match=rf"^sample: {re.escape(shown)} must be a whole number$"):
            model.sample(**kw)
    with pytest.raises(ConfigError, match=r"^sample: eta='0' must be a number$"):
        model.sample(2, sampler="ddim", steps=2, eta="0")
    with pytest.raises(ConfigError, match=r"^evaluate: num_samples=1000.5 must be a whole number$"):
        fastddpm.evaluate(api_run.run_dir, num_samples=1000.5)


def test_a_resume_without_a_config_continues_the_run_with_its_own(tmp_path, fmnist_npz):
    """As `fastddpm train --resume latest` without --preset: the run's own config, not cpu-demo's (whose U-Net
    does not fit a tiny run's checkpoint) nor one that drops the settings the run was started with; a config file
    that names no preset is a layer over the run's config, as --config FILE is."""
    import json

    out = tmp_path / "run"
    # grids of 4 images in 2 sampler steps (the preset's: 16 in 10), kept by each resume as the run's own
    fastddpm.train("tiny", out=out, data=str(fmnist_npz), max_steps=2, lr=3e-3, progress=False, num_sample_images=4,
                   sample_steps=2, log=quiet)
    assert fastddpm.train(out=out, resume="latest", max_steps=3, log=quiet).step == 3
    saved = json.loads((out / "config.json").read_text())
    assert saved["preset"] == "tiny" and saved["train"]["lr"] == 3e-3
    settings = tmp_path / "more.json"
    settings.write_text(json.dumps({"train": {"max_steps": 4}}))
    assert fastddpm.train(settings, out=out, resume="latest", log=quiet).step == 4
    saved = json.loads((out / "config.json").read_text())
    assert saved["preset"] == "tiny" and saved["train"]["lr"] == 3e-3 and saved["train"]["max_steps"] == 4


@pytest.fixture
def fashion_mnist_by_name():
    """The named source "fashion-mnist" as a user has it (Debian's package); a copy elsewhere (FASTDDPM_FMNIST_DIR,
    e.g. on a GPU machine) is put where the named source looks first: the session's private cache."""
    import os
    import shutil

    from conftest import FMNIST_DIR

    if not (FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST files are missing: run `apt-get install dataset-fashion-mnist`")
    if FMNIST_DIR != Path("/usr/share/datasets/fashion-mnist"):
        target = Path(os.environ["FASTDDPM_CACHE"]) / "downloads" / "fashion-mnist"
        if not target.is_dir():
            shutil.copytree(FMNIST_DIR, target)


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, fashion_mnist_by_name):
    """The README's Python block, executed unchanged; its run goes to a temporary folder, and the feature network
    that evaluate() trains once per dataset is trained on 3,000 images instead of 4 epochs (the FID's value is not
    what this test checks; training the full one took over two minutes here)."""
    from fastddpm.eval import classifier, features

    monkeypatch.setattr(features, "ClassifierRecipe", lambda: classifier.ClassifierRecipe(epochs=0.05, min_steps=20))
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"### From Python\n.*?```python\n(.*?)```", readme, re.S).group(1)
    assert 'fastddpm.train("tiny", out="runs/api-demo"' in block
    monkeypatch.chdir(tmp_path)
    printed = []
    exec(compile(block, "README.md", "exec"), {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    assert printed[0].startswith("40 ") and re.match(r"FID \d+\.\d \(fastddpm-features", printed[1])
    assert (tmp_path / "runs" / "api-demo" / "samples" / "final.png").is_file()


@pytest.mark.parametrize("cuda, preset", [(False, "cpu-demo-cond"), (True, "seed-1layer")])
def test_without_a_config_the_api_starts_from_the_clis_default_preset(monkeypatch, cuda, preset):
    """fastddpm.train(out=...) trains what `fastddpm train --out ...` trains: the same preset for the device."""
    from fastddpm.api import _config
    from fastddpm.cli import build_parser, resolve_train_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    lines = []
    assert _config(None, {}, log=lines.append).preset == preset
    assert lines == [f"preset: {preset} (no config given; {'CUDA is available' if cuda else 'no CUDA device'})"]
    parser, dests = build_parser()
    assert resolve_train_config(parser.parse_args(["train", "--out", "x"]), dests).preset == preset


def test_sample_out_may_name_the_grid_and_may_not_be_empty(api_run, tmp_path, capsys):
    """--out x/grid.png made a folder named grid.png; --out "" wrote into RUN_DIR/samples without a word."""
    args = ["sample", "--checkpoint", str(api_run.run_dir), "--num-images", "2", "--steps", "2", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "x" / "grid.png")]) == 0
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["grid.npz", "grid.png"]
    assert np.load(tmp_path / "x" / "grid.npz")["images"].shape == (2, 1, 28, 28)
    (tmp_path / "shots.png").mkdir()  # a folder of that name stays a folder
    assert main([*args, "--out", str(tmp_path / "shots.png")]) == 0
    assert len(list((tmp_path / "shots.png").glob("*_n2_seed0_*.npz"))) == 1
    samples = Path(api_run.run_dir) / "samples"
    before = sorted(samples.glob("*"))
    capsys.readouterr()
    assert main([*args, "--out", ""]) == 2
    assert '--out "": give the folder for the grid and the .npz' in capsys.readouterr().err
    assert sorted(samples.glob("*")) == before


def test_the_api_spells_its_own_arguments_and_takes_log_none(api_run, tmp_path, capsys):
    """Errors named flags (--weights ema, --resume, --inception), a bare ValueError came after the checkpoint was
    read, preset= was pointed to the resize field, and log=None was a TypeError after config.json was written."""
    model = fastddpm.load(api_run.run_dir, device="cpu")
    with pytest.raises(ConfigError, match=r"^fastddpm.load: weights='raw' is not one of ema, model$"):
        fastddpm.load(api_run.run_dir, weights="raw")
    ema = Path(api_run.run_dir) / "ema.safetensors"
    with pytest.raises(ConfigError, match=r"holds only the EMA weights: load it with weights='ema'"):
        fastddpm.load(ema, weights="model")
    with pytest.raises(ConfigError, match=r"^inception='/nowhere.pth': no such file.*inception='auto'"):
        fastddpm.evaluate(api_run.run_dir, inception="/nowhere.pth")
    with pytest.raises(Exception, match=r"^resume='/nowhere.pt' does not exist\. Pass latest \(the newest "
                                        r"checkpoint in out\)"):
        fastddpm.train("tiny", out=tmp_path / "r", resume="/nowhere.pt")
    with pytest.raises(ConfigError, match=r"preset='tiny': the preset is the first argument, fastddpm.train\('tiny'"):
        fastddpm.train(out=tmp_path / "r", preset="tiny")
    capsys.readouterr()
    result = fastddpm.train("tiny", out=tmp_path / "quiet", data=model.cfg.data.source, max_steps=1, progress=False,
                            log=None, **SMALL_GRID)
    assert result.step == 1 and capsys.readouterr().out == ""
    assert "train" in dir(fastddpm) and "evaluate" in dir(fastddpm)  # tab completion lists the lazy names


def test_train_names_the_run_folder_and_resume_as_its_keywords(api_run, tmp_path):
    """fastddpm.train's refusals about the run folder named the command's flags (--resume latest, another --out)
    to a caller who passes out= and resume=."""
    from fastddpm.rundir.lock import RunFolderLock

    run_dir, data = Path(api_run.run_dir), fastddpm.load(api_run.run_dir, device="cpu").cfg.data.source
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(ConfigError, match=r"already holds a run's checkpoints .* continue that run with "
                                          r"resume='latest', or start the new one in another out \(") as e:
        fastddpm.train("tiny", out=run_dir, data=data, max_steps=1, progress=False, log=None)
    assert "--" not in str(e.value) and sorted(p.name for p in run_dir.iterdir()) == before
    busy = tmp_path / "busy"
    busy.mkdir()
    with RunFolderLock(busy), pytest.raises(ConfigError) as e:
        fastddpm.train("tiny", out=busy, data=data, max_steps=1, progress=False, log=None)
    assert str(e.value).startswith(f"out={str(busy)!r}: another fastddpm train is writing this run folder (pid ")
    assert "continue with resume='latest'; or give another out" in str(e.value) and "--" not in str(e.value)


def test_load_leaves_the_callers_random_sequence_as_it_was(api_run):
    """Building the U-Net drew its (then replaced) initial weights from the global RNG: after torch.manual_seed(0),
    a notebook's next torch.randn differed by whether a model had been loaded in between."""
    torch.manual_seed(0)
    want = torch.randn(4)
    torch.manual_seed(0)
    fastddpm.load(api_run.run_dir, device="cpu")
    assert torch.equal(torch.randn(4), want)


def test_a_log_that_is_no_function_is_refused_before_the_run_folder_is_written(tmp_path, api_run):
    """log=True (or a file name) was a TypeError from inside the trainer, after config.json and run.json were
    written into out."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^fastddpm.train: log=True is not a function: pass one that takes a line "
                                          r"\(print, .*or None to say nothing$"):
        fastddpm.train("tiny", out=out, max_steps=1, log=True)
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"^evaluate: log='eval.txt' is not a function"):
        fastddpm.evaluate(api_run.run_dir, num_samples=10, log="eval.txt")


def test_a_keyword_given_as_text_or_of_another_type_is_refused_not_read_as_the_command_line_reads_text(tmp_path):
    """fastddpm.train(conditional="yes") was read as the flag's text (True; "no" False), lr="1e-3" as a number and
    down_channels="16,32,32" as a list: a keyword of another type is refused before any work, naming it, its
    field, what the field takes and the value to pass. Values of the field's type pass, and the command line and
    config files still read text."""
    import numpy as np

    from fastddpm.config import check_keyword_types, resolve_config

    out = tmp_path / "run"
    for keywords, says in (
            (dict(conditional="yes"), r"conditional='yes' is a str, and model.conditional takes True or False: pass "
                                      r"conditional=True \(a Python keyword is taken as it is; text is read"),
            (dict(max_steps="1000"), r"max_steps='1000' is a str, and train.max_steps takes a whole number \(an int\) "
                                     r"or None: pass max_steps=1000 "),
            (dict(lr="1e-3"), r"lr='1e-3' is a str, and train.lr takes a number: pass lr=0.001 "),
            (dict(lr=True), r"lr=True is a bool, and train.lr takes a number \("),
            (dict(down_channels="16,32,32"), r"down_channels='16,32,32' is a str, and model.down_channels takes a list "
                                             r"or tuple of ints: pass down_channels=\(16, 32, 32\)"),
            (dict(batch_size="8"), r"batch_size='8' is a str, and train.batch_size takes .* pass batch_size=8 "),
            ({"data.hflip": "off"}, r"data.hflip='off' is a str, and data.hflip takes True or False: pass "
                                    r"data.hflip=False")):
        with pytest.raises(ConfigError, match=rf"^fastddpm.train: {says}"):
            fastddpm.train("tiny", out=out, log=None, **keywords)
    assert not out.exists()
    check_keyword_types({"conditional": False, "max_steps": np.int64(3), "lr": 1, "grad_clip": None,
                         "batch_size": "auto", "data.source": tmp_path, "compile": False, "log_to": "tensorboard",
                         "down_channels": [16, 32, 32], "adam_betas": (0.9, 0.99)}, "fastddpm.train")
    cfg = resolve_config("tiny", layers=[("command line", {"model.conditional": "yes", "train.lr": "1e-3"})])
    assert cfg.model.conditional is True and cfg.train.lr == 1e-3


@pytest.mark.parametrize("value", [None, "", 3])
def test_a_path_that_is_none_empty_or_no_path_is_named_with_what_to_pass(tmp_path, monkeypatch, value):
    """load(None) and train(out=None) were pathlib's TypeError from deep inside; out="" took the working directory
    as the run's folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^fastddpm.load: path={value!r} is not a path: pass a run directory, "
                                          r"a checkpoint file, a safetensors export or a diffusers folder, as a str "
                                          r"or a pathlib.Path$"):
        fastddpm.load(value)
    with pytest.raises(ConfigError, match=rf"^evaluate: path={value!r} is not a path: pass a run directory"):
        fastddpm.evaluate(value)
    with pytest.raises(ConfigError, match=rf"^fastddpm.train: out={value!r} is not a path: pass the run's folder "):
        fastddpm.train("tiny", out=value, max_steps=1, log=None)
    assert list(tmp_path.iterdir()) == []


def test_evaluate_with_guidance_on_an_unconditional_run_names_the_fix(api_run):
    """It said the model was unconditional, not what to do."""
    with pytest.raises(ConfigError, match=r"^evaluate: guidance=2 steers toward a class: it needs a conditional "
                                          r"model \(trained with conditional=True\); this one is unconditional: "
                                          r"drop guidance$"):
        fastddpm.evaluate(api_run.run_dir, num_samples=10, guidance=2, log=None)


def test_a_model_shows_itself_in_one_line(api_run):
    """A notebook showing `model` printed the dataclass's repr: every layer of the U-Net and every config field."""
    model = fastddpm.load(api_run.run_dir, device="cpu")
    size = sum(p.numel() for p in model.net.parameters())
    assert repr(model) == f"Model(tiny preset, {size:,} parameters, unconditional, 1x28x28 images, ddpm objective, cpu)"


def test_train_leaves_the_callers_random_sequence_as_it_was(tmp_path, fmnist_npz):
    """A run seeds torch's global CPU generator for its initial weights: after fastddpm.train, a notebook's
    torch.randn continued from the run's seed, not from its own torch.manual_seed."""
    torch.manual_seed(0)
    want = torch.randn(4)
    torch.manual_seed(0)
    fastddpm.train("tiny", out=tmp_path / "run", data=str(fmnist_npz), max_steps=1, progress=False, log=None,
                   **SMALL_GRID)  # its final grid still draws: a sampler on the global generator would show
    assert torch.equal(torch.randn(4), want)


def test_train_seeds_no_gpus_generator_but_its_own_devices(tmp_path, fmnist_npz, monkeypatch):
    """torch.manual_seed also seeds every GPU's generator (queued until CUDA starts where it has not): a run on
    the CPU, or on cuda:0, reset the generators a notebook draws from on its other GPUs. A run seeds the CPU's
    and its own device's alone (rng.seed_torch)."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    fastddpm.train("tiny", out=tmp_path / "run", data=str(fmnist_npz), max_steps=1, progress=False, log=None,
                   device="cpu", **SMALL_GRID)
    assert seeded == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_on_a_gpu_leaves_the_callers_cuda_random_sequence_as_it_was(tmp_path, fmnist_npz):
    """The run seeds its device's CUDA generator (dropout draws from it) and advances it: forked, so that a
    notebook's torch.randn on that GPU continues after fastddpm.train as it would have without it."""
    torch.cuda.manual_seed(0)
    want = torch.randn(4, device="cuda")
    torch.cuda.manual_seed(0)
    fastddpm.train("tiny", out=tmp_path / "run", data=str(fmnist_npz), max_steps=2, progress=False, log=None,
                   device="cuda", compile="off", cuda_graphs="off")
    assert torch.equal(torch.randn(4, device="cuda"), want)


@pytest.mark.parametrize("kind", ["missing", "torchvision", "no state dict"])
def test_inception_file_errors_name_the_argument_as_the_caller_spelt_it(api_run, tmp_path, capsys, kind):
    """fastddpm.evaluate(inception=...) was told `--inception PATH` (a flag a Python caller has none of) when the
    file was missing or was other weights; `fastddpm eval` keeps its flag. Both spellings come from one place."""
    weights = tmp_path / f"{kind.replace(' ', '_')}.pth"
    if kind == "torchvision":  # torchvision's ImageNet Inception-v3 is told by its 1000-way fc, before any loading
        torch.save({"fc.weight": torch.zeros(1000, 2048), "fc.bias": torch.zeros(1000)}, weights)
    elif kind == "no state dict":
        torch.save([torch.zeros(3)], weights)
    says = {"missing": "no such file", "torchvision": "fc.weight is 1000-way: this looks like torchvision's",
            "no state dict": "expected a state dict, got list"}[kind]
    with pytest.raises(ConfigError) as caught:
        fastddpm.evaluate(api_run.run_dir, inception=str(weights), num_samples=10, device="cpu", log=None)
    text = str(caught.value)
    assert text.startswith(f"inception={str(weights)!r}: {says}") and "--" not in text
    if kind == "missing":  # the way to have the weights found, as the API takes it
        assert "inception='auto' instead finds" in text
    assert main(["eval", "--checkpoint", str(api_run.run_dir), "--inception", str(weights), "--num-samples", "10",
                 "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--inception {weights}: {says}" in err and "inception=" not in err
    if kind == "missing":
        assert "--features inception instead finds" in err
